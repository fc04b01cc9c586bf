"""The reference GPT-2's training step as the compiler sees it: a digest of its StableHLO, and
the losses of a few steps on a fixed batch, to the last bit.

A change that should not touch the numerics (moving code between modules, say) must leave
both unchanged. Run it on the commit before and after, in the same environment::

    git worktree add /tmp/before <commit>
    (cd /tmp/before && /work/main/.venv/bin/python bench/stablehlo_step.py) > before.json
    .venv/bin/python bench/stablehlo_step.py > after.json
    diff before.json after.json

It uses only names that have not moved (the trainer, its config, the model registry, the
mesh and the language-model objective), so that the same script runs on both commits.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import haliax as hax
import jax
import numpy as np
import reference_gpt2

from levanter_core.objective import LmObjective
from levanter_core.plugins import registry
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer

STEPS = 5


def main() -> None:
    preset = reference_gpt2.PRESETS["gpt2"]
    fields = {k: v for k, v in preset["model"].items() if k != "type"}
    model = registry("model").get("gpt2").config_cls.model_validate(fields)
    config = TrainerConfig(num_train_steps=100, **preset["trainer"])
    optimizer = registry("optimizer").get("adam").config_cls.model_validate({"learning_rate": 1e-3, "warmup": 0.1})
    trainer = Trainer(config, optimizer.build_for_trainer(100), LmObjective(), mesh=make_mesh(config))
    Vocab = hax.Axis("vocab", reference_gpt2.VOCAB_SIZE)
    state = trainer.init_state(lambda k: model.build(Vocab, key=k), jax.random.PRNGKey(0))
    tokens = np.random.default_rng(0).integers(0, Vocab.size, (config.train_batch_size, model.seq_len))

    example = trainer.to_device(tokens, trainer.Batch)
    leaves, structure = jax.tree.flatten(state)
    with hax.partitioning.set_mesh(trainer.mesh):
        text = trainer._flat_step(structure, leaves).lower(leaves, example).as_text()
    losses = []
    for _ in range(STEPS):
        state, metrics = trainer.train_step(state, tokens)
        losses.append(float(metrics["train/loss"]).hex())
    print(
        json.dumps(
            {
                "stablehlo_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "stablehlo_lines": text.count("\n"),
                "losses": losses,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
