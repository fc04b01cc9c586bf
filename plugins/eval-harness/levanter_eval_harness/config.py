"""The harness's configs: Levanter's ``eval_harness`` section (:class:`HarnessConfig`, the
``eval_harness`` evaluator of training runs) and Levanter's standalone harness config
(:class:`HarnessMainConfig`, what ``levanter eval-harness --config FILE`` reads:
``config/harness/*.yaml``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, NonNegativeInt, PositiveInt, ValidationError, field_validator, model_validator

from levanter_core.config.base import ConfigModel
from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import format_validation_error
from levanter_core.errors import ConfigError
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.evaluators import Evaluator, EvaluatorConfig, EvaluatorContext
from levanter_eval_harness.harness import HarnessRun
from levanter_eval_harness.training import HarnessEvaluator

GENERATION_DEFAULTS = {"max_gen_toks": 256, "temperature": 0.0, "n": 1, "seed": None}


class SampleLoggingConfig(ConfigModel):
    """How many of each task's samples (prompts, answers, scores) a training run keeps."""

    log_all: bool = False
    """Keep every sample."""
    max_samples_per_benchmark: NonNegativeInt | None = None
    """Keep at most this many samples of each task (None or 0: none, unless ``log_all``)."""

    def should_log(self) -> bool:
        return self.log_all or bool(self.max_samples_per_benchmark)


