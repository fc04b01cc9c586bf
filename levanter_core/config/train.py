"""The whole configuration of a training run, and loading it from a file."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, cast

from pydantic import (
    AliasChoices,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from levanter_core.config.base import ConfigModel, Typed, TypedList, _tagged, typed_field_kind, validate_section
from levanter_core.config.levanter_current import (
    has_components,
    is_preference_program,
    translate_components,
    translate_preference_program,
)
from levanter_core.config.levanter_distill import is_levanter_distill, translate_levanter_distill
from levanter_core.config.levanter_examples import is_levanter_example, translate_levanter_example
from levanter_core.config.loader import Sources, load_config_dict
from levanter_core.config.sft import SpecialTokensConfig, is_levanter_sft, translate_levanter_sft
from levanter_core.config.storage import StorageConfig, object_store_urls, storage_problem
from levanter_core.config.types import Seed
from levanter_core.data.config import DataSection, data_known_fields
from levanter_core.data.tokenizer import tokenizer_spec_with
from levanter_core.errors import ConfigError, DataError, LevanterError
from levanter_core.hf.bridge import config_from_hf, read_source_hf_config
from levanter_core.lora import LoraConfig
from levanter_core.plugins import registry
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.evaluators import EvaluatorConfig


def _harness(value):
    """Levanter's ``eval_harness`` section: the ``eval_harness`` evaluator's config, or None."""
    if value is None or isinstance(value, EvaluatorConfig):
        return value
    if "eval_harness" not in registry("evaluator"):
        raise ValueError(
            "lm-eval-harness evaluation comes with the levanter-eval-harness plugin, which is not installed "
            "(pip install levanter-eval-harness); remove eval_harness (or set it to null) to train without it"
        )
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping (task_spec, max_examples, ...), got {value!r}")
    return validate_section("evaluator", {"type": "eval_harness", **value})


_harness.__levanter_fixed__ = True  # type: ignore[attr-defined]  # a marker: the config reference lists the eval_harness evaluator's fields only

_HarnessSection = Annotated[
    Any,
    PlainValidator(_tagged(_harness, "evaluator", "eval_harness")),
    PlainSerializer(lambda v: v.model_dump(mode="json", exclude={"type"}) if v is not None else None),
    WithJsonSchema({"type": ["object", "null"], "description": "the eval_harness evaluator's section"}),
]


LORA_HF_SAVE_STEPS = 1000
"""``hf_save_steps`` of a LoRA run that does not set it (Levanter's ``lora_lm`` default)."""


class TrainConfig(ConfigModel):
    """A training run: ``data``, ``model``, ``trainer`` and ``optimizer`` sections."""

    data: DataSection
    """The training (and validation) data: one source written inline (``type``, default
    ``url``) or named sources under ``configs`` mixed by ``train_weights``; the tokenizer, the
    cache directory and the shuffling they share."""
    model: Typed("model")  # type: ignore[valid-type]
    """The architecture, chosen by ``type`` among the installed model plugins."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The training loop, parallelism, evaluation, tracking and checkpoints."""
    train_seq_len: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("train_seq_len", "train_length", "train_seq_length")
    )
    """Train (and evaluate) on sequences of this many tokens, at most the model's context
    (``model.seq_len``, Levanter's ``model.max_seq_len``), which the model keeps: a GPT-2 keeps
    all its position embeddings, exports say the whole context. None: the model's context.
    Levanter's configs also spell it ``train_length`` and ``train_seq_length``."""
    optimizer: Typed("optimizer", "adam") = Field(default_factory=dict)  # type: ignore[valid-type]
    """The optimizer and learning-rate schedule (``type``, default ``adam``)."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """How to reach object stores (``s3://``, ``gs://``) that paths name: endpoint, region and
    credentials, each falling back to the usual environment variables."""

    initialize_from_hf: bool | str | None = None
    """Start from the weights of a Hugging Face model (a local directory, or a hub name: from
    the local Hugging Face cache, or downloaded when the hub is reachable) for continued
    pretraining. ``true``: the model's ``reference_checkpoint`` (or its family's default, e.g.
    ``NousResearch/Llama-2-7b-hf`` for ``llama``). Its tensors must fit ``model`` exactly, unless
    ``use_hf_model_config`` is set. Ignored when the run resumes from its own checkpoint; cannot
    be combined with ``trainer.initialize_from``."""

    use_hf_model_config: bool = False
    """With ``initialize_from_hf``: take the architecture from the Hugging Face
    ``config.json`` instead of the ``model`` section (whose ``seq_len`` is kept)."""

    resize_vocab_to_match_tokenizer: bool = False
    """With ``initialize_from_hf``: when ``data.tokenizer`` does not fit the checkpoint (more
    tokens than its embeddings have rows, or another tokenizer than the one it ships), resize the
    token embeddings and the output head to the tokenizer's size instead of refusing to train:
    rows past the tokenizer's end are dropped, new rows are drawn from a normal distribution with
    the mean and spread of the existing ones (as Levanter's ``resize_vocab_to_match_tokenizer``)."""

    initialize_from_checkpoint_path: str | None = None
    """Start a new run (one with no checkpoint of its own yet) from the whole training state of
    this checkpoint (a checkpoint, or a directory of them: the newest): weights, optimizer state
    and step, continuing the data and the schedule from that step, as Levanter does (ablations
    branching from a shared trunk). Its checkpoints are saved under this run's own path."""

    z_loss_weight: float = Field(0.0, ge=0)
    """Weight of the z-loss, ``z_loss_weight * logsumexp(logits)^2`` averaged over the predicted
    tokens and added to the training loss (PaLM's auxiliary loss keeping the softmax's normalizer
    near 1). 0: none. Logged as ``train/z_loss``; evaluation reports the cross-entropy alone."""

    data_seed: Seed | None = None
    """Seed of the data order (shuffling and mixing) in place of ``trainer.seed``, so the data
    order can change while the initialization stays, or the reverse (0 to 2^32 - 1). None:
    ``trainer.seed``."""

    epoch: int = Field(0, ge=0)
    """Train on at most this many passes over the training data (a single source), then stop even
    if ``trainer.num_train_steps`` is not reached. 0: as many passes as the steps need."""

    log_entropy: bool = False
    """At each evaluation, also log the mean entropy of the model's next-token distribution over
    the validation tokens (``eval/entropy``, and per source ``eval/<source>/entropy``)."""

    hf_save_path: str | None = None
    """Every ``hf_save_steps`` steps, and at the end, export the model (the averaged one under
    ``trainer.model_averaging``) in Hugging Face format to ``{hf_save_path}/{run_id}/step-N/``, as
    ``levanter export-hf`` would; a bucket URL (``s3://``, ``gs://``) gets each export uploaded,
    its index last. None: no exports during training."""
    hf_upload: str | None = None
    """Also upload each export to this Hugging Face hub repository (needs the network and a token;
    ``huggingface_hub`` is installed with the core)."""
    hf_save_steps: int = Field(10000, ge=1)
    """How often to export with ``hf_save_path`` (and ``peft_save_path``); 1000 in a run with
    ``lora`` that leaves it out, as in Levanter's LoRA program."""
    hf_save_dtype: str | None = None
    """Data type of exported tensors (``float32``, ``bfloat16``, ``float16``). None: the
    parameters' own."""

    lora: LoraConfig | None = None
    """Fine-tune low-rank adapters (LoRA) on the model's linear layers instead of the model
    itself: only the adapters are trained and hold optimizer state; checkpoints hold them and
    point to the base weights (``initialize_from_hf`` or ``trainer.initialize_from``). Exports
    (``hf_save_path``, ``levanter export-hf``) write the merged weights; ``peft_save_path`` and
    ``levanter export-hf --peft`` write a PEFT adapter. None: train every weight."""
    peft_save_path: str | None = None
    """With ``lora``: every ``hf_save_steps`` steps and at the end, write the adapters as a
    Hugging Face PEFT adapter directory (``adapter_model.safetensors``, ``adapter_config.json``)
    to ``{peft_save_path}/{run_id}/step-N/``."""
    peft_hf_upload: str | None = None
    """With ``peft_save_path``: also upload each adapter to this Hugging Face hub repository."""
    merged_hf_save_path: str | None = None
    """With ``lora``: Levanter's name for ``hf_save_path`` in LoRA runs (exports of the merged
    weights); give one of the two."""
    merged_hf_upload: str | None = None
    """Levanter's name for ``hf_upload`` in LoRA runs."""
    max_train_length: int | None = Field(None, ge=1)
    """Train on sequences of this many tokens instead of ``model.seq_len`` (Levanter's LoRA and
    fine-tuning programs), e.g. shorter than the imported model's context to save memory."""
    trust_remote_code: bool = False
    """Accepted for Levanter's configs; has no effect: levanter-core never runs code shipped
    with a Hugging Face model, it converts the weights with its own model plugins."""

    special_tokens: SpecialTokensConfig = Field(default_factory=SpecialTokensConfig)
    """Special tokens added to ``data.tokenizer`` for fine-tuning (a pad token, chat markup such as
    ``<|im_start|>``), and how the rows of new and re-drawn tokens start: the model grows to the
    tokenizer's size when it starts from ``initialize_from_hf``, and exports write the grown
    tokenizer. Levanter's ``sft`` configs add its default tokens (``add_missing_defaults``)."""

    objective: str | dict | None = None
    """What the run trains the model to do, when it is not what the model type trains with
    (``lm``, next-token prediction, for language models): an installed objective's name (see
    ``levanter plugins``), or ``{type: NAME, ...}`` with its settings, e.g. ``{type: dpo, beta:
    0.1}`` (preference optimization, from the levanter-preference plugin). Data sources without a
    ``format`` get the one the objective reads."""

    evaluators: TypedList("evaluator") = ()  # type: ignore[valid-type]
    """Evaluations that plugins provide, run during training (each item's ``type`` picks one; see
    ``levanter plugins``); each runs every ``every`` steps (default: with the run's evaluation,
    ``trainer.steps_per_eval``) and after the last step, its metrics sent to the trackers."""
    eval_harness: _HarnessSection = None
    """lm-eval-harness tasks to run during training (Levanter's section: ``task_spec``,
    ``max_examples``...), every ``eval_harness_steps``: the ``eval_harness`` evaluator of the
    ``levanter-eval-harness`` plugin; without that plugin only null is accepted."""
    eval_harness_steps: int = Field(10000, ge=1)
    """How often ``eval_harness`` runs."""

    def run_evaluators(self) -> list:
        """``(config, every)`` of each evaluator to run, ``eval_harness`` last; ``every`` None
        means at each of the run's evaluations."""
        found = [(e, e.every) for e in self.evaluators]
        if self.eval_harness is not None:
            found.append((self.eval_harness, self.eval_harness.every or self.eval_harness_steps))
        return found

    @model_validator(mode="before")
    @classmethod
    def _objective_default_format(cls, raw: Any) -> Any:
        """Sources without a ``format`` get the one the model's objective trains on (speech
        recognition: ``audio``), as Levanter's entry point for each task implies its data."""
        default = _objective_format(raw)
        if default is None:
            return raw
        data = raw.get("data")
        if not isinstance(data, dict):
            return raw
        if isinstance(data.get("configs"), dict):
            configs = {
                name: ({**source, "format": default} if isinstance(source, dict) and "format" not in source else source)
                for name, source in data["configs"].items()
            }
            data = {**data, "configs": configs}
        elif "format" not in data:
            data = {**data, "format": default}
        return {**raw, "data": data}

    @model_validator(mode="before")
    @classmethod
    def _levanter_fine_tuning_names(cls, raw: Any) -> Any:
        """Levanter's LoRA program names ``hf_save_path`` ``merged_hf_save_path`` (and
        ``hf_upload`` ``merged_hf_upload``), trains adapters with the default ``lora`` section
        when its config leaves it out, exports every 1000 steps by default, and sets the
        training length with ``max_train_length``: these are taken here into the fields that do
        the work."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        for alias, name in (("merged_hf_save_path", "hf_save_path"), ("merged_hf_upload", "hf_upload")):
            value = raw.get(alias)
            if value:
                if raw.get(name) and raw[name] != value:
                    raise ValueError(f"{alias} and {name} name two places for the same exports; keep one")
                raw[name] = value
        if "lora" not in raw and any(raw.get(f) for f in ("peft_save_path", "peft_hf_upload", "merged_hf_save_path")):
            raw["lora"] = {}  # Levanter's LoRA program: its lora section defaults to LoRA's defaults
        if raw.get("lora") is not None and "hf_save_steps" not in raw:
            raw["hf_save_steps"] = LORA_HF_SAVE_STEPS
        length, model = raw.get("max_train_length"), raw.get("model")
        if isinstance(length, int) and isinstance(model, dict):
            raw["model"] = {**model, "seq_len": length}
        return raw

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value):
        """A name, or ``{type: NAME, ...settings}``, of an installed objective whose settings
        (its ``options`` model) accept the rest; normalized to ``{type: NAME, ...settings}``."""
        if value is None:
            return None
        section = {"type": value} if isinstance(value, str) else dict(value)
        objective = _installed_objective(section.get("type"))
        settings = {k: v for k, v in section.items() if k != "type"}
        if objective.options is None:
            if settings:
                raise ValueError(f"the {section['type']!r} objective takes no settings, got {sorted(settings)}")
            return section
        try:
            validated = objective.options.model_validate(settings)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"the {section['type']!r} objective's settings: {problems}") from None
        return {"type": section["type"], **validated.model_dump(mode="json")}

    @property
    def objective_options(self):
        """The settings of the ``objective:`` section, validated into its objective's
        ``options`` model (None without an ``objective:`` section or settings)."""
        if self.objective is None:
            return None
        section = cast(dict, self.objective)  # the validator made it {type: NAME, ...settings}
        objective = _installed_objective(section["type"])
        if objective.options is None:
            return None
        return objective.options.model_validate({k: v for k, v in section.items() if k != "type"})

    @field_validator("hf_save_dtype")
    @classmethod
    def _known_dtype(cls, value):
        if value is not None and value not in ("float32", "bfloat16", "float16", "f32", "bf16", "f16"):
            raise ValueError(f"expected float32, bfloat16 or float16, got {value!r}")
        return value

    @model_validator(mode="after")
    def _train_length_fits_the_model(self):
        if self.train_seq_len is not None and self.train_seq_len > self.model.seq_len:
            raise ValueError(
                f"train_seq_len ({self.train_seq_len}) cannot exceed the model's context, model.seq_len "
                f"(Levanter's max_seq_len: {self.model.seq_len}); lower it or raise the model's"
            )
        return self

    @property
    def train_length(self) -> int:
        """The length of the sequences the run trains and evaluates on: ``train_seq_len``, else
        the model's context."""
        return self.train_seq_len or self.model.seq_len

    @model_validator(mode="after")
    def _check_initialization(self):
        if self.initialize_from_hf is True and not self.model.hf_checkpoint:
            raise ValueError(
                f"initialize_from_hf is true, but model type {self.model.type!r} has no default Hugging Face "
                "checkpoint: set model.reference_checkpoint, or give initialize_from_hf a path or hub name"
            )
        if self.initialize_from_hf and self.trainer.initialize_from:
            raise ValueError("initialize_from_hf and trainer.initialize_from cannot both be set; keep one")
        if self.lora is None:
            given = [f for f in ("peft_save_path", "peft_hf_upload") if getattr(self, f)]
            if given:
                raise ValueError(f"{given[0]} writes LoRA adapters, but there is no lora section; add one")
        if self.epoch and self.data.is_mixture:
            raise ValueError("epoch limits the passes over a single source; a mixture (data.configs) cannot use it")
        return self

    @model_validator(mode="after")
    def _add_special_tokens(self):
        """The tokens of ``special_tokens`` join ``data.tokenizer`` (``BASE+{...}``, see
        :func:`~levanter_core.data.tokenizer.tokenizer_spec_with`), so that everything that loads
        the run's tokenizer (the cache, exports, sampling a checkpoint) loads the grown one."""
        if self.special_tokens.reinit_tokens and not self.initialize_from_hf:
            raise ValueError(
                "special_tokens.reinit_tokens re-draws rows of the model that initialize_from_hf loads; set it"
            )
        recipe = self.special_tokens.recipe()
        if recipe:
            try:
                spec = tokenizer_spec_with(self.data.tokenizer, recipe)
            except DataError as e:
                raise ValueError(f"special_tokens: {e}") from None
            object.__setattr__(self, "data", self.data.model_copy(update={"tokenizer": spec}))  # frozen section
        return self

    @model_validator(mode="after")
    def _objective_accepts_the_run(self):
        """The run's objective (its ``objective:`` section's, else the model type's) may refuse
        what it cannot train (:meth:`~levanter_core.objective.Objective.check_config`)."""
        try:
            objective = objective_class(self.model, self)
        except (ConfigError, ValueError):
            return self  # not installed: reported where the objective is needed
        objective.check_config(self)
        return self

    @property
    def hf_source(self) -> str | None:
        """What ``initialize_from_hf`` names: a path or hub name, resolving ``true``."""
        if self.initialize_from_hf is True:
            return self.model.hf_checkpoint
        return self.initialize_from_hf or None


def _installed_objective(name: Any) -> type[Any]:
    """The installed objective called ``name``; ValueError naming the choices otherwise."""
    objectives = registry("objective")
    if not isinstance(name, str) or name not in objectives:
        choices = ", ".join(f"{e.name} ({e.provider})" for e in objectives) or "none"
        raise ValueError(
            f"unknown objective {name!r}; installed: {choices} (preference optimization, dpo, comes with the "
            "levanter-preference plugin)"
        )
    return objectives.get(name).config_cls


def objective_class(model_config, config: TrainConfig | None = None) -> type[Any]:
    """The :class:`~levanter_core.objective.Objective` subclass a run trains with: its
    ``objective:`` section's (``config``), else the model config's (its ``objective``). Raises
    :class:`ConfigError` when no installed plugin registers it."""
    if config is not None and config.objective is not None:
        return _installed_objective(cast(dict, config.objective)["type"])
    name = model_config.objective
    try:
        return registry("objective").get(name).config_cls
    except KeyError as e:
        raise ConfigError(
            f"model.type {model_config.type!r} trains with the {name!r} objective: {e.args[0]} "
            "(install the plugin that provides it)"
        ) from None


def _objective_format(raw: Any) -> dict | None:
    """The ``default_format`` of the objective of the raw config's model type, if the type is
    installed and its objective too (anything else is reported by the fields' own checks)."""
    model = raw.get("model") if isinstance(raw, dict) else None
    name = model.get("type") if isinstance(model, dict) else None
    chosen = raw.get("objective") if isinstance(raw, dict) else None
    if isinstance(chosen, dict):
        chosen = chosen.get("type")
    objective: Any
    if isinstance(chosen, str):
        objective = chosen
    elif not isinstance(name, str) or name not in registry("model"):
        return None
    else:
        objective = getattr(registry("model").get(name).config_cls, "objective", None)
    if not isinstance(objective, str) or objective not in registry("objective"):
        return None
    default = registry("objective").get(objective).config_cls.default_format
    return dict(default) if default else None


def load_train_config(path: str, overrides: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """Load, include, override and validate. Returns the config and the raw merged dict.

    Raises :class:`ConfigError` with one message for people on any problem.
    """
    return train_config_from_raw(*load_config_dict(path, overrides))


def train_config_from_raw(raw: dict, sources: Sources) -> tuple[TrainConfig, dict]:
    """:func:`load_train_config` from a config's merged dict and where each key came from
    (:func:`~levanter_core.config.loader.load_config_dict`)."""
    if is_levanter_example(raw):  # Levanter's alpaca / alpaca_lora / gsm8k_lora examples' config
        raw, sources = translate_levanter_example(raw, sources)
    if is_levanter_sft(raw):  # Levanter's sft / sft_mixture programs' config
        raw, sources = translate_levanter_sft(raw, sources)
    if is_preference_program(raw):  # Levanter's train_dpo / lora_dpo / train_simpo programs' config
        raw, sources = translate_preference_program(raw, sources)
    if is_levanter_distill(raw):  # Levanter's distill_lm program's config
        raw, sources = translate_levanter_distill(raw, sources)
    if has_components(raw):  # Levanter's current data schema: data.components
        raw, sources = translate_components(raw, sources)
    raw = _model_from_hf(raw, sources)  # reads a config.json: part of loading, not of validation
    config = validate_train_config(raw, sources)
    prepare_storage(config, raw, sources)
    return config, raw


def validate_train_config(raw: dict, sources: Sources) -> TrainConfig:
    """Validate ``raw`` (a config's merged dict; ``sources`` says where each value came from,
    for the messages). Reads no file and touches nothing outside: the reading of what the
    config names (a Hugging Face ``config.json``, tokenizers, data, object stores) happens when
    it is loaded (:func:`load_train_config`) and in the run's preflight
    (:func:`levanter_core.run.setup.preflight`)."""
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, sources)) from None
    check_schedule(config, sources)
    return config


