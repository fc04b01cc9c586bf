"""The ``eval_harness`` evaluator: lm-eval's tasks on the model being trained, every
``eval_harness_steps`` steps (Levanter's ``eval_harness`` section, or an item of
``evaluators``).

Every process of the run calls :meth:`HarnessEvaluator.evaluate` with its part of the model:
process 0 runs lm-eval and the others compute their share of each batch
(:mod:`~levanter_eval_harness.compute`), then process 0's metrics are shared with them, so
that every process returns the same numbers. The results JSON (and samples, when asked for)
go to ``<run dir>/lm_eval/step-N/`` as lm-eval lays them out."""

from __future__ import annotations

import itertools
import json
import logging
import os

import jax

from levanter_core import distributed
from levanter_core.trainer.evaluators import Evaluator, EvaluatorContext
from levanter_eval_harness.compute import Leader, Scorer, follow
from levanter_eval_harness.harness import PreparedTasks, evaluate, tracker_metrics
from levanter_eval_harness.lm import DEFAULT_MAX_GEN_TOKS, LevanterLM
from levanter_eval_harness.tasks import check_task_names, load_tasks, task_manager

logger = logging.getLogger(__name__)

_instances = itertools.count()  # numbers the evaluators of a run alike in every process


class HarnessEvaluator(Evaluator):
    def __init__(self, config, context: EvaluatorContext):
        self.config = config
        self.context = context
        self.number = next(_instances)
        trainer = context.trainer
        self.scorer = Scorer(
            None, mesh=trainer.mesh, compute_mapping=trainer.compute_mapping, cast=trainer.mp.cast_to_compute
        )
        self.batch_size = config.batch_size or trainer.plan.eval_batch_size
        self.max_length = min(config.max_eval_length or context.seq_len, context.seq_len)
        self.run = config.harness_run()
        self.leader = jax.process_index() == 0
        # Tasks are looked up now: the evaluator is built as the run starts, so an unknown task
        # stops it before its first step.
        self.manager = None
        if self.leader:
            self.manager = task_manager(config.include_path)
            check_task_names(self.run.tasks, self.manager)

    def evaluate(self, model, step: int) -> dict[str, float]:
        self.scorer.model = model
        name = f"eval_harness/{self.number}/step-{step}"
        if not self.leader:
            follow(self.scorer)
            return json.loads(distributed.share(name))
        leader = Leader(self.scorer)
        try:
            metrics = self._evaluate(leader, step)
        finally:
            leader.stop()
        distributed.share(name, json.dumps(metrics))
        return metrics

    def _evaluate(self, leader, step: int) -> dict[str, float]:
        config = self.config
        lm = LevanterLM(
            self.scorer.model,
            self.context.tokenizer,
            max_length=self.max_length,
            batch_size=self.batch_size,
            max_gen_toks=int(config.generation_kwargs.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS),
            generation_defaults=config.generation_defaults(),
            name=f"step-{step}",
            leader=leader,
        )
        run_dir = self.context.run_dir
        local = "://" not in run_dir
        if not local:
            logger.warning("eval_harness: the run directory %s is not local; lm-eval's files are not written", run_dir)
        try:
            prepared = PreparedTasks(self.manager, load_tasks(self.run.tasks, self.manager))
            results = evaluate(
                lm,
                self.run,
                model_name=f"step-{step}",
                output_path=os.path.join(run_dir, "lm_eval") if local else None,
                prepared=prepared,
                max_samples=config.max_samples(),
            )
        finally:
            lm.close()
        return tracker_metrics(results)
