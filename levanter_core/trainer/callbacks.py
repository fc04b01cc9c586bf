"""Side work between training steps: step callbacks.

The train loop runs the compiled step; everything else it does as a run goes (evaluation,
samples, the log-probability heatmap, Hugging Face exports, the plugins' evaluators,
checkpoints, the profiler) is a :class:`StepCallback`: *when is it due* and *what does it
do*. After each step the loop asks every callback, in order, whether it is due; if any is,
the step is waited for (so its time is not counted as the callback's), the clock of the
throughput metrics is paused, and each due callback runs. What a callback returns is logged
with that step::

    step k:  train step -> due? -> [wait for the step] -> callback(info) ... -> log step k

A callback with ``logs_first = True`` (checkpointing) runs after the step is logged and
stored, and what it returns is logged with the next step: a run resumed from a checkpoint
has logged every step it does not train again.

A plugin adds callbacks to every run through the ``step_callbacks`` hook::

    from levanter_core.plugins import hookimpl
    from levanter_core.trainer.callbacks import StepCallback

    class GradNormAlarm(StepCallback):
        def due(self, step, last):
            return step % 100 == 0

        def __call__(self, info):
            return {"alarm/steps_seen": float(info.step)}

    @hookimpl
    def step_callbacks(config, context):
        return [GradNormAlarm()] if config.trainer.num_train_steps > 1000 else []
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


@dataclasses.dataclass
class StepInfo:
    """What a callback sees after a step."""

    step: int
    """Steps trained so far (the step just trained, counting from 1)."""
    last: bool
    """Whether this is the run's last step."""
    state: Any
    """The training state after the step (``state.model``, ``state.opt_state``, ``state.step``)."""
    trainer: Any
    """The run's :class:`~levanter_core.trainer.trainer.Trainer` (its ``mesh``, ``config``, ``plan``)."""
    tracker: Any
    """The run's tracker (artifacts go here; metrics are better returned)."""
    run_dir: str
    """The run's directory, for files a callback writes."""
    tokenizer: Any
    """The run's tokenizer."""
    _eval_model: Callable[[], Any] = dataclasses.field(repr=False, default=lambda: None)
    _cached: list = dataclasses.field(default_factory=list, repr=False)

    def eval_model(self) -> Any:
        """The model evaluation uses (the averaged weights under ``trainer.model_averaging``),
        computed once per step however many callbacks ask for it."""
        if not self._cached:
            self._cached.append(self._eval_model())
        return self._cached[0]


class StepCallback:
    """Work done between steps when it is due. Subclasses override :meth:`due` and
    :meth:`__call__`, and any of the other methods they need."""

    logs_first: ClassVar[bool] = False
    """Run after the step is logged and stored (what it returns is logged with the next step)."""

    def start(self, info: StepInfo) -> None:
        """Once, after the step is compiled and before the first step of this attempt
        (``info.step`` is the step training resumes from)."""

    def before_step(self, index: int) -> None:
        """Just before step ``index`` (counting from 0) is dispatched."""

    def after_step(self, index: int, metrics: Mapping[str, Any]) -> None:
        """Just after step ``index`` is dispatched; ``metrics`` are still on the device."""

    def due(self, step: int, last: bool) -> bool:
        """Whether to run after ``step`` steps (``last``: the run's last step)."""
        return False

    def __call__(self, info: StepInfo) -> Mapping[str, Any] | None:
        """Do the work; return metrics to log (or None)."""
        return None

    def idle(self, step: int) -> None:
        """After a step at which it was not due."""

    def close(self) -> None:
        """At the end of the run, whether it succeeded or not."""