def prepare_storage(config: TrainConfig, raw: dict, sources: Sources) -> None:
    """Apply the ``storage`` section to this process's environment and check that every object
    store the config names can be reached (its filesystem package installed, credentials
    found)."""
    config.storage.apply()
    check_storage(raw, sources)


def check_schedule(config: TrainConfig, sources: Sources) -> None:
    """Raise :class:`ConfigError` naming the optimizer field whose phases (warmup, decay,
    cycles, ...) do not fit ``trainer.num_train_steps``, which the run would find only when it
    builds the optimizer."""
    try:
        config.optimizer.check_schedule(config.trainer.num_train_steps)
    except ConfigError as e:
        dotted, _, problem = str(e).partition(": ")
        place = sources.place_of(tuple(dotted.split(".")))
        raise ConfigError(f"invalid config {sources.main_file}:\n  {dotted} ({place}): {problem}") from None


def _model_from_hf(raw: dict, sources: Sources) -> dict:
    """A config without a ``model`` section that names a Hugging Face model in
    ``initialize_from_hf`` (Levanter's LoRA configs) gets the architecture of that model's
    ``config.json``, read from its directory or the local Hugging Face cache."""
    source = raw.get("initialize_from_hf") if isinstance(raw, dict) else None
    if "model" in raw or not isinstance(source, str) or not source:
        return raw
    try:
        model = config_from_hf(read_source_hf_config(source), source=f"{source}/config.json")
    except LevanterError as e:
        place = sources.place_of(("initialize_from_hf",))
        raise ConfigError(
            f"invalid config {sources.main_file}:\n  model: there is no model section, so the architecture is "
            f"that of initialize_from_hf ({place}), which cannot be read: {e}"
        ) from None
    return {**raw, "model": model.model_dump(mode="json")}


