"""Step callbacks: a plugin adds side work to every run through the ``step_callbacks`` hook."""

from __future__ import annotations

import types

import pytest

from levanter_core.config.loader import Sources
from levanter_core.config.train import validate_train_config
from levanter_core.plugins import get_manager, hookimpl
from levanter_core.run import run_training
from levanter_core.testing import read_metrics, tiny_model
from levanter_core.trainer.callbacks import StepCallback


class Probe(StepCallback):
    """Due every third step; records what the loop asked of it."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def start(self, info):
        self.calls.append(("start", info.step))

    def due(self, step, last):
        return step % 3 == 0

    def __call__(self, info):
        assert info.eval_model() is info.eval_model()  # computed once per step
        self.calls.append(("call", info.step))
        return {"probe/step": float(info.step), "probe/params": float(info.state.step)}

    def idle(self, step):
        self.calls.append(("idle", step))

    def close(self):
        self.calls.append(("close", 0))


class AfterLog(StepCallback):
    """Runs after its step is logged: what it returns goes with the next step."""

    logs_first = True

    def due(self, step, last):
        return step == 4

    def __call__(self, info):
        return {"probe/after": float(info.step)}


@pytest.fixture
def probes():
    found = {"probe": Probe(), "after": AfterLog(), "seen": []}

    @hookimpl
    def step_callbacks(config, context):
        found["seen"].append((config.trainer.num_train_steps, context.seq_len))
        return [found["probe"], found["after"]]

    plugin = types.SimpleNamespace(step_callbacks=step_callbacks)
    manager = get_manager()
    manager.register(plugin, name="test-step-callbacks")
    try:
        yield found
    finally:
        manager.pm.unregister(plugin)
        manager.plugins.pop("test-step-callbacks", None)


def test_a_plugins_callbacks_run_when_due_and_their_metrics_are_logged(tmp_path, probes):
    raw = {
        "data": {"type": "python_stdlib", "tokenizer": "byte", "max_files": 20, "cache_dir": str(tmp_path / "cache")},
        "model": tiny_model(seq_len=32),
        "trainer": {
            "num_train_steps": 7,
            "train_batch_size": 4,
            "steps_per_eval": 100,
            "max_eval_batches": 1,
            "log_dir": str(tmp_path / "logs"),
            "id": "callbacks",
            "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []},
        },
        "optimizer": {"learning_rate": 1e-3, "warmup": 0},
    }
    run_training(validate_train_config(raw, Sources("test")), progress=False)

    assert probes["seen"] == [(7, 32)]  # asked once per run, with the run's config and context
    calls = probes["probe"].calls
    assert calls[0] == ("start", 0) and calls[-1] == ("close", 0)
    assert [s for kind, s in calls if kind == "call"] == [3, 6]
    assert [s for kind, s in calls if kind == "idle"] == [1, 2, 4, 5, 7]

    by_step = {m["step"]: m for m in read_metrics(tmp_path / "logs" / "callbacks")}
    assert by_step[3]["probe/step"] == 3.0 and by_step[6]["probe/step"] == 6.0
    assert by_step[3]["probe/params"] == 3.0  # the state after the step
    assert "probe/step" not in by_step[4]
    # logged after step 4 was: with step 5
    assert "probe/after" not in by_step[4] and by_step[5]["probe/after"] == 4.0
