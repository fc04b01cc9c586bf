"""Train a tiny GPT-2 with each of several optimizers, checkpoint half-way, resume, and report,
on a mesh of one device and on a mesh of all the process's devices.

Run by tests/test_optimizer_matrix.py in a subprocess whose environment sets the number of
simulated CPU devices, so that one JAX start serves every optimizer and both meshes (the
one-device mesh is ``jax.devices()[:1]``: a run on it is a one-device run, its arrays whole on
that device)::

    python tests/optimizer_matrix.py SECTIONS.json OUT.json WORKDIR

``SECTIONS.json`` maps a name to an ``optimizer:`` section. ``OUT.json`` gets, per number of
devices of the mesh and per name: the loss of each of the 6 steps of an uninterrupted run, and
the names of the state's arrays that differ between that run's final state and the final state
of a run resumed from its step-3 checkpoint (an empty list: bit for bit the same). The
parameters and optimizer state are split over the devices as ``trainer.fsdp_axis`` says
(``embed`` over ``data``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

STEPS, CHECKPOINT_AT = 6, 3


def run(name: str, section: dict, workdir: str, devices: list) -> dict:
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
    mesh = make_mesh(trainer_config, devices)
    assert mesh.devices.size == len(devices), mesh
    trainer = Trainer(
        trainer_config,
        optimizer_config.build_for_trainer(STEPS),
        LmObjective(),
        mesh=mesh,
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
            path = write_checkpoint(state, os.path.join(workdir, f"{len(devices)}", name, f"step-{step}"), step=step)
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["train/loss"]))
    resumed = load_checkpoint(trainer.state_template(model_init, key), path)
    for batch in batches[CHECKPOINT_AT:]:
        resumed, _ = trainer.train_step(resumed, batch)

    def arrays(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p): x for p, x in leaves if hasattr(x, "shape")}

    ours, theirs = arrays(state), arrays(resumed)
    # the parameters and optimizer state really lie on the mesh's devices (split on 4)
    placed = {d for x in ours.values() for d in x.sharding.device_set}
    ours, theirs = {p: np.asarray(x) for p, x in ours.items()}, {p: np.asarray(x) for p, x in theirs.items()}
    differ = sorted(p for p in ours if ours[p].tobytes() != theirs[p].tobytes() or ours[p].dtype != theirs[p].dtype)
    return {"losses": losses, "differ": differ, "arrays": len(ours), "placed_on": len(placed)}


def main(sections_path: str, out_path: str, workdir: str) -> None:
    import jax

    with open(sections_path) as f:
        sections = json.load(f)
    out = {"devices": jax.device_count(), "runs": {}}
    for count in (1, jax.device_count()):
        runs = out["runs"][str(count)] = {}
        for name, section in sections.items():
            runs[name] = run(name, section, workdir, jax.devices()[:count])
            print(count, name, runs[name]["losses"], flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
