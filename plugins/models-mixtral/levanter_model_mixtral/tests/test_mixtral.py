"""Mixtral against Hugging Face transformers (logits after import and export, stacked and
unrolled, greedy decoding, settings we refuse), training from the nano config with the router
losses logged, and discovery, through
:class:`~levanter_core.testing.model_family.ModelFamilyTests`; then what only Mixtral has (the
per-expert checkpoint layout, the load-balancing and z losses)."""

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from levanter_core.hf import hf_state_dict_shapes, to_hf_state_dict  # noqa: E402
from levanter_core.hf.bridge import load_hf_model  # noqa: E402
from levanter_core.hf.checkpoint import HfCheckpoint  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402
from levanter_core.testing import read_metrics, tiny_hf_config  # noqa: E402
from levanter_core.testing.model_family import ModelFamilyTests  # noqa: E402
from levanter_model_mixtral.mixtral import MixtralConfig  # noqa: E402

# the tiny decoder with 4 experts, 2 per token
EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}


def mixtral(**keys):
    return tiny_hf_config(transformers.MixtralConfig, **{**EXPERTS, **keys})


# check_hf_parity compares logits over 24 positions, so a window of 8 is exercised.
HF_CONFIGS = {
    "top2-of-4-gqa": mixtral,
    "sliding-window": lambda: mixtral(sliding_window=8),
    # one expert per token (weight 1 after renormalizing), multi-query attention, heads twice
    # as wide as hidden / heads, tied embeddings and a scaled rotary embedding
    "top1-of-3-mqa-tied": lambda: mixtral(
        num_local_experts=3,
        num_experts_per_tok=1,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    ),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random Hugging Face Mixtral (top-2 of 4) saved with save_pretrained, and the model."""
    directory = str(tmp_path_factory.mktemp("hf"))
    model = random_hf_model(mixtral())
    model.save_pretrained(directory)
    return directory, model


def test_checkpoint_layout_is_hugging_faces_per_expert_one(hf_checkpoint):
    directory, _ = hf_checkpoint
    stored = {name: tuple(t.shape) for name, t in HfCheckpoint(directory).tensors.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in stored
    config = MixtralConfig.from_hf_config(mixtral().to_dict())
    ours = {name: tuple(s.shape) for name, s in hf_state_dict_shapes(config, hax.Axis("vocab", 128)).items()}
    assert ours == stored


def test_load_balancing_loss_is_hugging_faces_aux_loss(hf_checkpoint):
    directory, theirs = hf_checkpoint
    tokens = np.random.default_rng(0).integers(0, 128, size=(2, 24))
    ids = torch.as_tensor(tokens)
    with torch.no_grad():
        out = theirs(ids, labels=ids, output_router_logits=True)
        plain_loss = theirs(ids, labels=ids).loss
    coef = theirs.config.router_aux_loss_coef
    # aux_loss is the unweighted value: the coefficient only enters the loss it is added to
    np.testing.assert_allclose(float(out.loss - coef * out.aux_loss), float(plain_loss), rtol=1e-6)
    router_logits = torch.cat(out.router_logits).float()  # (layers x tokens, experts)
    their_z_loss = float((torch.logsumexp(router_logits, dim=-1) ** 2).mean())

    ours = load_hf_model(directory).model
    named = hax.named(jnp.asarray(tokens, dtype=jnp.int32), ("batch", "position"))
    _, aux = eqx.filter_jit(lambda m, x: m.activations_with_aux(x))(ours, named)
    balance, z_loss = float(aux.metrics["moe/load_balancing_loss"]), float(aux.metrics["moe/router_z_loss"])
    assert abs(balance - float(out.aux_loss)) <= 1e-5
    assert abs(balance - 2.0) > 1e-3  # not the value of perfectly uniform routing
    assert abs(z_loss - their_z_loss) <= 1e-5
    config = ours.config
    assert (config.router_aux_loss_coef, config.router_z_loss_coef) == (coef, 0.001)
    np.testing.assert_allclose(float(aux.loss), coef * balance + 0.001 * z_loss, rtol=1e-6)


def test_unrolled_layers_read_and_write_the_same_checkpoint(hf_checkpoint):
    directory, theirs = hf_checkpoint
    scanned = load_hf_model(directory).model
    unrolled = load_hf_model(directory, config=scanned.config.model_copy(update={"scan_layers": False})).model
    tokens = np.random.default_rng(1).integers(0, 128, size=(2, 24))
    np.testing.assert_allclose(our_logits(unrolled, tokens), hf_logits(theirs, tokens), atol=1e-4)
    exported_scanned, exported_unrolled = to_hf_state_dict(scanned), to_hf_state_dict(unrolled)
    assert exported_scanned.keys() == exported_unrolled.keys()
    for name, array in exported_scanned.items():
        np.testing.assert_array_equal(exported_unrolled[name], array)


def test_jitter_noise_and_too_many_experts_are_rejected():
    with pytest.raises(ValueError, match="router_jitter_noise"):
        MixtralConfig.from_hf_config(mixtral(router_jitter_noise=0.1).to_dict())
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(3\) cannot exceed num_local_experts \(2\)"):
        MixtralConfig(num_local_experts=2, num_experts_per_tok=3)


def _proportional_rope() -> dict:
    hf = mixtral().to_dict()
    hf["rope_parameters"]["rope_type"] = "proportional"  # a rope type transformers knows and we do not
    return hf


class TestMixtral(ModelFamilyTests):
    hf_configs = HF_CONFIGS
    unrolled = ("top1-of-3-mqa-tied",)
    generation = ("sliding-window",)
    refused = {
        "partial_rotary_factor = 0.5": lambda: mixtral(partial_rotary_factor=0.5).to_dict(),
        "rope type 'proportional' is not supported": _proportional_rope,
    }
    package = "levanter_model_mixtral"
    nano_configs = ("mixtral_nano.yaml",)
    golden_losses = "assets/losses"  # the 20-step loss curve of each (levanter_core.testing.golden)
    distribution = "levanter-model-mixtral"
    types = {"model": ["mixtral"]}

    def check_nano_run(self, nano_config, result):
        """Also: the router losses are logged at every step."""
        super().check_nano_run(nano_config, result)
        train_steps = read_metrics(result.run_dir, key="train/loss")
        assert [r["step"] for r in train_steps] == list(range(1, self.nano_run_steps + 1))
        for record in train_steps:
            # with 4 experts the balancing loss lies in (0, 4]; both are finite and positive
            assert 0.0 < record["moe/load_balancing_loss"] <= 4.0
            assert 0.0 < record["moe/router_z_loss"] < 100.0
