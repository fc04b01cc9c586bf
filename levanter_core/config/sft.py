"""Supervised fine-tuning: the ``special_tokens`` section, and Levanter's ``sft`` and
``sft_mixture`` configs read as training configs.

Levanter fine-tunes with two programs of their own (``levanter.main.sft`` and
``sft_mixture``) whose configs name the data, tokenizer and starting model at the top level
(``supervised_data``, ``chat_train_urls``, ``tokenizer``, ``model_name_or_path``,
``max_seq_len``...). Here ``levanter train`` runs them: :func:`translate_levanter_sft`
rewrites such a config, before validation, into the sections a training config has (a
``data`` section with the ``chat`` or ``supervised`` format, ``initialize_from_hf`` with
``use_hf_model_config``, ``special_tokens``), and an error in a rewritten field still names the
field as the file wrote it, and its line.

What each Levanter field becomes (``docs/sft.md`` has the whole table):

* ``dataset_type: chat_jsonl`` (Levanter's default): JSON lines of conversations
  (``messages_field``), rendered with the tokenizer's chat template and trained on the
  assistant turns; ``huggingface``: input/output pairs (``input_field``, ``output_field``) from
  URLs or a Hugging Face dataset (``id``), trained on the output.
* ``supervised_data``: one source (``cache_dir``, with ``chat_train_urls`` for chat data), or
  named sources mixed by ``mixture_weights`` (``mixture_block_size``, ``stop_strategy``).
* ``initialize_from_hf: true``: the weights and architecture of ``model_name_or_path`` (a
  string: of that path), with ``max_seq_len`` as the sequence length.
* Levanter adds a pad, end-of-text, beginning-of-text and unknown token (``[PAD]``, ``</s>``,
  ``<s>``, ``<unk>``) to a tokenizer that lacks them, and grows the model to the tokenizer's
  size with the new embedding and output rows set to the mean of the existing rows:
  ``special_tokens.add_missing_defaults``. ``reinit_tokens`` and its two switches become
  ``special_tokens.reinit_tokens``...
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import field_validator

from levanter_core.config.base import ConfigModel
from levanter_core.config.loader import Sources
from levanter_core.errors import ConfigError
from levanter_core.models.lm import LmConfig

LLAMA3_CHAT_TOKENS = (
    "<|finetune_right_pad_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
)
"""The tokens ``reinit_tokens: true`` re-draws: Llama 3's chat markup, as in Levanter."""


class SpecialTokensConfig(ConfigModel):
    """Special tokens to add to the tokenizer for fine-tuning (chat markup, a pad token), and
    how the embedding and output rows of tokens start. Added tokens get the ids after the
    tokenizer's last (roles first, in the order pad, eos, bos, unk; then
    ``additional_special_tokens``); a model started from ``initialize_from_hf`` grows to the
    tokenizer's size, each new row the mean of the existing rows, as Levanter's ``sft`` does.
    The grown tokenizer is what the data is tokenized with and what every Hugging Face export
    writes (its ``tokenizer_config.json`` naming the roles)."""

    pad_token: str | None = None
    """The padding token; added to the vocabulary if missing. None: the tokenizer's own."""
    eos_token: str | None = None
    """The end-of-text token (a chat model's end of turn, say ``<|im_end|>``: generation stops
    there); added if missing. None: the tokenizer's own."""
    bos_token: str | None = None
    """The beginning-of-text token; added if missing. None: the tokenizer's own."""
    unk_token: str | None = None
    """The unknown token; added if missing. None: the tokenizer's own."""
    additional_special_tokens: tuple[str, ...] = ()
    """More special tokens to add (the markup of a chat template, such as ``<|im_start|>`` and
    ``<|im_end|>``): each is matched whole in text, never split, and gets a new id unless the
    vocabulary has it."""
    add_missing_defaults: bool = False
    """Give a tokenizer that lacks a pad, end-of-text, beginning-of-text or unknown token
    Levanter's defaults for them (``[PAD]``, ``</s>``, ``<s>``, ``<unk>``), as Levanter's ``sft``
    and ``sft_mixture`` do; on in the configs of those programs."""

    reinit_tokens: bool | tuple[str, ...] = False
    """Tokens (of the grown vocabulary) whose rows are drawn afresh when the run starts from
    ``initialize_from_hf``: from a normal distribution cut at 3 standard deviations, with the mean
    and spread of the whole matrix (Levanter's ``reinit_tokens``, for chat tokens a base model
    never saw). ``true``: Llama 3's chat tokens (``<|start_header_id|>``, ``<|eot_id|>``...)."""
    reinit_embeddings: bool = True
    """With ``reinit_tokens``: re-draw their input embeddings (tied weights count as these)."""
    reinit_lm_head: bool = True
    """With ``reinit_tokens``: re-draw their rows of an untied output head."""

    @field_validator("additional_special_tokens", "reinit_tokens")
    @classmethod
    def _no_empty_tokens(cls, value):
        if isinstance(value, tuple) and any(not t for t in value):
            raise ValueError("a token cannot be the empty string")
        return value

    def recipe(self) -> dict:
        """What is added to the tokenizer (see :func:`levanter_core.data.tokenizer.tokenizer_spec_with`)."""
        found: dict[str, Any] = {}
        for role in ("pad_token", "eos_token", "bos_token", "unk_token"):
            if getattr(self, role):
                found[role] = getattr(self, role)
        if self.additional_special_tokens:
            found["additional_special_tokens"] = list(self.additional_special_tokens)
        if self.add_missing_defaults:
            found["add_missing_defaults"] = True
        return found

    def tokens_to_reinit(self) -> tuple[str, ...]:
        if self.reinit_tokens is True:
            return LLAMA3_CHAT_TOKENS
        return self.reinit_tokens or ()


