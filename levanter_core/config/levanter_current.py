"""Levanter's current ``data:`` schema (``marin-community/marin``, ``lib/levanter``), read as ours.

Levanter's data section now names its sources ``components``, each a ``source`` (where the
records are: ``{type: url, train_urls, validation_urls}`` or ``{type: hf, id, ...}``) beside the
``format`` that reads them, its ``cache_dir`` (default ``{data.cache_dir}/{name}``), ``tags`` and
``pack``, mixed by ``train_weights``::

    data:
      tokenizer: gpt2
      cache_dir: cache/
      components:
        web: {source: {type: url, train_urls: [...], validation_urls: [...]}}
        chat: {source: {type: hf, id: org/chats}, format: {type: chat}, cache_dir: caches/chat}
      train_weights: {web: 0.8, chat: 0.2}

This is the mixture our ``configs:`` form writes (each of our sources holds its location, format,
cache directory and tags together), so :func:`translate_components` rewrites one into the other
before validation. The older forms (a source written inline under ``data:``, or ``configs:``)
build the same mixture: a section is read in one form only. An error in a rewritten field names
the field as the file wrote it, and its line.

Levanter's shuffle is now a block shuffle by default (``{io_block_size: 256, window_blocks:
512}``: blocks of sequences permuted within windows of blocks); here the nearest is the era
shuffle over windows of the same number of sequences (``shuffle: io_block_size x
window_blocks``), which a config in this schema gets when it says nothing; and its held-out
sequences (``num_validation_sequences``) are a random subset unless
``shuffle_before_trainval_split: false``.
"""

from __future__ import annotations

from typing import Any

from levanter_core.config.loader import Sources
from levanter_core.config.sft import ProgramTranslation, TranslatedSources

BLOCK_SHUFFLE_DEFAULT = {"io_block_size": 256, "window_blocks": 512}
"""Levanter's default ``data.shuffle`` in its current schema."""

_COMPONENT_FIELDS = {"type", "source", "format", "cache_dir", "tags", "pack", "split"}
_PACKED_FORMATS = {"chat", "supervised"}
"""Formats whose examples are packed whole into rows here (with a target mask), as Levanter
packs them when ``pack`` is left unset."""


def has_components(raw: Any) -> bool:
    """Whether ``raw`` (a config's merged dict) writes its data in Levanter's current form."""
    return isinstance(raw, dict) and isinstance(raw.get("data"), dict) and "components" in raw["data"]


def translate_components(raw: dict, sources: Sources) -> tuple[dict, Sources]:
    """``raw`` with ``data.components`` rewritten as ``data.configs`` (see the module docstring),
    and sources that report a rewritten field where the file wrote it. Raises
    :class:`~levanter_core.errors.ConfigError` naming the component for what has no meaning here."""
    return _Components(raw, sources).run()


