"""Values logged with ``jit_log`` inside the compiled step come back with the step's metrics,
averaged over microbatches like the loss, and through a whole run reach the trackers."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.optim.adam import AdamConfig
from levanter_core.tracker import jit_log
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer

Embed = hax.Axis("embed", 4)


class Centre(eqx.Module):
    w: hax.NamedArray


def logging_loss(model, batch, *, key):
    tokens = batch.tokens.astype(jnp.float32)
    jit_log({"debug/mean_token": hax.mean(tokens).array, "debug/constant": 3.0})
    return hax.mean((model.w - hax.mean(tokens).array) ** 2).array, {}


@pytest.mark.parametrize("per_device", [-1, 2], ids=["one-batch", "four-microbatches"])
def test_values_logged_inside_the_step_come_back_with_its_metrics(per_device):
    config = TrainerConfig(train_batch_size=8, num_train_steps=10, per_device_parallelism=per_device)
    optimizer = AdamConfig(learning_rate=0.01, warmup=0).build_for_trainer(config.num_train_steps)
    trainer = Trainer(config, optimizer, logging_loss, mesh=make_mesh(config))
    state = trainer.init_state(lambda key: Centre(hax.random.normal(key, (Embed,))), jax.random.PRNGKey(0))
    tokens = np.arange(8 * 16).reshape(8, 16) % 10

    state, metrics = trainer.train_step(state, tokens)

    assert float(metrics["debug/mean_token"]) == pytest.approx(tokens.mean())
    assert float(metrics["debug/constant"]) == 3.0
    jit_log({"ignored": 1.0})  # outside a step being traced: nothing to collect, no error


def test_a_non_scalar_is_refused():
    from levanter_core.tracker.jit_log import collecting

    with collecting(), pytest.raises(ValueError, match="'debug/vector' should be a scalar"):
        jit_log({"debug/vector": jnp.ones(3)})


def test_a_logged_value_reaches_the_trackers_of_a_run(tmp_path, monkeypatch):
    """A model whose forward pass calls jit_log: its value is in metrics.jsonl at every step."""
    import levanter_model_gpt2.gpt2 as gpt2

    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training

    original = gpt2.Gpt2LMHeadModel.activations

    def activations(self, input_ids, *, key=None, attn_mask=None):
        hidden = original(self, input_ids, key=key, attn_mask=attn_mask)
        jit_log({"debug/hidden_rms": jnp.sqrt(jnp.mean(jnp.square(hidden.array)))})
        return hidden

    monkeypatch.setattr(gpt2.Gpt2LMHeadModel, "activations", activations)
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(50))], "cache_dir": str(tmp_path / "cache")}
    config, _ = load_train_config(run_config(tmp_path, data, run_id="logged", steps=3))
    run_training(config, progress=False)

    lines = metrics(tmp_path, "logged")
    values = [m["debug/hidden_rms"] for m in lines if "train/loss" in m]
    assert len(values) == 3 and all(v > 0 for v in values)
