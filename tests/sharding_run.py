"""Train one config under several axis settings in one process, and report what happened.

Run by tests/test_sharding.py in a subprocess whose environment sets the number of
simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), so that JAX
starts once for all the settings::

    python tests/sharding_run.py CONFIG.yaml RUNS.json OUT.json

``RUNS.json`` maps a name to a list of command-line overrides of ``CONFIG.yaml`` (the run id
is set to the name). ``OUT.json`` gets, per name: the per-step training losses and the
evaluation losses from ``metrics.jsonl``, and, for the state the run's last training step
returned, which mesh axes each axis of each model and optimizer-state array is split over
(``{path: {axis: mesh axes or None}}``) and the shape of one device's piece. The state is
the run's own, caught as the trainer's ``train_step`` returns it: no second trainer is built
and compiled just to look at where the arrays lie.
"""

from __future__ import annotations

import json
import sys

from levanter_core.trainer.trainer import Trainer


class LastState:
    """Wraps :meth:`Trainer.train_step` for the process: keeps the state the latest step returned."""

    def __init__(self):
        self.state = None
        step = Trainer.train_step

        def train_step(trainer, state, *args, **kwargs):
            new_state, metrics = step(trainer, state, *args, **kwargs)
            self.state = new_state
            return new_state, metrics

        Trainer.train_step = train_step


def train(config_path: str, name: str, overrides: list[str]) -> dict:
    """Train through the real path (``run_training``); the losses it logged."""
    from levanter_core.config.train import load_train_config
    from levanter_core.run import run_training
    from levanter_core.testing import logged

    config, _ = load_train_config(config_path, [*overrides, "--trainer.id", name])
    result = run_training(config, config_path=config_path, progress=False)
    return {"train": logged(result.run_dir, "train/loss"), "eval": logged(result.run_dir, "eval/loss")}


def shardings(state) -> dict:
    """Where each array of the model and the optimizer state of ``state`` lives."""
    import jax
    from haliax import NamedArray

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
    last = LastState()
    for name, overrides in runs.items():
        last.state = None
        out[name] = train(config_path, name, overrides)
        out[name]["arrays"] = shardings(last.state)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