class _Components(ProgramTranslation):
    program = "train_lm, current schema"

    def run(self) -> tuple[dict, Sources]:
        data = dict(self.raw["data"])
        components = data.pop("components")
        if not isinstance(components, dict) or not components:
            self.fail(("data", "components"), "expected a mapping of named components (name: {source, format, ...})")
        for older in ("configs", "train_urls", "validation_urls", "id"):
            if older in data:
                self.fail(
                    ("data", older),
                    f"data.components and data.{older} both say where the data is; write the sources in one form "
                    "(components, or the older configs / inline source)",
                )
        data["configs"] = {str(name): self.component(str(name), section) for name, section in components.items()}
        shuffle = data.get("shuffle", BLOCK_SHUFFLE_DEFAULT)
        data["shuffle"] = self.shuffle(shuffle)
        data.setdefault("shuffle_before_trainval_split", True)  # Levanter's current default
        written = dict(self.sources.written) if isinstance(self.sources, TranslatedSources) else {}
        written.update(self.written)
        places = TranslatedSources(self.sources.main_file, self.sources.places, written)
        return {**self.raw, "data": data}, places

    def component(self, name: str, section: Any) -> dict:
        at = ("data", "components", name)
        if not isinstance(section, dict):
            self.fail(at, f"expected a component section (source, format, cache_dir, tags), got {section!r}")
        unknown = sorted(set(section) - _COMPONENT_FIELDS)
        if unknown:
            self.fail(
                (*at, unknown[0]),
                f"not a field of a data component (it has {', '.join(sorted(_COMPONENT_FIELDS - {'type'}))})",
            )
        kind = section.get("type", "cached")
        if kind != "cached":
            self.fail(
                (*at, "type"),
                f"component type {kind!r} is not available: only cached components (read from a source into a "
                "cache) are, the default",
            )
        source = section.get("source")
        if source is None:
            self.fail(
                (*at, "source"),
                "a component without a source reads a cache Levanter built; Levanter's caches are not read here: "
                "give the source (type: url with train_urls / validation_urls, or type: hf with id)",
            )
        if not isinstance(source, dict):
            self.fail((*at, "source"), f"expected a source section (type: url or hf, ...), got {source!r}")
        ours: dict[str, Any] = {}
        for key, value in source.items():
            if key in ("format", "cache_dir", "tags") and key in section:
                continue  # the component's own wins, as in Levanter
            ours[key] = value
            self.written[("data", "configs", name, key)] = (*at, "source", key)
        ours.setdefault("type", "url")
        for key in ("format", "cache_dir", "tags"):
            if key in section:
                ours[key] = section[key]
                self.written[("data", "configs", name, key)] = (*at, key)
        if isinstance(ours.get("format"), dict) and ours["format"].get("type") == "preference_chat":
            ours["format"] = self.preference_chat(name, ours["format"])
        elif isinstance(ours.get("format"), dict) and ours["format"].get("type") == "chat":
            ours["format"] = self.chat(name, ours["format"])
        self.check_pack(name, section.get("pack"), ours.get("format"))
        self.written.setdefault(("data", "configs", name), at)
        return ours

    def chat(self, name: str, fmt: dict) -> dict:
        """Levanter's ``chat`` format: ours, less the settings it has no use for. Conversations
        are packed whole here (Levanter's default, ``pack`` unset or true)."""
        at = ("data", "components", name, "format")
        fmt = dict(fmt)
        pack = fmt.pop("pack", None)
        if pack not in (None, True):
            self.fail((*at, "pack"), "chat examples are packed whole here (pack: true, the default); remove pack")
        if fmt.pop("system_prompt", None) is not None:
            self.fail((*at, "system_prompt"), "a system prompt taken from a record's field is not available; remove it")
        if fmt.pop("chat_template_kwargs", "chat_template_kwargs") != "chat_template_kwargs":
            self.fail((*at, "chat_template_kwargs"), "template arguments from a record's field are not available")
        return fmt

    def preference_chat(self, name: str, fmt: dict) -> dict:
        """Levanter's ``preference_chat`` format (a chosen and a rejected conversation per
        record) as the ``preference`` format of levanter-preference, which scores the assistant
        messages where the two conversations part, as Levanter's ``mask_user_turns`` does."""
        at = ("data", "components", name, "format")
        known = {
            "type", "chosen_field", "rejected_field", "chat_template", "system_prompt", "chat_template_kwargs",
            "pack", "mask_user_turns", "slice_strategy",
        }  # fmt: skip
        unknown = sorted(set(fmt) - known)
        if unknown:
            self.fail((*at, unknown[0]), "not a field of the preference_chat format")
        refused = {
            "system_prompt": (None, "a system prompt taken from a record's field is not available; remove it"),
            "chat_template_kwargs": (
                "chat_template_kwargs",
                "template arguments from a record's field are not available",
            ),
            "pack": (False, "Packed preference_chat datasets are not supported"),
            "mask_user_turns": (True, "training on the user's turns of a preference pair is not available"),
            "slice_strategy": ("raise", "preference_chat slice_strategy must be 'raise' for now"),
        }
        for key, (allowed, why) in refused.items():
            if key in fmt and fmt[key] != allowed:
                self.fail((*at, key), why)
        ours = {"type": "preference"}
        for theirs, mine in (
            ("chosen_field", "chosen_key"),
            ("rejected_field", "rejected_key"),
            ("chat_template", "chat_template"),
        ):
            if theirs in fmt:
                ours[mine] = fmt[theirs]
                self.written[("data", "configs", name, "format", mine)] = (*at, theirs)
        return ours

    def check_pack(self, name: str, pack: Any, fmt: Any) -> None:
        """``pack`` is accepted where it says what happens here anyway: text joined into one
        stream (unset or false), examples of chat-like formats packed whole (unset or true)."""
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else "text"
        if pack is None:
            return
        if kind == "preference" and pack is not False:
            self.fail(("data", "components", name, "pack"), "Packed preference_chat datasets are not supported")
        packed = kind in _PACKED_FORMATS
        if pack is packed:
            return
        what = (
            "packing whole text documents into rows (with segment ids)"
            if not packed
            else f"{kind} examples not packed, or packed at most N to a row"
        )
        self.fail(
            ("data", "components", name, "pack"),
            f"{what} is not available: {kind} data is {'packed whole' if packed else 'joined into one stream'} "
            "here; remove pack",
        )

    def shuffle(self, value: Any) -> Any:
        """Levanter's block shuffle as the era shuffle over as many sequences; booleans as they are."""
        if not isinstance(value, dict):
            return value
        at = ("data", "shuffle")
        unknown = sorted(set(value) - {"io_block_size", "window_blocks", "perm_type"})
        if unknown:
            self.fail((*at, unknown[0]), "not a field of a block shuffle (io_block_size, window_blocks, perm_type)")
        block, window = value.get("io_block_size"), value.get("window_blocks")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (block, window)):
            self.fail(at, f"io_block_size and window_blocks must be positive integers, got {value!r}")
        self.written[at] = at
        return int(block) * int(window)  # type: ignore[arg-type]  # checked just above