# -- Levanter's sft and sft_mixture configs ----------------------------------------------------

SFT_FIELDS = {
    # Levanter's SFTConfig / SFTMixtureConfig fields that a training config does not have
    "supervised_data", "dataset_type", "chat_train_urls", "messages_field", "input_role", "output_role",
    "mixture_weights", "mixture_block_size", "stop_strategy", "max_seq_len", "model_name_or_path",
    "tokenizer", "reinit_tokens", "reinit_lm_head", "reinit_embeddings",
    # older SFT examples (their trust_remote_code is a training config's field too)
    "max_tune_length", "model_cache_dir",
}  # fmt: skip
"""Top-level keys that mark a config as one of Levanter's SFT programs'."""

_DEFAULT_MODEL = {"sft": "NousResearch/Llama-2-7b-hf", "sft_mixture": "marin-community/marin-8b-base"}
"""``model_name_or_path`` and ``tokenizer`` when a config gives neither (each program's default)."""

_CHAT_SOURCE_KEYS = ("cache_dir", "train_urls", "validation_urls", "tags")
_SUPERVISED_SOURCE_KEYS = (
    "cache_dir", "train_urls", "validation_urls", "input_field", "output_field", "tags",
    "id", "name", "streaming", "hf_dataset_name", "hf_dataset_split",
)  # fmt: skip


@dataclasses.dataclass
class TranslatedSources(Sources):
    """The places of a rewritten config: a field the rewrite moved is reported as the field the
    file wrote, with its line (``data.train_urls (chat_train_urls at sft.yaml:3)``)."""

    written: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    """Our path -> the path the file wrote it at."""

    def place_of(self, path: tuple) -> str:
        path = tuple(path)
        for end in range(len(path), 0, -1):
            theirs = self.written.get(path[:end])
            if theirs is not None:
                theirs = theirs + path[end:]
                return f"{'.'.join(map(str, theirs))} at {super().place_of(theirs)}"
        return super().place_of(path)


def is_levanter_sft(raw: dict) -> bool:
    """Whether ``raw`` is written for Levanter's ``sft`` or ``sft_mixture``: it has one of their
    own top-level fields (and no ``data`` section, which they do not have)."""
    return isinstance(raw, dict) and "data" not in raw and bool(SFT_FIELDS & set(raw))


def translate_levanter_sft(raw: dict, sources: Sources) -> tuple[dict, TranslatedSources]:
    """``raw`` (one of Levanter's SFT configs, see :func:`is_levanter_sft`) as a training config,
    and where each of its fields was written. Raises :class:`ConfigError` naming the field and
    its line for what has no meaning here."""
    return _Translation(raw, sources).run()


class ProgramTranslation:
    """A Levanter program's config (``raw``) being rewritten into a training config: where each
    moved field was written (:attr:`written`, for :class:`TranslatedSources`), and the error for
    a field that has no meaning here, naming the program, the field and its line."""

    program: str = "train_lm"

    def __init__(self, raw: dict, sources: Sources):
        self.raw, self.sources = raw, sources
        self.written: dict[tuple, tuple] = {}

    def fail(self, path: tuple, message: str):
        dotted = ".".join(map(str, path))
        raise ConfigError(
            f"invalid config {self.sources.main_file} (Levanter's {self.program}):\n"
            f"  {dotted} ({self.sources.place_of(path)}): {message}"
        )


