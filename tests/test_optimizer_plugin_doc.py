"""docs/optimizers.md's optimizer plugin (sharpness-aware minimization), taken from the page as
it is written, registered in process and trained with: what a third party following the page
gets."""

import os
import types

import haliax as hax
import jax
import numpy as np
import pytest
from pydantic import ValidationError

from conftest import REPO
from levanter_core import plugins
from levanter_core.plugins import registry


def plugin_module() -> types.ModuleType:
    with open(os.path.join(REPO, "docs", "optimizers.md")) as f:
        page = f.read()
    start = page.index("```python", page.index("Here is the whole plugin module:")) + len("```python")
    module = types.ModuleType("levanter_optim_sam")
    exec(compile(page[start : page.index("```", start)], "docs/optimizers.md", "exec"), module.__dict__)
    return module


@pytest.fixture
def sam():
    plugins.reset(autoload=False)
    plugins.register_plugin(plugin_module(), name="sam")
    yield registry("optimizer").get("sam").config_cls
    plugins.reset()


def test_the_documented_plugin_registers_validates_and_trains(sam):
    from levanter_core.objective import LmObjective
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    with pytest.raises(ValidationError, match="rho"):
        sam.model_validate({"rho": -1})
    plugins.reset()  # the model comes from the installed gpt2 plugin
    gpt2 = registry("model").get("gpt2").config_cls(hidden_dim=32, num_heads=2, num_layers=1, seq_len=16)
    config = TrainerConfig(train_batch_size=8, num_train_steps=8)
    tokens = np.tile(np.arange(16) % 5, (8, 1))

    def train(optimizer_config):
        trainer = Trainer(config, optimizer_config.build_for_trainer(8), LmObjective(), mesh=make_mesh(config))
        state = trainer.init_state(lambda k: gpt2.build(hax.Axis("vocab", 32), key=k), jax.random.PRNGKey(0))
        losses = []
        for _ in range(8):
            state, metrics = trainer.train_step(state, tokens)
            losses.append(float(metrics["train/loss"]))
        return losses

    settings = dict(learning_rate=1e-2, warmup=0, lr_schedule="constant")
    with_sam = train(sam.model_validate({"rho": 0.05, **settings}))
    plain = train(registry("optimizer").get("adam").config_cls(**settings, beta1=0.9, beta2=0.95, max_grad_norm=None))
    assert with_sam[-1] < 0.8 * with_sam[0]
    assert with_sam[0] == plain[0] and with_sam[1] != plain[1]  # the same start, another path
