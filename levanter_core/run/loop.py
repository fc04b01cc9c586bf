"""The train loop: one step after another, each step's metrics fetched a step late (so the
host never waits for the step in flight), the step callbacks run between steps, and the
throughput measured over the steps alone.

    for each step:  read batch (prefetched) -> profiler -> dispatch step -> log the step before
                    -> callbacks due? -> [wait for the step, pause the clock] -> callbacks
                    -> (checkpoint: log and store this step, then save) -> resume the clock
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from levanter_core.config.train import TrainConfig
from levanter_core.data.dataset import eval_batches
from levanter_core.errors import DataExhausted
from levanter_core.models.lm import lm_eval_entropy
from levanter_core.plugins import get_manager
from levanter_core.run.callbacks import Checkpoint, Evaluation, Export, Heatmap, PluginEvaluator, Profile, Samples
from levanter_core.run.export import HfExporter
from levanter_core.run.result import RunResult
from levanter_core.trainer.callbacks import StepCallback, StepInfo
from levanter_core.trainer.evaluators import EvaluatorContext
from levanter_core.trainer.run_sync import RunDirectory
from levanter_core.trainer.trainer import Prefetcher, Throughput
from levanter_core.trainer.watch import host_value, is_watch_metric


class TrainLoop:
    """Steps, logging and the step callbacks (evaluation, samples, the heatmap, exports, the
    plugins' evaluators and callbacks, checkpoints, the profiler)."""

    def __init__(
        self,
        config: TrainConfig,
        trainer,
        data,
        tracker,
        checkpointer,
        *,
        run_directory: RunDirectory,
        flops_per_token: float | None,
        progress: bool,
        exporter: HfExporter | None = None,
    ):
        self.config = config
        self.run_directory = run_directory
        self.run_dir = run_directory.path
        self.trainer = trainer
        self.data = data
        self.tracker = tracker
        self.checkpointer = checkpointer
        self.progress = progress
        self.num_steps = config.trainer.num_train_steps
        # Every step's learning rate, computed once on the host's side of the loop: evaluating the
        # schedule (a JAX computation) per step would queue it behind the step in flight, and the
        # loop would wait for that step before dispatching the next.
        schedule = config.optimizer.lr_scheduler(self.num_steps)
        self.learning_rates = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(self.num_steps)), np.float64)
        self.batches = config.trainer.batch_schedule
        # the tokens of a batch row: its sequences' (a preference pair holds two)
        self.row_tokens = config.train_length * trainer.objective.sequences_per_row
        self.tokens_per_step = trainer.plan.batch_size * self.row_tokens
        self.flops_per_token = flops_per_token
        self._eval_constants_found: tuple | None = None  # the objective's, for evaluation
        self.reference = None  # the state's reference model (objectives that keep one), set by run()
        self.entropy_fn = lm_eval_entropy if config.log_entropy else None
        self.exporter = exporter
        self.profile = Profile(config.trainer, self.run_dir)
        self.callbacks: list[StepCallback] = []  # built when the loop starts (see _build_callbacks)

    def _build_callbacks(self, result: RunResult) -> list[StepCallback]:
        """The run's step callbacks, in the order they run after a step. The plugins' evaluators
        are built here, before the first step: one that cannot be built (an unknown task, say)
        stops the run before it trains, not when it is first due."""
        trainer_cfg = self.trainer.config
        steps_per_eval = trainer_cfg.steps_per_eval
        callbacks: list[StepCallback] = [self.profile]
        self.callbacks = callbacks  # closed at the end, however far this gets
        if trainer_cfg.viz is not None:
            callbacks.append(Heatmap(trainer_cfg.viz, self.data))
        if trainer_cfg.sample is not None:
            callbacks.append(Samples(trainer_cfg.sample))

        def on_loss(loss: float) -> None:
            result.final_eval_loss = loss

        callbacks.append(Evaluation(steps_per_eval, self.evaluate, on_loss))
        context = EvaluatorContext(self.data.tokenizer, self.trainer, self.run_dir, self.config.train_length)
        for cfg, every in self.config.run_evaluators():
            callbacks.append(PluginEvaluator(cfg.build(context), every, steps_per_eval, self.num_steps))
        for contributed in get_manager().hook().step_callbacks(config=self.config, context=context):
            callbacks.extend(contributed or [])
        if self.exporter is not None:
            callbacks.append(Export(self.exporter, self.config.hf_save_steps))
        callbacks.append(Checkpoint(self.checkpointer, self.num_steps))
        return callbacks

    def _info(self, step: int, state) -> StepInfo:
        return StepInfo(
            step=step,
            last=step == self.num_steps,
            state=state,
            trainer=self.trainer,
            tracker=self.tracker,
            run_dir=self.run_dir,
            tokenizer=self.data.tokenizer,
            _eval_model=lambda: self.trainer.eval_model(state),
        )

    def evaluate(self, model) -> dict[str, float]:
        """The objective's metrics of every validation set, their averages, and those of each
        tag (for language modelling loss and bits per byte, see
        :func:`levanter_core.trainer.evaluators.eval_metrics`); the entropy too with
        ``log_entropy``. Empty without validation data."""
        size, limit = self.trainer.plan.eval_batch_size, self.trainer.config.max_eval_batches
        rows = self.trainer.local_rows(self.trainer.EvalBatch)
        totals, entropies = {}, {}
        for name, dataset in self.data.validation.items():
            batches = eval_batches(dataset, size, limit, rows=rows)
            found = self.trainer.evaluate_totals(model, batches, *self._eval_constants(model), reference=self.reference)
            if found is None:
                continue
            totals[name] = found
            if self.entropy_fn is not None:
                batches = eval_batches(dataset, size, limit, rows=rows)
                entropies[name] = self.trainer.evaluate(model, batches, fn=self.entropy_fn)
        if not totals:
            return {}
        metrics = self.trainer.objective.eval_metrics(totals, self._tags(), per_set=self.config.data.is_mixture)
        if entropies:
            # weighed by tokens, as the loss is
            tokens = {name: totals[name][1] for name in entropies}

            def mean(names):
                return sum(entropies[n] * tokens[n] for n in names) / max(sum(tokens[n] for n in names), 1.0)

            metrics["eval/entropy"] = mean(entropies)
            if self.config.data.is_mixture:
                metrics.update({f"eval/{name}/entropy": value for name, value in entropies.items()})
            for tag, names in self._tags().items():
                names = [n for n in names if n in entropies]
                if names:
                    metrics[f"eval/{tag}/entropy"] = mean(names)
        return metrics

    def _eval_constants(self, model) -> tuple:
        """What the objective's evaluation needs besides each batch (computed once)."""
        if self._eval_constants_found is None:
            self._eval_constants_found = self.trainer.objective.eval_constants(model, self.data.tokenizer)
        return self._eval_constants_found

    def _tags(self) -> dict[str, list[str]]:
        """Each ``tags`` entry of the data sources, with the sources that carry it."""
        tags: dict[str, list[str]] = {}
        for name, source in self.config.data.configs.items():
            for tag in source.tags or []:
                if tag != name:
                    tags.setdefault(tag, []).append(name)
        return tags

    def data_metrics(self) -> dict[str, float]:
        """How far the training caches still being built have got
        (``data/<source>/train_documents_cached``), and the bad records skipped so far
        (``data/skipped/<source>/<split>``)."""
        building = self.data.building()
        metrics = {f"data/{name}/train_documents_cached": cache.num_documents for name, cache in building.items()}
        metrics.update({f"data/skipped/{where}": n for where, n in self.data.skipped().items()})
        return metrics

    def run(self, state, result: RunResult):
        start = int(state.step)
        if start >= self.num_steps:
            print(f"run already complete: step {start} of {self.num_steps}", flush=True)
            return state

        # The first batches are read (waiting for the cache where needed) while the step compiles.
        prefetch = Prefetcher(self._read_batch, start, self.num_steps)
        try:
            self.callbacks = self._build_callbacks(result)
            first_size = self.batches.size_at(start)
            self.trainer.compile_ahead(state, self.data.train.template(first_size), first_size)
            self.reference = state.reference
            for callback in self.callbacks:
                callback.start(self._info(start, state))
            if start == 0:
                initial = self.evaluate(self.trainer.eval_model(state))
                if initial:
                    result.initial_eval_loss = initial["eval/loss"]
                    self.tracker.log(initial, step=0)
        except BaseException:
            prefetch.close()
            self._close_callbacks()
            raise
        throughput = Throughput(self.tokens_per_step)
        self.throughput = throughput
        bar = tqdm(
            total=self.num_steps,
            initial=start,
            unit="step",
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
        )
        pending: dict[str, Any] | None = None
        steps_per_eval = self.trainer.config.steps_per_eval
        try:
            carried: dict[str, Any] = {}  # logged with the next step
            for _ in range(start, self.num_steps):
                try:
                    index, batch = prefetch.get()
                except DataExhausted as e:
                    print(f"ending the run early: {e.message}", flush=True)
                    if pending is not None:
                        last = pending["step"]
                        if last % steps_per_eval and last != self.num_steps:  # not evaluated yet
                            evaluated = self.evaluate(self.trainer.eval_model(state))
                            pending.setdefault("host", {}).update(evaluated)
                            if evaluated:
                                result.final_eval_loss = evaluated["eval/loss"]
                    result.ended_early = e.message
                    break
                if index == start:
                    self._say_if_still_building()
                for callback in self.callbacks:
                    callback.before_step(index)
                state, metrics = self.trainer.train_step(state, batch, self.batches.size_at(index))
                self.reference = state.reference  # (the step takes the state's buffers, its reference's too)
                for callback in self.callbacks:
                    callback.after_step(index, metrics)
                if pending is not None:
                    self._finish(pending, throughput, bar, result)
                step = index + 1
                pending, carried = {"step": step, "device": metrics, "carried": carried}, {}
                last = step == self.num_steps
                due = [c for c in self.callbacks if c.due(step, last)]
                if due:
                    # Let the step finish first, so that its time is not mistaken for the callbacks'.
                    jax.block_until_ready(metrics)
                throughput.pause()  # what follows is not training; its time is left out of the step's
                pending["host"] = self.data_metrics()
                info = self._info(step, state)
                for callback in self.callbacks:
                    if callback not in due:
                        callback.idle(step)
                    elif callback.logs_first:
                        if pending is not None:
                            self._finish(pending, throughput, bar, result)
                            pending = None
                            self.run_directory.flush()  # and stored, for a run directory on an object store
                        carried.update(callback(info) or {})
                    else:
                        found = callback(info) or {}
                        (pending["host"] if pending is not None else carried).update(found)
                throughput.resume()
            if pending is not None:
                self._finish(pending, throughput, bar, result)
        finally:
            prefetch.close()
            bar.close()
            self._close_callbacks()
        if throughput.step_times:
            times = sorted(throughput.step_times)
            result.tokens_per_second = self.tokens_per_step / times[len(times) // 2]
        return state

    def _close_callbacks(self) -> None:
        self.profile.close()
        for callback in self.callbacks:
            callback.close()
        self.callbacks = []

    def _read_batch(self, step: int):
        """Step ``step``'s batch (this process's rows of it): the sequences after those of the
        steps before it, however many ``trainer.train_batch_size``'s schedule gave them."""
        size = self.batches.size_at(step)
        rows = self.trainer.local_rows(self.trainer.batch_axis(size))  # this process reads its share only
        return self.data.train.batch(step, size, rows, start=self.batches.offset_at(step))

    def _say_if_still_building(self) -> None:
        building = self.data.building()
        if building:
            ready = ", ".join(f"{name}: {c.num_documents:,} documents" for name, c in building.items())
            print(f"training starts while the training data is still being tokenized ({ready} so far)", flush=True)

    def _finish(self, pending: dict, throughput, bar, result: RunResult) -> None:
        step = pending["step"]
        watch = self.trainer.config.watch
        watching = watch is not None and step % watch.interval == 0
        metrics = {
            name: host_value(value) if is_watch_metric(name) else float(value)
            for name, value in pending["device"].items()
            if watching or not is_watch_metric(name)
        }
        self.trainer.check_finite(metrics["train/loss"], step)
        metrics["optim/learning_rate"] = float(self.learning_rates[step - 1])
        throughput.tokens_per_step = self.batches.size_at(step - 1) * self.row_tokens
        rate = throughput.tick()
        if rate is not None:
            metrics["throughput/tokens_per_second"] = rate
            if self.flops_per_token:
                metrics["throughput/model_gflops_per_second"] = rate * self.flops_per_token / 1e9
        if len(self.batches.stages) > 1:
            metrics["train/batch_size"] = self.batches.size_at(step - 1)
        metrics.update(pending.get("host", {}))
        metrics.update(pending.get("carried", {}))  # what callbacks run after the step before returned
        self.tracker.log(metrics, step=step)
        if result.first_loss is None:
            result.first_loss = metrics["train/loss"]
        result.last_loss = metrics["train/loss"]
        result.final_step = step
        postfix = {"loss": f"{metrics['train/loss']:.3f}"}
        if rate is not None:
            postfix["tok/s"] = f"{rate:,.0f}"
        if "eval/loss" in metrics:
            postfix["eval"] = f"{metrics['eval/loss']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - bar.n)
