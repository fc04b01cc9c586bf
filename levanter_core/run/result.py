"""What a run reports back, and what identifies it once its directory is written."""

from __future__ import annotations

import dataclasses

from levanter_core.trainer.run_sync import RunDirectory


@dataclasses.dataclass
class RunResult:
    """What a finished run reports back (also written to ``summary.json`` by the json tracker)."""

    run_id: str
    run_dir: str
    """``{trainer.log_dir}/{run_id}``: a local directory or an object-store URL."""
    start_step: int
    final_step: int
    first_loss: float | None = None
    last_loss: float | None = None
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    tokens_per_second: float | None = None
    wall_seconds: float = 0.0
    checkpoint: str | None = None
    ended_early: str | None = None
    """Why training stopped before ``trainer.num_train_steps`` (the data ran out: ``epoch``,
    ``data.stop_strategy``); None when it did not."""


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What identifies a run and was written before training starts."""

    run_id: str
    directory: RunDirectory
    resolved: dict
    plugins: dict
    record_files: list[str]
    wall_start: float
