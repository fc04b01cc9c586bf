"""Running lm-eval's evaluation over a :class:`~levanter_eval_harness.lm.LevanterLM`, and writing
its results as ``lm_eval`` does (through its own ``EvaluationTracker``): under the output
directory, a folder named after the model with ``results_<date>.json`` and, with samples
logged, ``samples_<task>_<date>.jsonl`` per task."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import lm_eval
from lm_eval.loggers import EvaluationTracker

from levanter_core.errors import UserError
from levanter_eval_harness.tasks import TaskSpec, load_tasks, task_manager

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HarnessRun:
    """What one evaluation was asked to do (the CLI's options; a training run's config)."""

    tasks: Sequence[TaskSpec]
    include_path: str | Sequence[str] | None = None
    num_fewshot: int | None = None
    limit: int | float | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool | None = None
    """None: on with ``apply_chat_template`` (as ``lm_eval``'s command line)."""
    log_samples: bool = False
    bootstrap_iters: int = 100000
    confirm_run_unsafe_code: bool = False
    gen_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    """None: lm-eval's default seeds (0 for Python, 1234 for numpy, torch and the few-shot
    sampler); otherwise all four."""


@dataclasses.dataclass
class PreparedTasks:
    """lm-eval's task manager and the tasks it loaded (with their data)."""

    manager: Any
    tasks: list


def prepare_tasks(run: HarnessRun) -> PreparedTasks:
    """Find and load ``run``'s tasks (:class:`UserError` for an unknown task, or one whose data
    cannot be read)."""
    manager = task_manager(run.include_path)
    return PreparedTasks(manager, load_tasks(list(run.tasks), manager))


def evaluate(
    lm,
    run: HarnessRun,
    *,
    model_name: str,
    output_path: str | None = None,
    prepared: PreparedTasks | None = None,
    max_samples: int | None = None,
) -> dict:
    """lm-eval's results (its ``simple_evaluate`` output, ``samples`` included with
    ``log_samples``) of ``lm`` on ``run``'s tasks (``prepared``: already loaded); written under
    ``output_path`` when given, with at most ``max_samples`` samples of each task (None: all)."""
    # lm-eval bootstraps standard errors in a pool of forked processes unless told not to;
    # forking a process that runs JAX's threads can deadlock the children.
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    prepared = prepared or prepare_tasks(run)
    manager, tasks = prepared.manager, prepared.tasks
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    multiturn = run.apply_chat_template if run.fewshot_as_multiturn is None else run.fewshot_as_multiturn
    seeds = {}
    if run.seed is not None:
        seeds = dict.fromkeys(
            ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), run.seed
        )
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args={"pretrained": model_name},
            tasks=tasks,
            num_fewshot=run.num_fewshot,
            batch_size=lm.batch_size,
            limit=run.limit,
            log_samples=run.log_samples,
            evaluation_tracker=tracker,
            apply_chat_template=run.apply_chat_template,
            fewshot_as_multiturn=multiturn,
            gen_kwargs=run.gen_kwargs,
            task_manager=manager,
            bootstrap_iters=run.bootstrap_iters,
            confirm_run_unsafe_code=run.confirm_run_unsafe_code,
            **seeds,
        )
    except ValueError as e:
        if "unsafe" in str(e).lower():
            raise UserError(f"{e} (--confirm-run-unsafe-code; confirm_run_unsafe_code in a config)") from None
        raise
    if max_samples is not None and "samples" in results:
        results["samples"] = {task: found[:max_samples] for task, found in results["samples"].items()}
    if tracker is not None:
        samples = results.pop("samples", None) if run.log_samples else None
        tracker.save_results_aggregated(results=results, samples=samples)
        if run.log_samples:
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
        if samples is not None:
            results["samples"] = samples
    return results


_NOT_METRICS = ("alias", "sample_len")  # lm-eval's entries of a task's results that measure nothing


def averages(results: dict) -> dict[str, float]:
    """Levanter's averages over the tasks that have samples: ``macro_avg_<metric>`` (the mean
    over tasks) and ``micro_avg_<metric>`` (weighted by each task's number of samples)."""
    metrics: set[str] = set()
    for values in results.get("results", {}).values():
        metrics.update(k for k in values if "stderr" not in k and k not in _NOT_METRICS)
    out = {}
    counts = results.get("n-samples", {})
    for metric in sorted(metrics):
        found = []
        for task, count in counts.items():
            value = results["results"].get(task, {}).get(metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            found.append((float(value), count.get("effective", 0)))
        if not found:
            continue
        name = metric.removesuffix(",none")
        out[f"macro_avg_{name}"] = sum(v for v, _ in found) / len(found)
        weight = sum(n for _, n in found)
        if weight:
            out[f"micro_avg_{name}"] = sum(v * n for v, n in found) / weight
    return out


def tracker_metrics(results: dict, prefix: str = "lm_eval") -> dict[str, float]:
    """The numbers of ``results`` as Levanter logs them: ``<prefix>/<task>/<metric>`` (lm-eval's
    ``,none`` filter suffix dropped) for tasks and groups, and ``<prefix>/averages/<name>``."""
    out: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for metric, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or metric in _NOT_METRICS:
                continue
            out[f"{prefix}/{task}/{metric.removesuffix(',none')}"] = float(value)
    for name, value in averages(results).items():
        out[f"{prefix}/averages/{name}"] = float(value)
    return out
