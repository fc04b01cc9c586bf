"""Train one config under several axis settings in one process, and report what happened.

Run by tests/test_sharding.py in a subprocess whose environment sets the number of
simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), so that JAX
starts once for all the settings::

    python tests/sharding_run.py CONFIG.yaml RUNS.json OUT.json

``RUNS.json`` maps a name to a list of command-line overrides of ``CONFIG.yaml`` (the run id
is set to the name). ``OUT.json`` gets, per name: the per-step training losses and the
evaluation losses from ``metrics.jsonl``, and, for a fresh state of the same config after
one training step, which mesh axes each axis of each model and optimizer-state array is
split over (``{path: {axis: mesh axes or None}}``) and the shape of one device's piece.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def train(config_path: str, name: str, overrides: list[str]) -> dict:
    """Train through the real path (``run_training``); the losses it logged."""
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training
    from levanter_core.testing import logged

    config, _ = load_train_config(config_path, [*overrides, "--trainer.id", name])
    result = run_training(config, config_path=config_path, progress=False)
    return {
        "train": logged(result.run_dir, "train/loss"),
        "eval": logged(result.run_dir, "eval/loss"),
        "config": config,
    }


def shardings_after_one_step(config) -> dict:
    """Where each array of the state lives after one training step of a fresh state."""
    import jax
    from haliax import Axis, NamedArray

    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.models.lm import lm_loss_and_metrics
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    vocab = Axis("vocab", load_tokenizer(config.data.tokenizer).vocab_size)
    trainer = Trainer(
        config.trainer, config.optimizer.build_for_trainer(10), lm_loss_and_metrics, mesh=make_mesh(config.trainer)
    )
    key = jax.random.PRNGKey(0)

    def model_init(k):
        return config.model.build(vocab, key=k)

    state = trainer.init_state(model_init, key)
    tokens = np.random.default_rng(0).integers(0, 256, (trainer.plan.batch_size, config.model.seq_len))
    state, _ = trainer.train_step(state, tokens)
    arrays = {}
    leaves = jax.tree_util.tree_flatten_with_path(
        (state.model, state.opt_state), is_leaf=lambda x: isinstance(x, NamedArray)
    )[0]
    for path, leaf in leaves:
        if not isinstance(leaf, NamedArray):
            continue
        spec = tuple(leaf.array.sharding.spec) + (None,) * (leaf.array.ndim - len(leaf.array.sharding.spec))
        arrays[jax.tree_util.keystr(path)] = {
            "axes": {axis.name: (list(s) if isinstance(s, tuple) else s) for axis, s in zip(leaf.axes, spec)},
            "piece": list(leaf.array.addressable_shards[0].data.shape),
            "shape": list(leaf.array.shape),
        }
    return arrays


def main(config_path: str, runs_path: str, out_path: str) -> None:
    import jax

    with open(runs_path) as f:
        runs = json.load(f)
    out = {"devices": jax.device_count()}
    for name, overrides in runs.items():
        result = train(config_path, name, overrides)
        out[name] = {
            "train": result["train"],
            "eval": result["eval"],
            "arrays": shardings_after_one_step(result["config"]),
        }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
