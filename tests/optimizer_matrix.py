"""Train a tiny GPT-2 with each of several optimizers, checkpoint half-way, resume, and report.

Run by tests/test_optimizer_matrix.py in a subprocess whose environment sets the number of
simulated CPU devices, so that one JAX start serves every optimizer::

    python tests/optimizer_matrix.py SECTIONS.json OUT.json WORKDIR

``SECTIONS.json`` maps a name to an ``optimizer:`` section. ``OUT.json`` gets, per name: the
loss of each of the 6 steps of an uninterrupted run, and the names of the state's arrays
that differ between that run's final state and the final state of a run resumed from its
step-3 checkpoint (an empty list: bit for bit the same). The parameters and optimizer state
are split over the devices as ``trainer.fsdp_axis`` says (``embed`` over ``data``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

STEPS, CHECKPOINT_AT = 6, 3


def run(name: str, section: dict, workdir: str) -> dict:
    import haliax as hax
    import jax

    from levanter_core.checkpoint import load_checkpoint, write_checkpoint
    from levanter_core.objective import LmObjective
    from levanter_core.plugins import registry
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    fields = {k: v for k, v in section.items() if k != "type"}
    optimizer_config = registry("optimizer").get(section["type"]).config_cls.model_validate(fields)
    gpt2 = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=4, num_layers=2, seq_len=16)
    trainer_config = TrainerConfig(train_batch_size=8, num_train_steps=STEPS, mp="p=f32")
    trainer = Trainer(
        trainer_config,
        optimizer_config.build_for_trainer(STEPS),
        LmObjective(),
        mesh=make_mesh(trainer_config),
        eval_params=optimizer_config.params_for_evaluation,
    )
    key = jax.random.PRNGKey(0)

    def model_init(k):
        return gpt2.build(hax.Axis("vocab", 64), key=k)

    # rows of a repeating pattern at random offsets: learnable in a few steps, so every
    # optimizer shows that it trains
    rng = np.random.default_rng(0)
    batches = [(np.arange(16) + rng.integers(0, 7, (8, 1))) % 7 for _ in range(STEPS)]
    state = trainer.init_state(model_init, key)
    losses = []
    for step, batch in enumerate(batches):
        if step == CHECKPOINT_AT:
            path = write_checkpoint(state, os.path.join(workdir, name, f"step-{step}"), step=step)
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["train/loss"]))
    resumed = load_checkpoint(trainer.state_template(model_init, key), path)
    for batch in batches[CHECKPOINT_AT:]:
        resumed, _ = trainer.train_step(resumed, batch)

    def arrays(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves if hasattr(x, "shape")}

    ours, theirs = arrays(state), arrays(resumed)
    differ = sorted(p for p in ours if ours[p].tobytes() != theirs[p].tobytes() or ours[p].dtype != theirs[p].dtype)
    evaluated = trainer.eval_model(state)  # what evaluation and export read (schedule-free: another point)
    return {"losses": losses, "differ": differ, "arrays": len(ours), "eval_leaves": len(jax.tree.leaves(evaluated))}


def main(sections_path: str, out_path: str, workdir: str) -> None:
    import jax

    with open(sections_path) as f:
        sections = json.load(f)
    out = {"devices": jax.device_count(), "runs": {}}
    for name, section in sections.items():
        out["runs"][name] = run(name, section, workdir)
        print(name, out["runs"][name]["losses"], flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