class _Translation(ProgramTranslation):
    def __init__(self, raw: dict, sources: Sources):
        super().__init__(raw, sources)
        self.program = "sft_mixture" if "mixture_weights" in raw else "sft"

    def move(self, ours: tuple, theirs: tuple) -> None:
        self.written[ours] = theirs

    def run(self) -> tuple[dict, TranslatedSources]:
        raw = dict(self.raw)
        passed = {k: v for k, v in raw.items() if k not in SFT_FIELDS}  # trainer, optimizer, hf_save_path...
        out: dict[str, Any] = {**passed, "data": self.data()}
        out["model"] = self.model(out)
        if raw.get("model_cache_dir") is not None:
            self.fail(("model_cache_dir",), "Levanter's older SFT option is not supported; only null is accepted")
        if out.get("hf_upload") is False:  # the older examples write false for "no upload"
            out["hf_upload"] = None
        if out.get("hf_save_steps") == 0:  # Levanter's default: export only at the end
            del out["hf_save_steps"]
        out["special_tokens"] = self.special_tokens(passed.get("special_tokens"))
        translated = TranslatedSources(self.sources.main_file, dict(self.sources.places), self.written)
        return out, translated

    # -- model and initialization ----------------------------------------------------------

    def model(self, out: dict) -> dict:
        raw = self.raw
        model = dict(raw.get("model") or {"type": "llama"})  # Levanter's default model: a LlamaConfig
        if "model" not in raw:
            self.move(("model",), ("model_name_or_path",) if "model_name_or_path" in raw else ())
        length_key = "max_seq_len" if "max_seq_len" in raw else "max_tune_length" if "max_tune_length" in raw else None
        source = raw.get("model_name_or_path", _DEFAULT_MODEL[self.program])
        init = raw.get("initialize_from_hf", None)
        if init is None and "model_name_or_path" in raw and not (raw.get("trainer") or {}).get("initialize_from"):
            init = True  # the older examples start from model_name_or_path without saying so
        if init:
            # Levanter takes the architecture from the checkpoint's config.json, with max_seq_len:
            # of the model section only the type and how to run it (its run settings) are kept
            model = {k: v for k, v in model.items() if k == "type" or k in LmConfig.run_settings}
            out["initialize_from_hf"] = source if init is True else init
            out["use_hf_model_config"] = True
            where = ("initialize_from_hf",) if "initialize_from_hf" in raw else ("model_name_or_path",)
            self.move(("initialize_from_hf",), where)
            model["seq_len"] = raw.get(length_key, 2048) if length_key else 2048
            self.move(("model", "seq_len"), (length_key,) if length_key else ("model",))
        else:
            out.pop("initialize_from_hf", None)
            if not (raw.get("trainer") or {}).get("initialize_from"):
                self.fail(
                    ("initialize_from_hf",),
                    "fine-tuning starts from a trained model: set initialize_from_hf (true: model_name_or_path) "
                    "or trainer.initialize_from, as Levanter's sft requires",
                )
            if "seq_len" not in model and length_key:
                model["seq_len"] = raw[length_key]
                self.move(("model", "seq_len"), (length_key,))
        return model

    def special_tokens(self, given: Any) -> dict:
        raw = self.raw
        section = dict(given) if isinstance(given, dict) else {}
        section.setdefault("add_missing_defaults", True)
        for key in ("reinit_tokens", "reinit_lm_head", "reinit_embeddings"):
            if key in raw:
                section[key] = raw[key]
                self.move(("special_tokens", key), (key,))
        return section

    # -- data --------------------------------------------------------------------------------

    def data(self) -> dict:
        raw = self.raw
        if "supervised_data" not in raw:
            self.fail(
                ("supervised_data",), "this field is required: the data to fine-tune on (cache_dir, and its URLs)"
            )
        supervised = raw["supervised_data"]
        if not isinstance(supervised, dict):
            self.fail(("supervised_data",), f"expected a source (cache_dir, ...) or named sources, got {supervised!r}")
        kind = self.dataset_type(supervised)
        output_role = raw.get("output_role", "assistant")
        if kind == "chat_jsonl" and output_role != "assistant":
            self.fail(
                ("output_role",),
                f"the chat template's assistant turns are the targets here; only 'assistant' is accepted (got {output_role!r})",
            )
        data: dict[str, Any] = {"tokenizer": raw.get("tokenizer", _DEFAULT_MODEL[self.program]), "shuffle": True}
        self.move(("data", "tokenizer"), ("tokenizer",))
        self.move(("data",), ("supervised_data",))
        named = all(isinstance(v, dict) for v in supervised.values()) and bool(supervised)
        single_chat = kind == "chat_jsonl" and "chat_train_urls" in raw and "mixture_weights" not in raw
        if named and not single_chat:
            return {**data, **self.mixture(supervised, kind)}
        for key in ("mixture_weights", "mixture_block_size", "stop_strategy"):
            if key in raw:
                self.fail((key,), "mixes named sources: write supervised_data as {name: {cache_dir, train_urls}}")
        first = next(iter(supervised.values())) if named else supervised  # Levanter's sft takes the first's cache
        prefix = ("supervised_data", next(iter(supervised))) if named else ("supervised_data",)
        data.update(self.source(first, kind, prefix, ("data",)))
        if kind == "chat_jsonl":
            urls = raw.get("chat_train_urls")
            if urls is not None:
                data["train_urls"] = urls
                self.move(("data", "train_urls"), ("chat_train_urls",))
            elif "train_urls" not in data:
                self.fail(
                    ("chat_train_urls",),
                    "this field is required with dataset_type chat_jsonl: the JSON lines of conversations",
                )
        return data

    def dataset_type(self, supervised: dict) -> str:
        raw = self.raw
        kind = raw.get("dataset_type")
        if kind is None:
            # Levanter's default is chat_jsonl; its older examples give input/output pairs without saying so
            sections = (
                list(supervised.values()) if all(isinstance(v, dict) for v in supervised.values()) else [supervised]
            )
            pairs = any(k in s for s in sections for k in ("input_field", "output_field", "id", "hf_dataset_name"))
            kind = "huggingface" if pairs and "chat_train_urls" not in raw else "chat_jsonl"
        if kind not in ("chat_jsonl", "huggingface"):
            self.fail(("dataset_type",), f"expected chat_jsonl or huggingface, got {kind!r}")
        return kind

    def mixture(self, supervised: dict, kind: str) -> dict:
        raw = self.raw
        if "chat_train_urls" in raw:
            self.fail(
                ("chat_train_urls",), "a mixture's sources give their own train_urls under supervised_data.<name>"
            )
        configs = {}
        for name, section in supervised.items():
            configs[name] = self.source(section, kind, ("supervised_data", name), ("data", "configs", name))
        data: dict[str, Any] = {"configs": configs, "cache_dir": None}
        for ours, theirs in (("train_weights", "mixture_weights"), ("mixture_block_size", "mixture_block_size"),
                             ("stop_strategy", "stop_strategy")):  # fmt: skip
            if theirs in raw:
                data[ours] = raw[theirs]
                self.move(("data", ours), (theirs,))
        return data

    def source(self, section: dict, kind: str, theirs: tuple, ours: tuple) -> dict:
        """One Levanter source section as one of our data sources."""
        known = _CHAT_SOURCE_KEYS if kind == "chat_jsonl" else _SUPERVISED_SOURCE_KEYS
        for key in section:
            if key not in known:
                self.fail(
                    theirs + (key,), f"unknown field {key!r} of a {kind} source; known fields here: {', '.join(known)}"
                )
        out: dict[str, Any] = {}

        def take(key, as_key=None, default=None):
            if key in section:
                out[as_key or key] = section[key]
                self.move(ours + (as_key or key,), theirs + (key,))
            elif default is not None:
                out[as_key or key] = default

        take("cache_dir")
        take("tags")
        if kind == "chat_jsonl":
            out["type"] = "url"
            take("train_urls")
            take("validation_urls")
            out["format"] = {"type": "chat", "messages_field": self.raw.get("messages_field", "messages")}
            self.move(ours + ("format", "messages_field"), ("messages_field",))
            return out
        fmt = {"type": "supervised", "input_field": section.get("input_field", "prompt"),
               "output_field": section.get("output_field", "response")}  # fmt: skip
        for key in ("input_field", "output_field"):
            if key in section:
                self.move(ours + ("format", key), theirs + (key,))
        out["format"] = fmt
        hub = "id" if "id" in section else "hf_dataset_name" if "hf_dataset_name" in section else None
        if hub is None:
            out["type"] = "url"
            take("train_urls")
            take("validation_urls")
            return out
        out["type"] = "hf"
        self.move(ours + ("type",), theirs + (hub,))
        take(hub, "id")
        if hub == "id":  # the older examples' `name` is a label, not the dataset's configuration
            take("name")
        take("hf_dataset_split", "train_split")
        out["validation_split"] = None  # Levanter's sft trains only
        out["stream"] = section.get("streaming", True)
        if "streaming" in section:
            self.move(ours + ("stream",), theirs + ("streaming",))
        if section.get("validation_urls"):
            self.fail(theirs + ("validation_urls",), "a Hugging Face dataset source takes no validation_urls")
        return out