# -- Levanter's train_dpo, lora_dpo and train_simpo programs -------------------------------------

DPO_FIELDS = {
    "beta", "reference", "adapter", "validation_split_fraction", "reference_eval_cache", "lm_validation_data",
    "lm_validation_prefix", "scheduled_eval_steps", "run_initial_eval", "hf_generation_eos_token_ids",
    "reference_model_path", "reference_is_hf", "gamma_beta_ratio",
}  # fmt: skip
"""Top-level fields of Levanter's preference programs that a training config does not have."""

DPO_VALIDATION_SPLIT = 0.1
"""``validation_split_fraction`` of Levanter's DPO and SimPO programs when a config leaves it out."""


def is_preference_program(raw: Any) -> bool:
    """Whether ``raw`` is written for Levanter's ``train_dpo``, ``lora_dpo`` or ``train_simpo``:
    it has one of their own top-level fields and no ``objective`` section of ours."""
    return isinstance(raw, dict) and "objective" not in raw and bool(DPO_FIELDS & set(raw))


def translate_preference_program(raw: dict, sources: Sources) -> tuple[dict, Sources]:
    """``raw`` (see :func:`is_preference_program`) as a training config with a ``dpo`` (or
    ``simpo``) objective: ``beta``, the reference model, the LoRA adapter and the held-out split
    become the objective, ``lora`` and ``data.validation_split_fraction``. Raises
    :class:`~levanter_core.errors.ConfigError` naming the field for what has no meaning here."""
    return _Preference(raw, sources).run()


