"""Mixtral against Hugging Face transformers (logits, checkpoint layout, the load-balancing
loss), training from the nano config with the router losses logged, and discovery through
the entry point."""

import json
import math
import os
import re

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from levanter_core.hf import hf_state_dict_shapes, to_hf_state_dict
from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import config_from_hf, load_hf_model
from levanter_core.hf.checkpoint import HfCheckpoint
from levanter_core.hf.parity import check_hf_parity, hf_logits, our_logits, random_hf_model, check_generation_parity
from levanter_core.testing import listed_plugin, train_briefly
from levanter_model_mixtral.mixtral import MixtralConfig

# the nano config ships inside the package, beside these tests
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts_per_tok=2,
)

# check_hf_parity compares logits over 24 positions, so a window of 8 is exercised.
HF_CONFIGS = {
    "top2-of-4-gqa": lambda: transformers.MixtralConfig(**TINY),
    "sliding-window": lambda: transformers.MixtralConfig(**TINY, sliding_window=8),
    # one expert per token (weight 1 after renormalizing), multi-query attention, heads twice
    # as wide as hidden / heads, tied embeddings and a scaled rotary embedding
    "top1-of-3-mqa-tied": lambda: transformers.MixtralConfig(
        **{**TINY, "num_local_experts": 3, "num_experts_per_tok": 1, "num_key_value_heads": 1},
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    ),
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_matches_hugging_face(name, tmp_path):
    check_hf_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random Hugging Face Mixtral (top-2 of 4) saved with save_pretrained, and the model."""
    directory = str(tmp_path_factory.mktemp("hf"))
    model = random_hf_model(transformers.MixtralConfig(**TINY))
    model.save_pretrained(directory)
    return directory, model


def test_checkpoint_layout_is_hugging_faces_per_expert_one(hf_checkpoint):
    directory, _ = hf_checkpoint
    stored = {name: tuple(t.shape) for name, t in HfCheckpoint(directory).tensors.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in stored
    config = MixtralConfig.from_hf_config(transformers.MixtralConfig(**TINY).to_dict())
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
        MixtralConfig.from_hf_config(transformers.MixtralConfig(**TINY, router_jitter_noise=0.1).to_dict())
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(3\) cannot exceed num_local_experts \(2\)"):
        MixtralConfig(num_local_experts=2, num_experts_per_tok=3)



def test_unrolled_layers_match_hugging_face_through_import_and_export(tmp_path):
    check_hf_parity(HF_CONFIGS["top1-of-3-mqa-tied"](), str(tmp_path), scan_layers=False).assert_matches(configs=False)


@pytest.mark.parametrize(
    "hf_config, message",
    [
        (lambda: transformers.MixtralConfig(**TINY, partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (
            lambda: transformers.MixtralConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            "rope type 'proportional' is not supported",
        ),
    ],
)
def test_unsupported_rotary_settings_are_refused_by_name(hf_config, message):
    hf = hf_config().to_dict()
    if "proportional" in message:  # a rope type transformers knows and we do not
        hf["rope_parameters"]["rope_type"] = "proportional"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(hf)

@pytest.fixture(scope="module")
def nano_run(tmp_path_factory):
    return train_briefly(os.path.join(CONFIGS, "mixtral_nano.yaml"), str(tmp_path_factory.mktemp("nano")))


@pytest.mark.slow
def test_nano_config_trains(nano_run):
    assert nano_run.final_step == 4
    assert math.isfinite(nano_run.first_loss) and math.isfinite(nano_run.last_loss)
    assert nano_run.final_eval_loss < nano_run.initial_eval_loss


@pytest.mark.slow
def test_training_logs_the_router_losses(nano_run):
    with open(os.path.join(nano_run.run_dir, "metrics.jsonl")) as f:
        train_steps = [r for r in map(json.loads, f) if "train/loss" in r]
    assert [r["step"] for r in train_steps] == [1, 2, 3, 4]
    for record in train_steps:
        # with 4 experts the balancing loss lies in (0, 4]; both are finite and positive
        assert 0.0 < record["moe/load_balancing_loss"] <= 4.0
        assert 0.0 < record["moe/router_z_loss"] < 100.0


def test_discovered_through_its_entry_point():
    ours = listed_plugin("levanter-model-mixtral")
    assert ours["error"] is None and ours["types"] == {"model": ["mixtral"]}
    assert set(ours["hooks"]) == {"register_models", "model_type_for_hf_config"}


# Greedy decoding through the engine's key/value cache, three prompts of different lengths in
# one batch, 48 new tokens each: the same tokens as transformers' generate
@pytest.mark.parametrize("name", ["sliding-window"])
def test_greedy_decoding_matches_transformers_generate(name, tmp_path):
    check_generation_parity(HF_CONFIGS[name](), str(tmp_path)).assert_matches()
