"""Levanter's instruction-tuning example programs, ``alpaca``, ``alpaca_lora`` and
``gsm8k_lora``, their configs read as training configs.

Levanter ships these programs beside their configs (``examples/alpaca/alpaca.py``,
``examples/alpaca-lora/alpaca_lora.py``, ``examples/gsm8k-lora/gsm8k_lora.py``). Their configs
name the data, the starting model and the prompts at the top level (``data`` as a string,
``data_cache_dir``, ``prompts``, ``model_name_or_path``, ``max_tune_length``...). Here ``levanter
train`` runs them: :func:`translate_levanter_example` rewrites such a config, before validation,
into the sections a training config has, and an error in a rewritten field still names the field
as the file wrote it, and its line (as :mod:`levanter_core.config.sft` does for Levanter's
``sft``).

What the programs do, and what it becomes (``docs/sft.md`` has the table):

* ``alpaca``: full fine-tuning of ``model_name_or_path`` on instruction / input / output records
  (a Hugging Face dataset, default ``tatsu-lab/alpaca``, or a ``.json`` / ``.jsonl`` file), each
  prompt made from Stanford Alpaca's templates (``prompts``), trained on the output and the
  end-of-text token; Levanter's default special tokens are added to the tokenizer and the model
  grows to fit. A ``supervised`` data source with ``prompt_input`` / ``prompt_no_input``,
  ``initialize_from_hf`` with ``use_hf_model_config``, ``special_tokens.add_missing_defaults``.
* ``alpaca_lora``: the same with low-rank adapters (``lora``, default Levanter's defaults); the
  tokenizer cannot grow, so its missing pad, end and beginning tokens become its unknown token;
  ``hf_save_path`` writes PEFT adapters (``peft_save_path``), ``merged_hf_save_path`` merged
  models (``hf_save_path``).
* ``gsm8k_lora``: LoRA on GSM8K (``gsm8k``, configuration ``main``): the prompt ``Q: {question}\\nA: ``,
  the answer with ``####`` written out as ``The answer is``, on one line, ending in ``.`` and a
  newline; the model from ``model`` (its ``reference_checkpoint``, default the family's).

A config is one of these when it has none of ``sft``'s own fields and gives ``data`` as a string,
or one of ``prompts``, ``data_cache_dir``, ``mask_inputs``, ``input_key``, ``output_key``, or only
``model_name_or_path`` (no ``data`` and no ``initialize_from_hf``). Which program: ``gsm8k_lora``
with a ``model`` section, ``data_seed``, ``input_key`` or ``output_key``, or ``data: gsm8k``; else
``alpaca_lora`` with a ``lora`` section, ``merged_hf_save_path`` or ``merged_hf_upload``, or when
the file's name has the word ``lora`` or it is in a folder ``alpaca-lora`` (Levanter keeps each
program's configs beside it, and only the program tells ``alpaca-lora.yaml`` from
``alpaca.yaml``); else ``alpaca``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from huggingface_hub import try_to_load_from_cache

from levanter_core import fileio
from levanter_core.config.loader import Sources
from levanter_core.config.sft import SFT_FIELDS, ProgramTranslation, TranslatedSources
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import LevanterError
from levanter_core.hf.bridge import config_from_hf, read_hf_config
from levanter_core.models.lm import LmConfig
from levanter_core.plugins import registry

ALPACA_PROMPTS = {
    "prompt_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    ),
    "prompt_no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
}
"""Stanford Alpaca's prompts: what ``alpaca`` and ``alpaca_lora`` use without ``prompts``."""

GSM8K_ANSWER_REPLACEMENTS = (("####", "The answer is"), ("\n", " "))
"""How ``gsm8k_lora`` rewrites an answer (as HELM does): the final-answer marker in words, one line."""

PROGRAMS = ("alpaca", "alpaca_lora", "gsm8k_lora")