def check_storage(raw: dict, sources: Sources) -> None:
    """Raise :class:`ConfigError` naming each field whose object-store URL cannot be reached
    from here (the first such field per store)."""
    lines, seen = [], set()
    for loc, url in object_store_urls(raw):
        store = url.split("://", 1)[0]
        if store in seen:
            continue
        seen.add(store)
        problem = storage_problem(url)
        if problem is not None:
            dotted = ".".join(str(p) for p in loc)
            lines.append(f"  {dotted} ({sources.place_of(loc)}): {url}: {problem}")
    if lines:
        raise ConfigError(f"invalid config {sources.main_file}:\n" + "\n".join(lines))


# -- messages ------------------------------------------------------------------------------


def format_validation_error(error: ValidationError, raw: dict, sources: Sources) -> str:
    lines = [f"invalid config {sources.main_file}:"]
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        lines.append(f"  {dotted} ({sources.place_of(loc)}): {_describe(err, raw)}")
    return "\n".join(lines)


def _describe(err: Any, raw: dict) -> str:
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1], raw)
        hint = ""
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        elif known:
            hint = f"; known fields here: {', '.join(known)}"
        return f"unknown field {loc[-1]!r}{hint}"
    if kind == "missing":
        return "this field is required"
    msg = err["msg"].removeprefix("Value error, ")
    if kind in ("unknown_type", "missing_type", "typed_section", "misplaced_field"):
        return msg
    given = err.get("input")
    if isinstance(given, (str, int, float, bool, list)) or given is None:
        return f"{msg} (got {given!r})"
    return msg


def _known_fields(loc: tuple, raw: dict) -> list[str]:
    """The field names allowed at ``loc`` (for did-you-mean hints)."""
    cls: Any = TrainConfig
    node: Any = raw
    if loc[:1] == ("data",):
        return data_known_fields(loc[1:], raw.get("data"))
    for part in loc:
        node = _child(node, part)
        if isinstance(part, int):  # an item of a list of sections: same class
            continue
        if not (isinstance(cls, type) and issubclass(cls, ConfigModel)) or part not in cls.model_fields:
            return []
        field = cls.model_fields[part]
        cls = field.annotation
        typed = typed_field_kind(field)
        if typed is not None:
            kind, default = typed
            name = node.get("type", default) if isinstance(node, dict) else None
            reg = registry(kind)
            if not isinstance(name, str) or name not in reg:
                return []
            cls = reg.get(name).config_cls
    if isinstance(cls, type) and issubclass(cls, ConfigModel):
        return sorted(cls.model_fields)
    return []


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return None