class _Preference(ProgramTranslation):
    def run(self) -> tuple[dict, Sources]:
        raw = dict(self.raw)
        simpo = "gamma_beta_ratio" in raw
        self.program = "train_simpo" if simpo else "lora_dpo" if "lora" in raw else "train_dpo"
        for name in ("lm_validation_data", "scheduled_eval_steps", "hf_generation_eos_token_ids"):
            if raw.pop(name, None) is not None:
                self.fail((name,), f"{name} is not available here; remove it (or set it to null)")
        if raw.pop("run_initial_eval", False):
            self.fail(("run_initial_eval",), "an evaluation before the first step is not available; remove it")
        raw.pop("lm_validation_prefix", None)
        self.reference_eval_cache(raw.pop("reference_eval_cache", None))
        objective: dict[str, Any] = {"type": "simpo" if simpo else "dpo"}
        if "beta" in raw:
            objective["beta"] = raw.pop("beta")
            self.written[("objective", "beta")] = ("beta",)
        if simpo:
            objective["gamma_beta_ratio"] = raw.pop("gamma_beta_ratio")
            self.written[("objective", "gamma_beta_ratio")] = ("gamma_beta_ratio",)
        raw["objective"] = objective
        adapter = raw.pop("adapter", None)
        if adapter is not None:
            self.adapter(raw, adapter)
        reference = self.reference(raw)
        if not simpo:
            self.check_reference(raw, reference)
        fraction = raw.pop("validation_split_fraction", DPO_VALIDATION_SPLIT)
        if fraction is not None:
            if not isinstance(raw.get("data"), dict):
                self.fail(("data",), "expected a data section")
            raw["data"] = {**raw["data"], "validation_split_fraction": fraction}
            self.written[("data", "validation_split_fraction")] = ("validation_split_fraction",)
        written = dict(self.sources.written) if isinstance(self.sources, TranslatedSources) else {}
        written.update(self.written)
        return raw, TranslatedSources(self.sources.main_file, self.sources.places, written)

    def reference_eval_cache(self, section: Any) -> None:
        """A cache of the reference model's log-probabilities of the validation pairs: an
        optimization that changes no number, accepted either way."""
        if section is None:
            return
        if not isinstance(section, dict) or section.get("mode", "disabled") not in ("disabled", "build_or_load"):
            self.fail(("reference_eval_cache",), f"expected {{mode: disabled or build_or_load}}, got {section!r}")

    def adapter(self, raw: dict, adapter: Any) -> None:
        """``adapter: {type: lora, ...}`` is a ``lora`` section; ``{type: none}`` nothing."""
        at = ("adapter",)
        if not isinstance(adapter, dict) or adapter.get("type", "none") not in ("none", "lora"):
            self.fail(at, f"expected {{type: none}} or {{type: lora, r, alpha, ...}}, got {adapter!r}")
        if adapter.get("type", "none") == "none":
            return
        if "lora" in raw:
            self.fail(at, "adapter and lora both describe the adapters; keep one")
        lora = {k: v for k, v in adapter.items() if k not in ("type", "zero_init_b", "a_init_mode", "exclude_modules")}
        for key in lora:
            self.written[("lora", key)] = (*at, key)
        excluded = adapter.get("exclude_modules")
        if excluded not in (None, ["lm_head"]):
            self.fail(
                (*at, "exclude_modules"), "only the output head can be left out of the adapters here (the default)"
            )
        zero_b, a_mode = adapter.get("zero_init_b", False), adapter.get("a_init_mode", "zero")
        if bool(zero_b) == (a_mode == "zero"):
            self.fail(
                (*at, "zero_init_b"),
                "adapter.type=lora with reference.type=adapter_base requires zero adapter delta at init with exactly "
                "one zero LoRA factor: set either zero_init_b=true or a_init_mode='zero', but not both",
            )
        raw["lora"] = lora

    def reference(self, raw: dict) -> dict:
        """The ``reference`` section, from the older ``reference_model_path`` / ``reference_is_hf``
        too; ``lora_dpo``'s reference is the adapters' base."""
        old = {k: raw.pop(k) for k in ("reference_model_path", "reference_is_hf") if k in raw}
        section = raw.pop("reference", None)
        if section is not None and old:
            self.fail(("reference",), f"reference and {sorted(old)[0]} both name the reference model; keep reference")
        if old:
            return {
                "type": "separate",
                "model_path": old.get("reference_model_path", ""),
                "is_hf": old.get("reference_is_hf", True),
            }
        if section is None:
            return {"type": "adapter_base"} if "lora" in raw else {"type": "separate", "model_path": "", "is_hf": True}
        if not isinstance(section, dict) or section.get("type", "separate") not in ("separate", "adapter_base"):
            self.fail(
                ("reference",),
                f"expected {{type: separate, model_path, is_hf}} or {{type: adapter_base}}, got {section!r}",
            )
        return {"type": "separate", **section}

    def check_reference(self, raw: dict, reference: dict) -> None:
        """The reference here is the model as training starts (with LoRA: without its adapters),
        kept frozen beside the one trained: Levanter's reference must be that model."""
        if reference["type"] == "adapter_base":
            if raw.get("lora") is None:
                self.fail(("reference", "type"), "reference.type=adapter_base requires a non-none adapter.")
            return
        path = reference.get("model_path", "")
        at = ("reference", "model_path") if "reference" in self.raw else ("reference_model_path",)
        if not path:
            self.fail(at, "reference.model_path must be provided for reference.type=separate.")
        start = (
            raw.get("initialize_from_hf")
            if reference.get("is_hf", True)
            else (raw.get("trainer") or {}).get("initialize_from")
        )
        if start is True:  # the model's own reference checkpoint
            start = (raw.get("model") or {}).get("reference_checkpoint")
        if path != start:
            where = "initialize_from_hf" if reference.get("is_hf", True) else "trainer.initialize_from"
            self.fail(
                at,
                f"the reference model here is the model training starts from ({where}: {start!r}), kept frozen; a "
                f"different reference ({path!r}) is not available yet. Start from {path!r}, or set {where} to it",
            )


# -- Levanter's eval_lm program ----------------------------------------------------------------

EVAL_LM_FIELDS = (
    "checkpoint_path",
    "hf_checkpoint",
    "max_eval_length",
    "eval_on_train",
    "log_top2_gap",
    "log_param_stats",
)
"""Top-level fields of Levanter's ``eval_lm`` config that a training config does not have."""


def translate_eval_program(raw: dict, sources: Sources) -> tuple[dict, str | None, int | None]:
    """Levanter's ``eval_lm`` fields taken out of ``raw`` (a config given to ``levanter eval
    --config``): the rest is a training config whose validation sets are evaluated; also the
    model to evaluate (``checkpoint_path`` or ``hf_checkpoint``, None when the config names
    neither) and the evaluation length (``max_eval_length``, None when not given)."""
    translation = ProgramTranslation(raw, sources)
    translation.program = "eval_lm"
    raw = dict(raw)
    found = {name: raw.pop(name) for name in EVAL_LM_FIELDS if name in raw}
    for name in ("eval_on_train", "log_top2_gap", "log_param_stats"):
        if found.get(name):
            translation.fail((name,), f"{name} is not available in levanter eval; remove it (or set it to false)")
    given = [name for name in ("checkpoint_path", "hf_checkpoint") if found.get(name)]
    if len(given) == 2:
        translation.fail(("hf_checkpoint",), "Must specify either checkpoint_path or hf_checkpoint, not both")
    source = found[given[0]] if given else None
    length = found.get("max_eval_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        translation.fail(("max_eval_length",), f"expected a positive number of tokens, got {length!r}")
    return raw, source, length
