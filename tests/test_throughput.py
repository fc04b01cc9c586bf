"""Throughput counts training only: neither a checkpoint save nor an evaluation before it."""

import time

from test_trainer import read_metrics, tiny_config

from levanter_core.checkpoint import TensorStoreCheckpointer
from levanter_core.run import run_training
from levanter_core.run.loop import TrainLoop

SLOW = 1.0  # seconds each evaluation and each save's blocking part take on top of their own time


def test_a_run_with_frequent_saves_and_slow_evaluations_logs_only_training_throughput(tmp_path, monkeypatch):
    """An evaluation before a save used to be subtracted twice from the next step's time, which
    came out negative when the evaluation took longer than the step (-2,313 tokens/s)."""
    evaluate, save = TrainLoop.evaluate, TensorStoreCheckpointer.save

    def slow_evaluate(self, model):
        time.sleep(SLOW)
        return evaluate(self, model)

    def slow_save(self, *args, **kwargs):
        time.sleep(SLOW)  # as a large state's copy to host memory would
        return save(self, *args, **kwargs)

    monkeypatch.setattr(TrainLoop, "evaluate", slow_evaluate)
    monkeypatch.setattr(TensorStoreCheckpointer, "save", slow_save)
    config = tiny_config(
        tmp_path,
        num_train_steps=6,
        train_batch_size=4,
        steps_per_eval=1,
        max_eval_batches=1,
        checkpointer={"base_path": str(tmp_path / "ckpt"), "keep": [{"every": 2}], "save_interval": None},
    )
    run_training(config, config_path="tiny.yaml", progress=False)

    logged = {m["step"]: m for m in read_metrics(tmp_path / "logs" / "tiny") if "train/loss" in m}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    rates = {step: m["throughput/tokens_per_second"] for step, m in logged.items() if step > 1}
    assert all(rate > 0 for rate in rates.values()), rates
    # Had a second of evaluation or saving been counted, a step would come out slower than this;
    # a step of this model takes milliseconds.
    tokens_per_step = 4 * 64
    assert all(rate > tokens_per_step / SLOW for rate in rates.values()), rates
    assert [step for step, m in logged.items() if "checkpoint/save_blocked_seconds" in m] == [3, 5]
