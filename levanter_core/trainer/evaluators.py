"""Evaluations that plugins run during training.

The core evaluates the loss and bits per byte of the validation sets itself. Anything else a
run should measure as it trains (a benchmark harness, a probe, a judge) comes from a plugin
that registers an *evaluator*: a config class, selected by its ``type``, whose
:meth:`EvaluatorConfig.build` makes an :class:`Evaluator`. The run builds each configured
evaluator once, then, every ``every`` steps (and after the last step), calls
:meth:`Evaluator.evaluate` with the model (the averaged weights when ``trainer.model_averaging``
is on) and sends what it returns to every tracker at that step::

    from levanter_core.plugins import hookimpl

    @hookimpl
    def register_evaluators(register):
        register("my_probe", "my_plugin.probe:ProbeConfig")

A YAML config runs it with::

    evaluators:
      - type: my_probe
        every: 500
        # ... the fields of ProbeConfig

Levanter's ``eval_harness`` section (with ``eval_harness_steps``) is the evaluator registered
as ``eval_harness`` (the ``levanter-eval-harness`` plugin).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from levanter_core.config.base import TypedConfig


@dataclasses.dataclass(frozen=True)
class EvaluatorContext:
    """What an evaluator may need from the run that builds it."""

    tokenizer: Any
    """The run's :class:`~levanter_core.data.tokenizer.Tokenizer`."""
    trainer: Any
    """The :class:`~levanter_core.trainer.trainer.Trainer`: its ``mesh``, its precision policy
    ``mp`` (``mp.cast_to_compute(model)``) and its ``config``."""
    run_dir: str
    """The run's directory, for files an evaluator writes (per-sample logs, say)."""
    seq_len: int
    """The model's context length."""


class Evaluator(abc.ABC):
    """A built evaluator: called on the model at its steps."""

    @abc.abstractmethod
    def evaluate(self, model, step: int) -> dict[str, float | str]:
        """Metrics of ``model`` at ``step``, by name (``lm_eval/hellaswag/acc``, say); every
        process calls it, and every process must return the same metrics."""

    def close(self) -> None:
        """Release what the evaluator holds, at the end of the run."""


class EvaluatorConfig(TypedConfig, abc.ABC):
    """Base class of evaluator configs (each item of ``evaluators``)."""

    every: int | None = Field(None, ge=1)
    """Steps between evaluations; None: at each of the run's evaluations (``trainer.steps_per_eval``)."""

    @abc.abstractmethod
    def build(self, context: EvaluatorContext) -> Evaluator:
        """Make the evaluator of this config for the run described by ``context``; called once,
        before the run's first step (a :class:`~levanter_core.errors.UserError` raised here stops
        the run before it trains)."""


def due(step: int, every: int, last_step: int) -> bool:
    """Whether an evaluator that runs every ``every`` steps runs after ``step``."""
    return step % every == 0 or step == last_step


def eval_metrics(
    totals: Mapping[str, Sequence[float]], tags: Mapping[str, Sequence[str]], *, per_set: bool
) -> dict[str, float]:
    """The metrics of a validation pass from each set's ``[nats, tokens, bytes]`` (or
    ``[nats, tokens]``, which gives no bits per byte):

    * ``eval/loss`` and ``eval/bpb``: over every token (and byte) of every set (micro averages);
    * ``eval/macro_loss`` and ``eval/macro_bpb``: the mean of the sets' own (with several sets);
    * ``eval/<set>/loss`` and ``eval/<set>/bpb`` for each set (``per_set``: a mixture);
    * for each tag (``tags``: tag -> the sets that carry it) ``eval/<tag>/loss`` (also as
      ``micro_loss``, Levanter's name), ``eval/<tag>/bpb``, ``macro_loss`` and ``macro_bpb``.

    Bits per byte is ``nats / (ln 2 * bytes)``; a set whose tokens stand for no bytes has none."""

    def loss(t):
        return t[0] / max(t[1], 1.0)

    def bpb(t):
        return t[0] / (math.log(2) * t[2]) if len(t) > 2 and t[2] > 0 else None

    def add(prefix: str, names: Sequence[str], *, micro_name: str | None = None) -> None:
        summed = [sum(totals[n][i] for n in names) for i in range(len(totals[names[0]]))]
        metrics[f"{prefix}/loss"] = loss(summed)
        if micro_name:
            metrics[f"{prefix}/{micro_name}"] = metrics[f"{prefix}/loss"]
        if bpb(summed) is not None:
            metrics[f"{prefix}/bpb"] = bpb(summed)
        if len(names) > 1:
            metrics[f"{prefix}/macro_loss"] = sum(loss(totals[n]) for n in names) / len(names)
            per_set_bpb = [bpb(totals[n]) for n in names]
            if all(b is not None for b in per_set_bpb):
                metrics[f"{prefix}/macro_bpb"] = sum(per_set_bpb) / len(names)

    metrics: dict[str, float] = {}
    add("eval", list(totals))
    if per_set:
        for name in totals:
            add(f"eval/{name}", [name])
    for tag, names in tags.items():
        names = [n for n in names if n in totals]
        if names:
            add(f"eval/{tag}", names, micro_name="micro_loss")
    return metrics