class HarnessConfig(EvaluatorConfig):
    """lm-eval-harness tasks to evaluate the model on (Levanter's ``eval_harness`` section).

    In training, process 0 runs lm-eval every ``eval_harness_steps`` (or this evaluator's
    ``every``) and the trackers get ``lm_eval/<task>/<metric>`` and
    ``lm_eval/averages/{macro,micro}_avg_<metric>``; the results JSON (and samples, when asked
    for) are written under the run directory, in ``lm_eval/step-N/``."""

    type: str = "eval_harness"

    task_spec: list[str | dict[str, Any]] = Field(min_length=1)
    """The tasks: lm-eval names (tasks, groups, tags) or YAML paths, or mappings with ``task`` and
    lm-eval task settings (``num_fewshot``, ``task_alias`` to run a task twice under two names,
    ``description``, ``doc_to_text``, ... and Levanter's ``additional_stop_strings``)."""
    max_examples: PositiveInt | None = None
    """At most this many examples of each task (lm-eval's ``limit``); None: all."""
    max_eval_length: PositiveInt | None = Field(None, alias="max_length")
    """The most tokens the model sees at once; None: its ``seq_len``. (``max_length`` is the
    same field, as newer Levanter versions name it.)"""
    log_samples: bool = False
    """Write lm-eval's per-sample files beside the results."""
    bootstrap_iters: NonNegativeInt = 0
    """Bootstrap iterations for the metrics' standard errors (0: none, faster)."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template."""
    fewshot_as_multiturn: bool = False
    """With ``apply_chat_template``: few-shot examples as turns of the conversation."""
    confirm_run_unsafe_code: bool = True
    """Allow tasks that run model-written code (lm-eval refuses them otherwise)."""
    sample_logging: SampleLoggingConfig = SampleLoggingConfig()
    """Samples to keep per task, written as lm-eval's samples files (as ``log_samples``, capped)."""
    generation_kwargs: dict[str, Any] = Field(default_factory=lambda: dict(GENERATION_DEFAULTS))
    """Defaults for generation tasks (a task's own settings win): ``max_gen_toks``,
    ``temperature`` (0: greedy), ``seed``, and ``n``, which must be 1."""
    include_path: str | list[str] | None = None
    """Directories of task YAML of your own, as ``--include-path`` (not in Levanter)."""
    batch_size: PositiveInt | None = None
    """Distinct inputs per log-likelihood batch and sequences generated together; None: the
    trainer's evaluation batch size (``trainer.per_device_eval_parallelism`` times the devices)."""

    model_config = {"populate_by_name": True}

    @field_validator("task_spec")
    @classmethod
    def _check_specs(cls, specs: list) -> list:
        for i, spec in enumerate(specs):
            if isinstance(spec, dict):
                if not isinstance(spec.get("task"), str) or not spec["task"]:
                    raise ValueError(f"entry {i} needs a task name ('task'), found {spec!r}")
                stops = spec.get("additional_stop_strings")
                if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
                    raise ValueError(f"entry {i}: additional_stop_strings must be a list of strings")
        return [{k: v for k, v in s.items() if v is not None} if isinstance(s, dict) else s for s in specs]

    @field_validator("generation_kwargs")
    @classmethod
    def _check_generation(cls, kwargs: dict) -> dict:
        unknown = sorted(set(kwargs) - {"max_gen_toks", "temperature", "n", "seed", "top_p", "top_k", "do_sample"})
        if unknown:
            raise ValueError(f"unknown generation setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
        if int(kwargs.get("n") or 1) != 1:
            raise ValueError(
                "n (several generations per request) is not supported: lm-eval's generate_until takes one "
                "answer per request; set n to 1"
            )
        return {**GENERATION_DEFAULTS, **kwargs}

    def harness_run(self):
        """The :class:`~levanter_eval_harness.harness.HarnessRun` of this config."""
        return HarnessRun(
            tasks=list(self.task_spec),
            include_path=self.include_path,
            limit=self.max_examples,
            apply_chat_template=self.apply_chat_template,
            fewshot_as_multiturn=self.fewshot_as_multiturn,
            log_samples=self.log_samples or self.sample_logging.should_log(),
            bootstrap_iters=self.bootstrap_iters,
            confirm_run_unsafe_code=self.confirm_run_unsafe_code,
        )

    def max_samples(self) -> int | None:
        """Samples of each task to write (None: all of them, when any are written)."""
        if self.log_samples or self.sample_logging.log_all:
            return None
        return self.sample_logging.max_samples_per_benchmark

    def generation_defaults(self) -> dict[str, Any]:
        """What a generation request's own settings fill in (``max_gen_toks`` is the model's
        default length instead): sampling settings for requests that choose neither
        ``temperature`` nor ``do_sample``, and the seed."""
        out = {k: v for k, v in self.generation_kwargs.items() if k not in ("n", "max_gen_toks") and v is not None}
        if float(out.get("temperature", 0.0)) > 0:
            out.setdefault("do_sample", True)
        return out

    def build(self, context: EvaluatorContext) -> Evaluator:
        return HarnessEvaluator(self, context)


class HarnessMainConfig(ConfigModel):
    """What ``levanter eval-harness --config FILE`` reads: Levanter's standalone harness config
    (``config/harness/*.yaml``)."""

    eval_harness: HarnessConfig
    """The tasks and their settings (as in a training config)."""
    tokenizer: str | None = None
    """The tokenizer (as ``data.tokenizer``); default: the model's own."""
    checkpoint_path: str | None = None
    """The model to evaluate: one of our checkpoints or imports, or with ``checkpoint_is_hf`` a
    Hugging Face model directory or hub name (SOURCE on the command line wins)."""
    checkpoint_is_hf: bool = False
    """Whether ``checkpoint_path`` is a Hugging Face model (we tell by looking; accepted)."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (also ``eval_harness.apply_chat_template``)."""
    fewshot_as_multiturn: bool = False
    """With the chat template: few-shot examples as turns of the conversation."""
    trainer: TrainerConfig = TrainerConfig()
    """Levanter's trainer section: ``distributed`` (several processes), the mesh's axes,
    ``mp`` (the precision the model computes in) and ``per_device_eval_parallelism``."""
    model: dict[str, Any] | None = None
    """Levanter builds the model for ``checkpoint_path`` from this; our checkpoints and Hugging Face
    directories describe their own model, so it is accepted and not needed."""

    @model_validator(mode="before")
    @classmethod
    def _harness_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("eval_harness"), dict):
            harness = data["eval_harness"]
            if harness.get("type", "eval_harness") != "eval_harness":
                raise ValueError(f"eval_harness.type must be eval_harness, not {harness['type']!r}")
        return data


def load_main_config(path: str, overrides: list[str] | None = None) -> HarnessMainConfig:
    """Load, include, override and validate a standalone harness config (errors name the file,
    the line and the field)."""
    raw, sources = load_config_dict(path, overrides)
    try:
        return HarnessMainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, sources)) from None
