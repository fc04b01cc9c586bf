"""``levanter sample``: generate text from a model, and the config of Levanter's ``sample_lm``
(``config/sampler/*.yaml``), which it also reads."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from pydantic import Field, PositiveInt, ValidationError, model_validator

from levanter_core.config.base import ConfigModel, accepted_only_as
from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import format_validation_error
from levanter_core.data.formats import render_chat_prompt
from levanter_core.errors import ConfigError, DataError, UserError
from levanter_core.inference.engine import Engine, RequestError
from levanter_core.models.source import load_model_source
from levanter_core.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)


class EngineConfig(ConfigModel):
    """The inference engine (Levanter's ``engine:`` section). Our engine gives each sequence a
    slot of a key/value cache of ``page_size * max_pages_per_seq`` positions (at most the model's
    ``seq_len``); the fields of Levanter's paged cache that a slotted cache has no use for are
    accepted and have no effect."""

    max_seqs: PositiveInt = 16
    """Sequences decoded together: the slots of the cache (the decoding batch)."""
    page_size: PositiveInt = 128
    """Positions per page; with ``max_pages_per_seq``, the longest sequence (prompt and generation)."""
    max_pages_per_seq: PositiveInt = 64
    """Pages per sequence; ``page_size * max_pages_per_seq`` positions per slot, at most the model's ``seq_len``."""
    max_seqs_in_prefill: PositiveInt = 16
    """Prompts prefilled together when slots free up."""
    max_rounds: PositiveInt = 8
    """Decoding steps run in one compiled call before new requests are admitted and results handed
    out (more: less overhead per token; fewer: new requests start sooner)."""
    max_queued_requests: PositiveInt = 256
    """Requests that may wait for a slot; more are refused (a server answers 429)."""
    seed: int = 0
    """Accepted for Levanter's configs; each request carries its own seed."""
    max_pages: PositiveInt | None = None
    """Levanter's paged cache only: accepted, no effect."""
    max_queued_tokens: PositiveInt = 512
    """Levanter's paged cache only: accepted, no effect."""
    max_prefill_size: PositiveInt | None = None
    """Levanter's paged cache only: accepted, no effect (prompts are padded to a power of two)."""
    max_tokens_per_round: PositiveInt | None = None
    """Levanter's paged cache only: accepted, no effect."""
    max_stop_seqs: int = Field(4, ge=0)
    """Levanter's paged cache only: accepted, no effect (stop strings are checked as text)."""
    max_stop_tokens: PositiveInt = 16
    """Levanter's paged cache only: accepted, no effect."""
    enable_logprobs: bool = False
    """Accepted, no effect: log-probabilities are always computed (``--json`` prints them)."""
    compute_dtype: str | None = None
    """Accepted, no effect: the cache has the model's dtype."""

    def max_seq_len(self, model_seq_len: int) -> int:
        return min(self.page_size * self.max_pages_per_seq, model_seq_len)

    def engine_kwargs(self, model_seq_len: int) -> dict:
        return {
            "max_seqs": self.max_seqs,
            "max_seq_len": self.max_seq_len(model_seq_len),
            "max_rounds": self.max_rounds,
            "max_prefill_seqs": self.max_seqs_in_prefill,
            "max_queued": self.max_queued_requests,
        }


class SampleConfig(ConfigModel):
    """What ``levanter sample --config FILE`` reads: Levanter's ``sample_lm`` config."""

    checkpoint_path: str | None = None
    """One of our checkpoints (or an import) to sample from."""
    hf_checkpoint: str | None = None
    """A Hugging Face model directory or hub name to sample from."""
    tokenizer: str | None = None
    """The tokenizer (as ``data.tokenizer``); default: the model's own."""
    prompts: list[str] = ["Four score and seven years ago, our"]
    """The prompts (a single string is one prompt)."""
    stop_sequence: str | None = None
    """A string that ends a generation."""
    max_new_tokens: PositiveInt = 192
    """Most tokens to generate per prompt."""
    temperature: float = Field(0.7, ge=0.0)
    """Softmax temperature; 0 is greedy."""
    seed: int = 2
    """Seed of the random draws (a signed 64-bit integer)."""
    n_generations: PositiveInt = 1
    """Samples per prompt."""
    n_rounds: PositiveInt = 1
    """Generate everything this many times (the later rounds time the compiled engine)."""
    profile: bool = False
    """Levanter writes a profiler trace; accepted here, with no effect."""
    log_kernel_jaxprs_path: str | None = None
    """Levanter's current sampler writes the jaxprs of its kernels there; only null is accepted."""
    engine: EngineConfig = EngineConfig()
    """The inference engine."""
    trainer: TrainerConfig = TrainerConfig()
    """Levanter's trainer section (precision, mesh, tracker); validated, not otherwise used by sampling."""
    model: dict[str, Any] | None = None
    """Levanter builds the model for ``checkpoint_path`` from this; our checkpoints record their
    own model config, so it is accepted and not needed."""

    _no_jaxpr_log = accepted_only_as(
        None, "log_kernel_jaxprs_path", why="writing the kernels' jaxprs is not available here; remove it"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("prompts"), str):
            data = {**data, "prompts": [data["prompts"]]}
        return data

    @model_validator(mode="after")
    def _one_source(self):
        if self.checkpoint_path is not None and self.hf_checkpoint is not None:
            raise ValueError("give checkpoint_path or hf_checkpoint, not both")
        return self

    @property
    def source(self) -> str | None:
        return self.checkpoint_path or self.hf_checkpoint


def load_sample_config(path: str, overrides: list[str] | None = None) -> SampleConfig:
    """Load, include, override and validate a sampler config (errors name file, line and field)."""
    raw, sources = load_config_dict(path, overrides)
    try:
        return SampleConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, sources)) from None


