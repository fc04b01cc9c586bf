"""The ``data:`` section: one source, or a named mixture of sources, with the
settings they share (tokenizer, cache, shuffling, workers, bad-data policy).

A single source is written inline, as in Levanter::

    data:
      train_urls: ["corpus/train.{1..8}.jsonl.gz"]
      validation_urls: ["corpus/val.jsonl.gz"]
      cache_dir: cache/corpus
      tokenizer: tokenizers/corpus

Several sources go under ``configs``, each with its own name; ``train_weights``
says how often each is sampled::

    data:
      cache_dir: cache/
      configs:
        code: {type: python_stdlib}
        web: {train_urls: ["web/*.jsonl.zst"], validation_urls: ["web/val.jsonl"]}
      train_weights: {code: 0.3, web: 0.7}
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    Field,
    NonNegativeInt,
    PlainSerializer,
    PlainValidator,
    PositiveInt,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from levanter_core.config.base import ConfigModel, Typed, _fail, _validate_one, accepted_only_as
from levanter_core.config.types import LargeCount, parse_size
from levanter_core.fileio import require_filesystem
from levanter_core.plugins import registry

SINGLE = "main"
"""The name the only source of a non-mixture ``data:`` section gets."""

Weights = dict[str, Annotated[float, Field(ge=0)]]


class CacheOptions(ConfigModel):
    """How a cache is built (Levanter's ``cache_options``): none of these changes what the cache
    holds, only how the build spends memory and time."""

    batch_size: PositiveInt = 128
    """Records tokenized together in one call of the tokenizer."""
    num_shard_groups: PositiveInt | None = 128
    """At most this many groups of shards are tokenized as separate tasks (on a Ray cluster, one
    task per group); None: one task per shard. The cache's order is the shards' order either way."""
    target_size_per_flush: LargeCount | str = "512MB"
    """How much a worker accumulates before writing to the cache: bytes as a number or a size such
    as ``512MB``. Smaller values use less memory and write more often. A worker also writes after
    every thousand records or so, so that training can read a large shard as it is tokenized."""

    in_process_below: NonNegativeInt | str = "1MB"
    """A build whose unfinished input files come to less than this (bytes as a number, or a size
    such as ``1MB``) is tokenized by threads of the process that builds it instead of
    ``data.num_workers`` worker processes, each of which takes seconds to start (it imports the
    framework): longer than tokenizing that much text. 0: always worker processes. Inputs whose
    size the source does not report (a Hugging Face dataset, the Python standard library) and
    builds on a Ray cluster (``trainer.ray.address``) are never tokenized in process. (Not in
    Levanter, which tokenizes on Ray.)"""

    @property
    def target_bytes_per_flush(self) -> int:
        return parse_size(self.target_size_per_flush)

    @property
    def in_process_bytes(self) -> int:
        """:attr:`in_process_below` in bytes (0: never in process)."""
        return 0 if self.in_process_below == 0 else parse_size(self.in_process_below)

    @field_validator("target_size_per_flush")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        parse_size(value)
        return value

    @field_validator("in_process_below")
    @classmethod
    def _size_or_zero(cls, value: int | str) -> int | str:
        if value not in (0, "0"):
            parse_size(value)
        return 0 if value == "0" else value


def _typed_sources(configs: Any) -> Any:
    """Each source of ``configs`` written without ``type`` gets the one its keys imply (``id``:
    a Hugging Face dataset), as an inline single source does."""
    if not isinstance(configs, dict):
        return configs

    def typed(section: Any) -> Any:
        if isinstance(section, dict) and "type" not in section:
            return {**section, "type": _inferred_type(section)}
        return section

    return {name: typed(section) for name, section in configs.items()}


class DataConfig(ConfigModel):
    """The training and validation data: its sources, tokenizer and cache."""

    tokenizer: str = "gpt2"
    """``byte`` for the built-in byte-level tokenizer (256 byte ids plus ``<|endoftext|>``); the
    path of a Hugging Face ``tokenizer.json`` or of a directory containing one (with its
    ``tokenizer_config.json``, whose ``eos_token`` and ``chat_template`` are used); or a Hugging
    Face hub name such as ``gpt2`` or ``meta-llama/Llama-2-7b-hf``, read from the local Hugging
    Face cache (downloaded when the hub is reachable). Default: ``gpt2``, as in Levanter."""

    vocab_size: PositiveInt | None = None
    """Levanter's vocabulary size for its ``passthrough`` tokenizer (pre-tokenized data); that
    tokenizer is not available here, so only null is accepted."""

    cache_dir: str | None = "cache/"
    """Where the tokenized caches live: a local directory or an fsspec URL. A single source
    caches each split in ``{cache_dir}/{split}``; a mixture's source ``name`` in
    ``{cache_dir}/{name}/{split}`` unless it sets its own ``cache_dir``. A cache built from
    other inputs, another tokenizer or another format is refused, never silently reused.
    Null: every source sets its own ``cache_dir``."""

    enforce_eos: bool = True
    """Append the end-of-text token after every document (and supervised example), so
    documents joined into one stream stay separated."""

    shuffle: bool | PositiveInt = False
    """``true``: a keyed permutation of all of each source's sequences, a new one each epoch
    (training waits for the source's cache to be complete, since the permutation needs its
    size). An integer N: shuffle within consecutive eras of N sequences, so training starts
    as soon as the first sequences are cached. ``false`` (the default, as in Levanter): read in
    order, starting at once. Either way the batch at step N depends only on the seed and N.
    Evaluation always reads in order."""

    permutation_type: Literal["feistel", "linear"] | None = None
    """Levanter's choice of permutation for ``shuffle``. Here every shuffle uses one keyed
    permutation (a Feistel network over the sequence indices), whatever this says."""

    shuffle_buffer_size: PositiveInt | None = None
    """Deprecated (Levanter's older shuffle buffer): the same as ``shuffle: N``, shuffling within
    consecutive eras of N sequences."""

    cache_options: CacheOptions = Field(default_factory=CacheOptions)
    """How caches are built (``batch_size``, ``num_shard_groups``, ``target_size_per_flush``,
    ``in_process_below``)."""

    stop_strategy: Literal["restart", "first_exhausted", "all_exhausted"] = "restart"
    """What a mixture does when a source's training data runs out: ``restart`` it (another epoch,
    reshuffled); ``first_exhausted``: end training when the first source runs out;
    ``all_exhausted``: restart sources that run out until every source has run out once, then
    end training. A run that ends early says so and saves its last checkpoint."""

    target_budget: LargeCount | None = None
    """Simulated epoching: the number of tokens (or sequences, any unit, with ``experiment_budget``
    in the same unit) of the full-scale run being simulated. With ``experiment_budget``, each
    training source is cut to the fraction ``experiment_budget / target_budget`` of its sequences,
    so a short run sees its data repeat as often as the full run would."""
    experiment_budget: LargeCount | None = None
    """Simulated epoching: the budget of this run, in the unit of ``target_budget``."""

    max_train_batches: dict[str, PositiveInt] | None = None
    """Per source: train on only its first N x (the first stage's) ``train_batch_size`` sequences,
    repeating them as the mixture needs."""

    num_validation_sequences: dict[str, PositiveInt] | None = None
    """Per source: hold out the last N sequences of its training data for validation (in place of
    any validation data it has); training uses the rest."""

    shuffle_before_trainval_split: bool = False
    """With ``num_validation_sequences``: hold out a random subset of each source's training
    sequences (the tail of one fixed keyed order, the same for every seed) rather than its last
    N; training then waits for that source's cache to be complete. Levanter's current schema
    defaults to true (its configs with ``components`` get that default); ``false`` is its
    release's behaviour and the default here."""

    validation_split_fraction: float | None = Field(None, ge=0, lt=1)
    """Hold out the last fraction of the training data of the one source trained on, as its
    validation set (in place of any validation data it has): ``int(n x fraction)`` of its ``n``
    sequences (rows: pairs, for preference data), at least 1 and at most ``n - 1``; none when
    ``n`` is 1 or the fraction 0. Training waits for that source's cache to be complete, since
    the split needs its size. Levanter's DPO and SimPO programs' ``validation_split_fraction``;
    a mixture with more than one trained source uses ``num_validation_sequences`` instead."""

    configs: dict[str, Typed("data_source", "url")] = Field(default_factory=dict)  # type: ignore[valid-type]
    """Named sources to mix, each a data source section (``type``, default ``url``). Leave
    empty and write the source's fields directly under ``data:`` for a single source."""

    train_weights: Weights | list[tuple[NonNegativeInt, Weights]] | None = None
    """How often each source of ``configs`` is sampled for training: a mapping from name to
    weight (normalized; 0 leaves a source out of training but keeps its validation set), or a
    list of ``[step, {name: weight}]`` stages, the first at step 0. Default: equal weights.
    Changing the weights never re-tokenizes anything."""

    mixture_block_size: PositiveInt = 2048
    """Sequences per mixture block: each block holds each source's share (by
    ``train_weights``) exactly, in a keyed random order."""

    num_workers: PositiveInt = 1
    """Processes tokenizing on this machine; shards (files) are spread over them. With
    ``trainer.ray`` connected to a cluster, Ray workers are used instead. The cache is the
    same whatever the number."""

    skip_bad_data: bool = False
    """Skip records that cannot be used (not UTF-8, not JSON, missing the text field, an
    empty chat...) and count them in the logs, instead of stopping with the file and line."""

    _filesystem_installed = field_validator("cache_dir")(require_filesystem)

    @field_validator("configs", mode="before")
    @classmethod
    def _infer_source_types(cls, value: Any) -> Any:
        return _typed_sources(value)

    _no_passthrough = accepted_only_as(
        None,
        "vocab_size",
        why="Levanter's passthrough tokenizer (pre-tokenized data) is not available; remove vocab_size",
    )

    @model_validator(mode="after")
    def _check_cache_dirs(self):
        if self.cache_dir is None:
            homeless = [name for name, source in self.configs.items() if not source.cache_dir]
            if homeless:
                raise ValueError(
                    "cache_dir is null, so every source needs its own cache_dir; "
                    f"{', '.join(sorted(homeless))} has none"
                )
        return self

    @model_validator(mode="after")
    def _check_budgets(self):
        if (self.target_budget is None) != (self.experiment_budget is None):
            raise ValueError("target_budget and experiment_budget go together: set both or neither")
        if self.target_budget is not None and self.experiment_budget > self.target_budget:
            raise ValueError(
                f"experiment_budget ({self.experiment_budget}) must not exceed target_budget ({self.target_budget})"
            )
        if self.target_budget is not None and (self.max_train_batches or self.num_validation_sequences):
            raise ValueError(
                "simulated epoching (target_budget, experiment_budget) cannot be combined with max_train_batches "
                "or num_validation_sequences, as in Levanter"
            )
        if self.validation_split_fraction:
            trained = [name for name in self.configs if any(w[name] > 0 for _, w in self.weight_stages())]
            if len(trained) != 1:
                raise ValueError(
                    f"validation_split_fraction holds out part of the one source trained on, but {len(trained)} "
                    f"are ({', '.join(trained)}); give each a held-out count with num_validation_sequences instead"
                )
            if trained[0] in (self.num_validation_sequences or {}):
                raise ValueError(
                    f"validation_split_fraction and num_validation_sequences.{trained[0]} both hold out part of "
                    f"{trained[0]!r}; keep one"
                )
        for field in ("max_train_batches", "num_validation_sequences"):
            unknown = set(getattr(self, field) or {}) - set(self.configs)
            if unknown:
                raise ValueError(f"{field} names {', '.join(sorted(unknown))}, not among data.configs")
        return self

    @property
    def effective_shuffle(self) -> bool | int:
        """``shuffle``, or the era size of the deprecated ``shuffle_buffer_size``."""
        if self.shuffle is False and self.shuffle_buffer_size:
            return self.shuffle_buffer_size
        return self.shuffle

    @property
    def budget_fraction(self) -> float | None:
        """The share of each training source that simulated epoching keeps; None: all of it."""
        if self.target_budget is None:
            return None
        return self.experiment_budget / self.target_budget

    @model_validator(mode="after")
    def _check_weights(self):
        names = set(self.configs)
        for step, weights in self._raw_stages():
            unknown = set(weights) - names
            if unknown:
                raise ValueError(
                    f"train_weights names {', '.join(sorted(unknown))}, not among data.configs "
                    f"({', '.join(sorted(names)) or 'empty'})"
                )
            if not any(w > 0 for w in weights.values()):
                raise ValueError(f"train_weights at step {step}: no source has a positive weight")
        for step, weights in self.weight_stages():
            for name, weight in weights.items():
                if 0 < weight * self.mixture_block_size < 1:
                    raise ValueError(
                        f"train_weights at step {step}: {name!r} would get {weight * self.mixture_block_size:.2g} "
                        f"of every {self.mixture_block_size} sequences, so it might never be drawn; raise "
                        "mixture_block_size or its weight"
                    )
        steps = [step for step, _ in self._raw_stages()]
        if steps[0] != 0 or steps != sorted(set(steps)):
            raise ValueError(f"train_weights stages must start at step 0 and increase (got steps {steps})")
        return self

    def held_out(self) -> dict[str, int | float]:
        """The sources validated on the tail of their own training data: ``name -> count`` (of
        ``num_validation_sequences``) or ``name -> fraction`` (``validation_split_fraction``)."""
        found: dict[str, int | float] = dict(self.num_validation_sequences or {})
        if self.validation_split_fraction:
            stages = self.weight_stages()
            trained = next(name for name in self.configs if any(w[name] > 0 for _, w in stages))
            found[trained] = float(self.validation_split_fraction)
        return found

    def shuffles_split(self, count: int | float) -> bool:
        """Whether the hold-out ``count`` (of :meth:`held_out`) is a random subset: counts of
        ``num_validation_sequences`` with ``shuffle_before_trainval_split``; a fraction
        (``validation_split_fraction``, Levanter's DPO split) is always the tail."""
        return self.shuffle_before_trainval_split and not isinstance(count, float)

    def field_of(self, name: str) -> str:
        """The dotted config field of source ``name``, for messages."""
        return f"data.configs.{name}" if self.is_mixture else "data"

    @property
    def is_mixture(self) -> bool:
        return len(self.configs) > 1 or SINGLE not in self.configs

    def _raw_stages(self) -> list[tuple[int, dict[str, float]]]:
        raw = self.train_weights
        if raw is None:
            return [(0, dict.fromkeys(self.configs, 1.0))]
        if isinstance(raw, dict):
            return [(0, dict(raw))]
        return [(int(step), dict(weights)) for step, weights in raw] or [(0, {})]

    def weight_stages(self) -> list[tuple[int, dict[str, float]]]:
        """``[(start_step, {name: normalized weight})]``; every source appears in each stage."""
        stages = []
        for step, weights in self._raw_stages():
            total = sum(weights.values())
            stages.append((step, {name: weights.get(name, 0.0) / total for name in self.configs}))
        return stages

    def cache_path(self, name: str, split: str) -> str:
        """The cache directory of source ``name``'s ``split``."""
        source = self.configs[name]
        if source.cache_dir:
            root = source.cache_dir
        else:
            assert self.cache_dir is not None, "refused by _check_cache_dirs: a source without a cache_dir of its own"
            root = posixpath.join(self.cache_dir, name) if self.is_mixture else self.cache_dir
        return posixpath.join(root.rstrip("/") or "/", split)


def _own_fields() -> set[str]:
    return set(DataConfig.model_fields)


def validate_data_section(value: Any) -> DataConfig:
    """The ``data:`` section: a :class:`DataConfig`, where a section without ``configs``
    is one source written inline (its ``type``, default ``url``, and fields)."""
    if isinstance(value, DataConfig):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _fail((), "typed_section", f"expected a mapping, got {value!r}", value)
    own = {k: v for k, v in value.items() if k in _own_fields()}
    rest = {k: v for k, v in value.items() if k not in _own_fields()}
    if "configs" in own:
        if rest:
            errors: list[InitErrorDetails] = [
                {
                    "type": PydanticCustomError(
                        "misplaced_field",
                        "with data.configs set, a source's fields go under data.configs.<name>; "
                        "this section takes only: {known}",
                        {"known": ", ".join(sorted(_own_fields()))},
                    ),
                    "loc": (k,),
                    "input": v,
                }
                for k, v in rest.items()
            ]
            raise ValidationError.from_exception_data("config", errors)
    else:
        rest.setdefault("type", _inferred_type(rest))
        own["configs"] = {SINGLE: _validate_one("data_source", "url", rest)}
    return DataConfig.model_validate(own)


def _inferred_type(section: dict) -> str:
    """The source type for a section without ``type``: the registered source whose
    ``inferred_from`` keys appear in it, else ``url``."""
    reg = registry("data_source")
    for name in reg.names():
        cls = reg.get(name).config_cls
        if any(key in section for key in getattr(cls, "inferred_from", ())):
            return name
    return "url"


def data_known_fields(loc: tuple, section: Any) -> list[str]:
    """The field names allowed at ``loc`` inside the ``data:`` section ``section`` (raw), for
    did-you-mean hints: the section's own fields plus its inline source's, or a mixture
    source's fields under ``configs.<name>``."""
    section = section if isinstance(section, dict) else {}
    reg = registry("data_source")

    def source_fields(node: Any) -> list[str]:
        node = node if isinstance(node, dict) else {}
        name = node.get("type") or _inferred_type(node)
        if name not in reg:
            return []
        # A data_source entry's class is a DataSourceConfig (the registry checks), a pydantic model.
        return sorted(cast("type[BaseModel]", reg.get(name).config_cls).model_fields)

    if not loc:
        if "configs" in section:
            return sorted(_own_fields())
        return sorted(_own_fields() | set(source_fields(section)))
    if loc[0] == "configs" and len(loc) == 2:
        configs = section.get("configs")
        return source_fields(configs.get(loc[1]) if isinstance(configs, dict) else None)
    return []


def _serialize(config: DataConfig) -> dict:
    data = config.model_dump(mode="json")
    if not config.is_mixture:  # written back inline, the way it was given
        source = data.pop("configs")[SINGLE]
        for key in ("train_weights", "mixture_block_size"):
            data.pop(key)
        data = {**source, **data}  # the section's cache_dir, not the source's (unset)
    return data


def _tag(func):
    func.__levanter_data_section__ = True
    return func


DataSection = Annotated[
    Any,
    PlainValidator(_tag(validate_data_section)),
    PlainSerializer(_serialize),
    WithJsonSchema({"type": "object", "description": "the data section"}),
]
"""Annotation of ``TrainConfig.data``."""