_ALPACA_FIELDS = {
    "max_tune_length", "data", "data_cache_dir", "prompts", "mask_inputs", "model_name_or_path",
    "model_cache_dir", "hf_save_path", "hf_upload", "hf_save_steps",
}  # fmt: skip
_FIELDS = {
    # each program's own fields that a training config does not have, or has with another meaning
    "alpaca": _ALPACA_FIELDS | {"lora"},  # (a `lora: null` is how a LoRA-named file says "full")
    "alpaca_lora": _ALPACA_FIELDS | {"lora", "merged_hf_save_path", "merged_hf_upload"},
    "gsm8k_lora": (_ALPACA_FIELDS - {"prompts"})
    | {"model", "input_key", "output_key", "merged_hf_save_path", "merged_hf_upload"},
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    # the programs' TrainArgs defaults
    "alpaca": {"data": "tatsu-lab/alpaca", "hf_save_path": "alpaca_hf_ckpts"},
    "alpaca_lora": {"data": "tatsu-lab/alpaca", "hf_save_path": "alpaca_hf_ckpts"},
    "gsm8k_lora": {"data": "gsm8k", "hf_save_path": None},
}
_DEFAULT_MODEL = "NousResearch/Llama-2-7b-hf"
_DEFAULT_LENGTH = 2048

_SFT_ONLY = SFT_FIELDS - {"model_name_or_path", "max_tune_length", "model_cache_dir"}
_MARKERS = {"prompts", "data_cache_dir", "mask_inputs", "input_key", "output_key"}
_GSM8K_MARKERS = ("model", "data_seed", "input_key", "output_key")
_LORA_MARKERS = ("merged_hf_save_path", "merged_hf_upload")


def is_levanter_example(raw: Any) -> bool:
    """Whether ``raw`` is written for Levanter's ``alpaca``, ``alpaca_lora`` or ``gsm8k_lora``
    (see the module's docstring). Never true of a training config: its ``data`` is a section, and
    it has none of these programs' own fields."""
    if not isinstance(raw, dict) or _SFT_ONLY & set(raw):
        return False
    if isinstance(raw.get("data"), str) or _MARKERS & set(raw):
        return True
    return "data" not in raw and "model_name_or_path" in raw and "initialize_from_hf" not in raw


def translate_levanter_example(raw: dict, sources: Sources) -> tuple[dict, TranslatedSources]:
    """``raw`` (see :func:`is_levanter_example`) as a training config, and where each of its
    fields was written. Raises :class:`ConfigError` naming the field and its line for what has
    no meaning here."""
    return _Translation(raw, sources).run()


def _named_for_lora(path: str) -> bool:
    """Whether the file's name has the word ``lora`` (``code-alpaca-lora.yaml``), or it is in
    Levanter's ``alpaca-lora`` folder."""
    folder, name = os.path.split(os.path.abspath(path))
    return "lora" in re.split(r"[^a-z0-9]+", name.lower()) or os.path.basename(folder) == "alpaca-lora"


