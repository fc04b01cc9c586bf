"""The train loop's own step callbacks (see :mod:`levanter_core.trainer.callbacks`), in the
order the loop runs them after a step:

    profiler (around steps) -> heatmap -> samples -> evaluation -> plugins' evaluators
    -> plugins' callbacks -> Hugging Face export -> checkpoint (after the step is logged)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import haliax as hax
import jax
import numpy as np
from jax.experimental import multihost_utils

from levanter_core.data.dataset import eval_batches
from levanter_core.run.export import HfExporter
from levanter_core.trainer.callbacks import StepCallback, StepInfo
from levanter_core.trainer.evaluators import Evaluator, due
from levanter_core.trainer.samples import sample_texts
from levanter_core.trainer.viz import token_log_probs, write_heatmap


class Profile(StepCallback):
    """The JAX profiler trace of ``trainer.profiler``: steps ``profiler_start_step`` to
    ``profiler_start_step + profiler_num_steps - 1`` (fewer if the run ends first), written to
    ``{run_dir}/profiler/``."""

    def __init__(self, trainer_cfg, run_dir: str):
        self.on = trainer_cfg.profiler
        self.first = trainer_cfg.profiler_start_step
        self.last = trainer_cfg.profiler_start_step + trainer_cfg.profiler_num_steps - 1
        self.perfetto = trainer_cfg.profiler_perfetto_link
        self.directory = os.path.join(run_dir, "profiler")
        self.active = False

    def before_step(self, index: int) -> None:
        if self.on and not self.active and self.first <= index <= self.last:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=self.perfetto)
            self.active = True
            print(f"profiling steps {index + 1} to {self.last + 1} into {self.directory}", flush=True)

    def after_step(self, index: int, metrics: Mapping[str, Any]) -> None:
        if self.active and index >= self.last:
            jax.block_until_ready(metrics)
            self.close()

    def close(self) -> None:
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        print(f"profiler trace written to {self.directory}", flush=True)
        if self.perfetto:
            traces = [
                os.path.join(root, name)
                for root, _, names in os.walk(self.directory)
                for name in names
                if name.startswith("perfetto_trace")
            ]
            if traces:
                print(f"Perfetto trace (open it at ui.perfetto.dev): {max(traces, key=os.path.getmtime)}", flush=True)


class Heatmap(StepCallback):
    """The token log-probability heatmap of ``trainer.viz``, written to the run directory and
    sent to the trackers as an artifact."""

    def __init__(self, viz, data):
        self.viz, self.data = viz, data

    def due(self, step: int, last: bool) -> bool:
        return step % self.viz.interval == 0 or last

    def __call__(self, info: StepInfo) -> None:
        if not self.data.validation:
            return
        trainer = info.trainer
        dataset = next(iter(self.data.validation.values()))
        batch = next(eval_batches(dataset, trainer.plan.eval_batch_size, 1))
        with hax.partitioning.set_mesh(trainer.mesh):
            found = token_log_probs(info.eval_model(), trainer.to_device(batch, trainer.EvalBatch))
        scores = np.asarray(multihost_utils.process_allgather(found, tiled=True))  # every process computes a part
        if jax.process_index() != 0:
            return
        rows = slice(0, self.viz.num_sequences)
        path = write_heatmap(
            info.run_dir, info.step, info.tokenizer, batch.tokens[rows], scores[rows], self.viz.max_tokens
        )
        info.tracker.log_artifact(path, name=f"viz/step-{info.step}.html", type="viz")


class Samples(StepCallback):
    """``trainer.sample``'s prompts continued by the model, logged as text metrics."""

    def __init__(self, sample):
        self.sample = sample

    def due(self, step: int, last: bool) -> bool:
        return step % self.sample.interval == 0 or last

    def __call__(self, info: StepInfo) -> dict[str, str]:
        model = info.eval_model()
        with hax.partitioning.set_mesh(info.trainer.mesh):
            return sample_texts(model, info.tokenizer, self.sample, seq_len=model.config.seq_len)


class Evaluation(StepCallback):
    """The objective's metrics on the validation sets, every ``trainer.steps_per_eval`` steps
    and after the last (``evaluate``: the loop's :meth:`~levanter_core.run.loop.TrainLoop.evaluate`)."""

    def __init__(
        self, steps_per_eval: int, evaluate: Callable[[Any], dict[str, float]], on_loss: Callable[[float], None]
    ):
        self.steps_per_eval, self.evaluate, self.on_loss = steps_per_eval, evaluate, on_loss

    def due(self, step: int, last: bool) -> bool:
        return step % self.steps_per_eval == 0 or last

    def __call__(self, info: StepInfo) -> dict[str, float]:
        evaluated = self.evaluate(info.eval_model())
        if evaluated:
            self.on_loss(evaluated["eval/loss"])
        return evaluated


class PluginEvaluator(StepCallback):
    """A plugin's evaluator (``evaluators``, ``eval_harness``): at its own ``every``, or with
    the run's evaluations."""

    def __init__(self, evaluator: Evaluator, every: int | None, steps_per_eval: int, num_steps: int):
        self.evaluator, self.every, self.steps_per_eval, self.num_steps = evaluator, every, steps_per_eval, num_steps

    def due(self, step: int, last: bool) -> bool:
        if self.every is None:
            return step % self.steps_per_eval == 0 or last
        return due(step, self.every, self.num_steps)

    def __call__(self, info: StepInfo) -> dict[str, float | str]:
        return self.evaluator.evaluate(info.eval_model(), info.step)

    def close(self) -> None:
        self.evaluator.close()


class Export(StepCallback):
    """A Hugging Face (or PEFT) export every ``hf_save_steps`` steps; the final one is the
    run's, after the last checkpoint."""

    def __init__(self, exporter: HfExporter, every: int):
        self.exporter, self.every = exporter, every

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0

    def __call__(self, info: StepInfo) -> None:
        self.exporter.export(info.eval_model(), info.step)


class Checkpoint(StepCallback):
    """A checkpoint when the checkpointer's policy says one is due (the final one is saved by
    the run after the loop). The step is logged and stored first, so a run resumed from this
    checkpoint has logged every step it does not train again; how long the save held up the
    loop is logged with the next step."""

    logs_first = True

    def __init__(self, checkpointer, num_steps: int):
        self.checkpointer, self.num_steps = checkpointer, num_steps

    def due(self, step: int, last: bool) -> bool:
        return step < self.num_steps and self.checkpointer.due(step)

    def __call__(self, info: StepInfo) -> dict[str, float]:
        self.checkpointer.on_step(info.state, info.step)
        return {"checkpoint/save_blocked_seconds": self.checkpointer.last_save_blocked_seconds}

    def idle(self, step: int) -> None:
        self.checkpointer.check_for_errors()  # a background save that failed stops the run