def read_prompts_file(path: str) -> list[dict]:
    """The prompts of a JSONL file: per line a string, ``{"prompt": TEXT}`` or ``{"messages": [...]}``
    (a conversation, rendered with the chat template)."""
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as e:
        raise DataError(f"--prompts {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        if isinstance(value, str):
            value = {"prompt": value}
        if not isinstance(value, dict) or not (isinstance(value.get("prompt"), str) or "messages" in value):
            raise DataError(f'{where}: expected a string, {{"prompt": TEXT}} or {{"messages": [...]}}')
        prompts.append({**value, "where": where})
    if not prompts:
        raise DataError(f"--prompts {path}: no prompts in the file")
    return prompts


_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}
_SURROGATE = re.compile("[\ud800-\udfff]")


def interpret_escapes(text: str, option: str) -> str:
    """``text`` from the command line with its backslash escapes read as Python reads them in a
    string: ``\\n``, ``\\t``, ``\\r``, ``\\0``, ``\\\\``, quotes, ``\\xHH``, ``\\uHHHH``,
    ``\\UHHHHHHHH`` (so that ``--stop "\\n\\n"`` is two newlines, as a shell cannot easily
    write them). Any other backslash stays as it is. Raises :class:`ConfigError`, naming
    ``option``, for an escape that is no character (a lone surrogate, past U+10FFFF)."""

    def one(match: re.Match) -> str:
        escape = match.group()[1:]
        if escape[0] in "xuU" and len(escape) > 1:
            code = int(escape[1:], 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ConfigError(f"{option} {text!r}: \\{escape} is not a Unicode character")
            return chr(code)
        return _ESCAPES.get(escape, match.group())

    return _ESCAPE.sub(one, text)


def _check_text(text: str, where: str) -> None:
    """Refuse text with a lone UTF-16 surrogate (from JSON's ``"\\ud800"``, or bytes that are not
    UTF-8 on a command line), which no tokenizer can encode."""
    found = _SURROGATE.search(text)
    if found:
        raise DataError(
            f"{where}: the text holds a lone surrogate (U+{ord(found.group()):04X}) at character "
            f"{found.start()}, which is not Unicode text (bytes that are not UTF-8?)"
        )


def encode_prompts(prompts: list[dict], tokenizer, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a ``messages`` prompt (or any prompt, with ``chat``) through the
    chat template, the rest as text with the tokenizer's own special tokens. Raises
    :class:`DataError` for text that is not Unicode (a lone surrogate), naming the prompt."""
    encoded = []
    for p in prompts:
        where = p.get("where", "the prompt")
        if "messages" in p or chat:
            messages = p.get("messages") or [{"role": "user", "content": p["prompt"]}]
            text = render_chat_prompt(messages, tokenizer, where=where)
            _check_text(text, where)
            encoded.append(tokenizer.encode_with_offsets([text], add_special_tokens=False)[0][0].tolist())
        else:
            _check_text(p["prompt"], where)
            encoded.append(tokenizer.encode_batch([p["prompt"]])[0].tolist())
    return encoded


def run_sample(
    source: str,
    prompts: list[dict],
    params,
    *,
    n: int = 1,
    chat: bool = False,
    as_json: bool = False,
    tokenizer: str | None = None,
    engine: EngineConfig | None = None,
    rounds: int = 1,
    out=print,
) -> list[list[Any]]:
    """Generate ``n`` samples of each prompt from the model of ``source`` and print them (as JSON
    lines with ``as_json``). Returns the completions of the last round."""
    loaded = load_model_source(source, tokenizer=tokenizer)
    if loaded.tokenizer is None:
        raise UserError(f"{source} has no tokenizer (no tokenizer.json); name one with --tokenizer")
    ids = encode_prompts(prompts, loaded.tokenizer, chat=chat)
    kwargs = (engine or EngineConfig()).engine_kwargs(loaded.config.seq_len)
    with Engine(loaded.model, tokenizer=loaded.tokenizer, eos_ids=loaded.eos_ids, **kwargs) as running:
        for round_ in range(rounds):
            started = time.perf_counter()
            try:
                completions = running.generate(ids, params, n=n)
            except RequestError as e:
                raise UserError(str(e)) from None
            seconds = time.perf_counter() - started
            generated = sum(len(c.tokens) for row in completions for c in row)
            logger.info(
                "round %d: %d tokens in %.2f s (%.1f tokens/s)", round_ + 1, generated, seconds, generated / seconds
            )
    for p, prompt_ids, row in zip(prompts, ids, completions):
        for c in row:
            if as_json:
                record = {
                    "prompt": p.get("prompt"),
                    "messages": p.get("messages"),
                    "sample": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": prompt_ids,
                    "tokens": c.tokens,
                    "logprobs": c.logprobs,
                }
                out(json.dumps({k: v for k, v in record.items() if v is not None}))
            else:
                shown = p.get("prompt") if "prompt" in p else json.dumps(p["messages"])
                header = f"--- sample {c.index + 1} of {n} ({c.finish_reason})" if n > 1 else f"--- ({c.finish_reason})"
                out(f"{header}\n{shown}{c.text}\n")
    return completions