class _Translation(ProgramTranslation):
    def __init__(self, raw: dict, sources: Sources):
        super().__init__(raw, sources)
        self.program = "alpaca"  # (for messages until the program is known)
        self.program = self.which_program()

    def move(self, ours: tuple, theirs: tuple) -> None:
        """Errors in ``ours`` name ``theirs``, where the file wrote it (if it did)."""
        if theirs and theirs[0] in self.raw:
            self.written[ours] = theirs

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, _DEFAULTS[self.program].get(key, default))

    def which_program(self) -> str:
        raw = self.raw
        gsm8k = [key for key in _GSM8K_MARKERS if key in raw]
        if gsm8k or raw.get("data") == "gsm8k":
            if "prompts" in raw:
                why = f"{gsm8k[0]} is a field of" if gsm8k else "data: gsm8k is"
                self.fail(
                    ("prompts",), f"a field of Levanter's alpaca programs, but {why} gsm8k_lora, whose prompt is fixed"
                )
            return "gsm8k_lora"
        if "lora" in raw:
            return "alpaca" if raw["lora"] is None else "alpaca_lora"
        if any(key in raw for key in _LORA_MARKERS) or _named_for_lora(self.sources.main_file):
            return "alpaca_lora"
        return "alpaca"

    def run(self) -> tuple[dict, TranslatedSources]:
        raw, program = self.raw, self.program
        out: dict[str, Any] = {k: v for k, v in raw.items() if k not in _FIELDS[program]}  # trainer, optimizer...
        if raw.get("model_cache_dir") is not None:
            self.fail(("model_cache_dir",), "a cache directory for the model is not supported; only null is accepted")
        source = self.source_model()
        hf_config = _local_hf_config(source) if isinstance(source, str) else None
        out["model"] = self.model(hf_config)
        out["initialize_from_hf"] = True if program == "gsm8k_lora" else source
        out["use_hf_model_config"] = True
        self.move(
            ("initialize_from_hf",),
            ("model", "reference_checkpoint") if program == "gsm8k_lora" else ("model_name_or_path",),
        )
        out["data"] = self.data(source)
        out["special_tokens"] = {**self.special_tokens(source), **(raw.get("special_tokens") or {})}
        self.exports(out)
        if program != "alpaca":
            out["lora"] = raw.get("lora") or {}  # Levanter's LoraConfig() when the file leaves it out
        translated = TranslatedSources(self.sources.main_file, dict(self.sources.places), self.written)
        return out, translated

    # -- the model -------------------------------------------------------------------------------

    def source_model(self) -> Any:
        """What the weights and the tokenizer are read from."""
        if self.program != "gsm8k_lora":
            source = self.get("model_name_or_path", _DEFAULT_MODEL)
            if not isinstance(source, str) or not source:
                self.fail(
                    ("model_name_or_path",), f"expected a Hugging Face model directory or hub name, got {source!r}"
                )
            return source
        # gsm8k_lora loads model.reference_checkpoint (the family's default), whatever model_name_or_path says
        model = self.gsm8k_model_section()
        if model.get("reference_checkpoint"):
            return model["reference_checkpoint"]
        models = registry("model")
        kind = model["type"]
        if kind not in models:
            choices = ", ".join(f"{e.name} ({e.provider})" for e in models) or "none"
            self.fail(("model", "type"), f"unknown model type {kind!r}; installed: {choices}")
        return models.get(kind).config_cls.default_hf_checkpoint

    def gsm8k_model_section(self) -> dict:
        model = self.raw.get("model")
        if model is None:
            return {"type": "llama"}  # gsm8k_lora's default: a LlamaConfig
        if not isinstance(model, dict):
            self.fail(("model",), f"expected a model section (type: llama, ...), got {model!r}")
        return {"type": "llama", **model}

    def model(self, hf_config: dict | None) -> dict:
        """The model section: the architecture is the checkpoint's ``config.json`` (at run time,
        ``use_hf_model_config``); this keeps the type, the training length and how to run it."""
        ours = _our_model(hf_config)
        if self.program == "gsm8k_lora":
            given = self.gsm8k_model_section()
            model = {k: v for k, v in given.items() if (k == "type" or k in LmConfig.run_settings) and k != "seq_len"}
        else:
            model = {
                "type": ours.type if ours is not None else "llama"
            }  # (an unread checkpoint: llama's, Levanter's default)
            self.move(("model",), ("model_name_or_path",))
        if "max_tune_length" in self.raw or self.program != "alpaca_lora":
            model["seq_len"] = self.raw.get("max_tune_length", _DEFAULT_LENGTH)
            self.move(("model", "seq_len"), ("max_tune_length",))
        else:
            # alpaca_lora trains on sequences of the model's own context length
            model["seq_len"] = ours.seq_len if ours is not None else _DEFAULT_LENGTH
        return model

    def special_tokens(self, source: Any) -> dict:
        if self.program == "alpaca":
            self.move(("special_tokens",), ("model_name_or_path",))
            return {"add_missing_defaults": True}  # [PAD], </s>, <s>, <unk> where missing; the model grows
        if self.program == "gsm8k_lora" or not isinstance(source, str):
            return {}
        tokenizer = _local_tokenizer(source)
        if tokenizer is None:
            return {}  # not readable without the network: the tokenizer's roles as they are
        named = tokenizer.named_special_tokens()
        unk = named.get("unk_token")
        if unk is None or tokenizer.token_id(unk) is None:
            self.fail(
                ("model_name_or_path",),
                f"the tokenizer of {source} has no unknown token (unk_token), which Levanter's alpaca_lora gives "
                "the pad, end and beginning roles the tokenizer lacks, as a LoRA run cannot add tokens",
            )
        self.move(("special_tokens",), ("model_name_or_path",))
        return {role: unk for role in ("pad_token", "eos_token", "bos_token") if role not in named}

    # -- the data ----------------------------------------------------------------------------------

    def data(self, source: Any) -> dict:
        raw = self.raw
        value = self.get("data")
        if not isinstance(value, str) or not value:
            self.fail(
                ("data",), f"expected a Hugging Face dataset id or the path of a .json or .jsonl file, got {value!r}"
            )
        self.move(("data",), ("data",))
        if ".json" in value:  # (.jsonl too, and compressed ones, as Levanter tells them)
            data: dict[str, Any] = {"type": "url", "train_urls": [value]}
        elif "://" in value or os.path.isfile(value):
            self.fail(
                ("data",), f"{value}: only a Hugging Face dataset id or a .json or .jsonl file is read, as in Levanter"
            )
        else:
            data = {"type": "hf", "id": value, "train_split": "train", "validation_split": None, "stream": True}
            if self.program == "gsm8k_lora" and value == "gsm8k":
                data["name"] = "main"
        data["cache_dir"] = raw.get("data_cache_dir", "cache/")
        self.move(("data", "cache_dir"), ("data_cache_dir",))
        data["tokenizer"] = self.tokenizer(source)
        data["shuffle"] = self.program != "alpaca_lora"  # alpaca_lora reads the examples in order
        data["format"] = self.format()
        return data

    def tokenizer(self, source: Any) -> str:
        if self.program != "gsm8k_lora":
            self.move(("data", "tokenizer"), ("model_name_or_path",))
            return source
        model = self.gsm8k_model_section()
        self.move(("data", "tokenizer"), ("model",))
        tokenizer = model.get("tokenizer") or source  # (Levanter's model.tokenizer, else the checkpoint's)
        if not isinstance(tokenizer, str) or not tokenizer:
            self.fail(
                ("model", "reference_checkpoint"),
                f"model type {model.get('type')!r} has no default checkpoint to start from; set it",
            )
        return tokenizer

    def format(self) -> dict:
        raw = self.raw
        fmt: dict[str, Any] = {"type": "supervised", "mask_inputs": raw.get("mask_inputs", True)}
        self.move(("data", "format", "mask_inputs"), ("mask_inputs",))
        if self.program == "gsm8k_lora":
            question, answer = (
                self.field_name(key, default) for key, default in (("input_key", "question"), ("output_key", "answer"))
            )
            fmt.update(input_field=question, output_field=answer, prompt_input=f"Q: {{{question}}}\nA: ",
                       output_replacements=[list(pair) for pair in GSM8K_ANSWER_REPLACEMENTS], output_suffix=".\n")  # fmt: skip
            self.move(("data", "format", "input_field"), ("input_key",))
            self.move(("data", "format", "prompt_input"), ("input_key",))
            self.move(("data", "format", "output_field"), ("output_key",))
            return fmt
        prompts = self.prompts()
        fmt.update(input_field="input", output_field="output", prompt_input=prompts["prompt_input"],
                   prompt_no_input=prompts.get("prompt_no_input"))  # fmt: skip
        return fmt

    def field_name(self, key: str, default: str) -> str:
        name = self.raw.get(key, default)
        if not isinstance(name, str) or not re.fullmatch(r"[^{}\[\].:!]+", name) or name.isdigit():
            self.fail((key,), f"expected the name of a field of the records, got {name!r}")
        return name

    def prompts(self) -> dict:
        """Levanter's ``get_prompts``: a mapping, the path of a JSON file holding one, or the
        Alpaca prompts."""
        given = self.raw.get("prompts")
        if given is None:
            return ALPACA_PROMPTS
        in_file = isinstance(given, str)
        if in_file:
            path = given
            try:
                given = json.loads(fileio.read_bytes(path))
            except (OSError, ValueError, LevanterError) as e:
                self.fail(("prompts",), f"cannot read the prompts from {path}: {e}")
            if not isinstance(given, dict):
                self.fail(("prompts",), f"{path} should hold a JSON object with prompt_input and prompt_no_input")
        elif not isinstance(given, dict):
            self.fail(
                ("prompts",),
                f"expected prompt_input and prompt_no_input, or the path of a JSON file of them, got {given!r}",
            )
        for key in ("prompt_input", "prompt_no_input"):
            self.move(("data", "format", key), ("prompts",) if in_file else ("prompts", key))
            value = given.get(key)
            if (value is None and key == "prompt_input") or (value is not None and not isinstance(value, str)):
                where = f" in {path}" if in_file else ""
                self.fail(
                    ("prompts",) if in_file else ("prompts", key),
                    f"{key}{where}: expected a prompt template (a string), got {value!r}",
                )
        return given

    # -- exports -----------------------------------------------------------------------------------

    def exports(self, out: dict) -> None:
        """``hf_save_path`` is the whole model in ``alpaca``, the adapters (PEFT) in the LoRA
        programs, where ``merged_hf_save_path`` is the merged model."""
        raw = self.raw
        lora = self.program != "alpaca"
        for theirs, ours in (("hf_save_path", "peft_save_path" if lora else "hf_save_path"),
                             ("hf_upload", "peft_hf_upload" if lora else "hf_upload"),
                             ("merged_hf_save_path", "hf_save_path"), ("merged_hf_upload", "hf_upload")):  # fmt: skip
            if theirs not in _FIELDS[self.program]:
                continue
            value = self.get(theirs)
            if theirs.endswith("upload") and value is True:
                self.fail((theirs,), "name the Hugging Face hub repository to upload to")
            if value is not None and value is not False:
                out[ours] = value
                self.move((ours,), (theirs,))
        out["hf_save_steps"] = raw.get("hf_save_steps", 1000)
        self.move(("hf_save_steps",), ("hf_save_steps",))


# -- reading the starting model without the network ----------------------------------------------


def _local_directory(source: str, filename: str) -> str | None:
    """The directory holding ``source``'s ``filename``: ``source`` itself, or its copy in the
    local Hugging Face cache; None where reading it would need the network."""
    if os.path.isdir(source):
        return source if os.path.isfile(os.path.join(source, filename)) else None
    if "://" in source or os.path.exists(source):
        return None
    try:
        found = try_to_load_from_cache(source, filename)
    except Exception:  # not a hub name, huggingface_hub missing...
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _local_hf_config(source: str) -> dict | None:
    directory = _local_directory(source, "config.json")
    if directory is None:
        return None
    try:
        return read_hf_config(directory)
    except LevanterError:
        return None


def _our_model(hf_config: dict | None):
    """Our model config for ``hf_config`` (None for none, or one no installed plugin reads: the
    run itself says so)."""
    if hf_config is None:
        return None
    try:
        return config_from_hf(hf_config)
    except LevanterError:
        return None


def _local_tokenizer(source: str):
    directory = _local_directory(source, "tokenizer.json")
    if directory is None:
        return None
    try:
        return load_tokenizer(directory)
    except LevanterError:
        return None
