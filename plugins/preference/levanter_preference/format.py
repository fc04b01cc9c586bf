"""``format: {type: preference}``: pairs of a chosen and a rejected answer to the same prompt.

Each record (a JSON-lines object, a Parquet row, a row of a Hugging Face dataset) holds a chosen
answer under ``chosen_key`` and a rejected one under ``rejected_key``, in one of two forms:

* **conversations**: each side a list of messages (``{"role", "content"}``), rendered with the
  chat template as the core's ``chat`` format renders them (the format's ``chat_template``,
  else the tokenizer's, else the built-in one). The two conversations share their first
  messages (the prompt) and differ from an assistant message on; what is scored on each side is
  every assistant message from there to the end, with what the template writes to end the turn
  (at least the final assistant message: a pair that differs nowhere scores that). A
  ``prompt_key`` field, when present, is put before both sides: a list of messages, or a string
  (one user message); a side given as a string is then one assistant message.
* **text**: ``prompt_key`` (a string) followed directly by each side (a string), encoded with the
  tokenizer's own special tokens; what is scored is the answer and the end-of-text token after it
  (``data.enforce_eos``), as the ``supervised`` format does.

Each pair is one batch row (the ``document`` layout): the document's token ids are the chosen
sequence; beside them the cache keeps, per document, ``chosen_mask`` (uint8, 1 at each position
whose *next* token is one of the chosen answer's: the core's ``loss_mask`` convention),
``rejected_ids`` (int32) and ``rejected_mask``. The training objective (``dpo``) asks for all
three cut to, or padded with zeros to, ``seq_len``.

A record that cannot be used (a missing side, an empty answer, a conversation that ends
before any answer, two conversations that differ before an assistant message) is a
:class:`~levanter_core.errors.DataError` naming its file and line, or is skipped and counted
with ``data.skip_bad_data``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
from pydantic import Field

# The chat format's template compiler, record printer and span encoder are what this format
# needs too: one rendering of conversations for both, so a preference pair is encoded exactly
# as supervised fine-tuning on the same conversation would encode it.
from levanter_core.data.formats import (
    BUILTIN_CHAT_TEMPLATE,
    ChatFormat,
    Encoded,
    FormatConfig,
    clip_text,
    compile_chat_template,
    encode_targets,
)
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

CHOSEN_MASK = "chosen_mask"
"""Document field: 1 at each position of the chosen sequence whose next token is scored."""
REJECTED_IDS = "rejected_ids"
"""Document field: the rejected sequence's token ids."""
REJECTED_MASK = "rejected_mask"
"""Document field: 1 at each position of the rejected sequence whose next token is scored."""

FIELDS = {CHOSEN_MASK: "uint8", REJECTED_IDS: "int32", REJECTED_MASK: "uint8"}
"""What the cache keeps with each pair besides the chosen sequence's ids, with their dtypes."""


class _Pair(NamedTuple):
    """A record ready to encode: each side's text and the character spans to score in it, and
    whether the texts were written by a chat template (they then carry their own special
    tokens)."""

    chat: bool
    chosen: tuple[str, list[tuple[int, int]]]
    rejected: tuple[str, list[tuple[int, int]]]


class PreferenceFormat(FormatConfig):
    """Preference pairs: a prompt answered twice, one answer chosen, one rejected; each pair one
    batch row, scored on the answers (preference optimization, the ``dpo`` objective)."""

    type: Literal["preference"] = "preference"
    """``preference``: a chosen and a rejected answer per record."""

    chosen_key: str = Field("chosen", min_length=1)
    """The field of a record that holds the chosen (preferred) answer: a string, or a
    conversation (a list of messages)."""

    rejected_key: str = Field("rejected", min_length=1)
    """The field of a record that holds the rejected answer, in the form of the chosen one."""

    prompt_key: str = Field("prompt", min_length=1)
    """The field of a record that holds the prompt both answers follow: a string, or a list of
    messages. Needed when the answers are strings; optional for conversations (which may carry
    their prompt themselves, as their shared first messages)."""

    chat_template: str | None = None
    """A Jinja chat template for conversations. None: the tokenizer's (``chat_template`` in its
    ``tokenizer_config.json``), else the core's built-in template (see the ``chat`` format)."""

    @property
    def layout(self) -> str:
        return "document"

    def document_fields(self) -> dict[str, str]:
        return dict(FIELDS)

    def encode_batch(self, values, wheres, tokenizer: Tokenizer, eos_id: int | None):
        pairs: list[_Pair | DataError] = []
        for value, where in zip(values, wheres):
            try:
                pairs.append(self.render(value, where, tokenizer))
            except DataError as e:
                pairs.append(e)
        # Template-rendered texts already hold every special token they need; text answers get
        # the tokenizer's own (a BOS) and end with the end-of-text token, which is scored.
        chats = [side for p in pairs if isinstance(p, _Pair) and p.chat for side in (p.chosen, p.rejected)]
        texts = [side for p in pairs if isinstance(p, _Pair) and not p.chat for side in (p.chosen, p.rejected)]
        encoded = {
            True: iter(encode_targets(chats, tokenizer, add_special_tokens=False, eos_id=None)),
            False: iter(encode_targets(texts, tokenizer, add_special_tokens=True, eos_id=eos_id)),
        }
        out: list[Encoded | DataError] = []
        for pair, where in zip(pairs, wheres):
            if isinstance(pair, DataError):
                out.append(pair)
                continue
            chosen, rejected = next(encoded[pair.chat]), next(encoded[pair.chat])
            try:
                fields = {
                    CHOSEN_MASK: _next_token_mask(chosen, self.chosen_key, where),
                    REJECTED_IDS: np.ascontiguousarray(rejected.ids, np.int32),
                    REJECTED_MASK: _next_token_mask(rejected, self.rejected_key, where),
                }
            except DataError as e:
                out.append(e)
                continue
            out.append(Encoded(np.ascontiguousarray(chosen.ids, np.int32), fields=fields))
        return out

    def render(self, value, where: str, tokenizer: Tokenizer) -> _Pair:
        """The record's two sides as texts with the character spans to score, checked."""
        if not isinstance(value, dict):
            raise DataError(
                f"{where}: expected a JSON object with {self.chosen_key!r} and {self.rejected_key!r} answers, "
                f"found {clip_text(value)}"
            )
        chosen = self._answer(value, self.chosen_key, "chosen_key", where)
        rejected = self._answer(value, self.rejected_key, "rejected_key", where)
        prompt = value.get(self.prompt_key)
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise DataError(
                f"{where}: {self.prompt_key!r} should be a string or a list of messages, "
                f"found {type(prompt).__name__} {clip_text(prompt)}"
            )
        if any(isinstance(x, list) for x in (prompt, chosen, rejected)):
            return self._conversations(prompt, chosen, rejected, where, tokenizer)
        return self._texts(value, prompt, chosen, rejected, where)

    def _answer(self, value: dict, key: str, option: str, where: str):
        if key not in value:
            keys = ", ".join(map(repr, value)) or "none"
            raise DataError(
                f"{where}: no {key!r} field (the record's fields: {keys}); a preference pair needs a chosen and a "
                f"rejected answer: set format.{option} to the field that holds it"
            )
        answer = value[key]
        if not isinstance(answer, (str, list)):
            raise DataError(
                f"{where}: {key!r} should be a string or a list of messages, "
                f"found {type(answer).__name__} {clip_text(answer)}"
            )
        return answer

    def _texts(self, value: dict, prompt, chosen: str, rejected: str, where: str) -> _Pair:
        if prompt is None:
            keys = ", ".join(map(repr, value))
            raise DataError(
                f"{where}: no {self.prompt_key!r} field (the record's fields: {keys}); answers given as text need "
                "the prompt they answer: set format.prompt_key, or give the answers as conversations"
            )
        sides = []
        for answer, key in ((chosen, self.chosen_key), (rejected, self.rejected_key)):
            if not answer.strip():
                raise DataError(f"{where}: {key!r} is empty, so there is nothing to compare")
            text = prompt + answer
            sides.append((text, [(len(prompt), len(text))]))
        return _Pair(False, *sides)

    def _conversations(self, prompt, chosen, rejected, where: str, tokenizer: Tokenizer) -> _Pair:
        start = [] if prompt is None else _messages(prompt, self.prompt_key, "user", where)
        keys = (self.chosen_key, self.rejected_key)
        conversations = [
            start + _messages(answer, key, "assistant", where) for answer, key in zip((chosen, rejected), keys)
        ]
        shared = 0
        while shared < min(map(len, conversations)) and conversations[0][shared] == conversations[1][shared]:
            shared += 1
        template = compile_chat_template(self.chat_template or tokenizer.chat_template or BUILTIN_CHAT_TEMPLATE)
        specials = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
        renderer = ChatFormat(chat_template=self.chat_template)
        sides = []
        for conversation, key in zip(conversations, keys):
            last = len(conversation) - 1
            if conversation[last]["role"] != "assistant":
                raise DataError(
                    f"{where}: the {key!r} conversation ends with a {conversation[last]['role']!r} message, not an "
                    "assistant's answer, so there is nothing to score"
                )
            first = min(shared, last)  # two identical conversations: their final answer is scored
            if conversation[first]["role"] != "assistant":
                raise DataError(
                    f"{where}: the {keys[0]!r} and {keys[1]!r} conversations first differ at message {first}, a "
                    f"{conversation[first]['role']!r} message; they should share everything before the answers "
                    "they compare"
                )
            answers = [i for i, message in enumerate(conversation) if message["role"] == "assistant"]
            for i in answers:
                if i >= first and not conversation[i]["content"].strip():
                    raise DataError(
                        f"{where}: the {key!r} answer (message {i}) is empty, so there is nothing to compare"
                    )
            text, spans = renderer.render({"messages": conversation}, where, template, specials)
            sides.append((text, [span for i, span in zip(answers, spans) if i >= first]))
        return _Pair(True, *sides)


def _messages(value, key: str, role: str, where: str) -> list[dict]:
    """``value`` as a list of messages: a string is one message of ``role``; a list is checked
    as the chat format checks its messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    try:
        return ChatFormat(messages_field=key).messages_of({key: value}, where)
    except DataError as e:
        raise DataError(f"{e} (in {key!r})") from None


def _next_token_mask(encoded: Encoded, key: str, where: str) -> np.ndarray:
    """The target mask of ``encoded`` moved one position back: 1 at each position whose next
    token is a target (the weight of predicting token ``t + 1`` from position ``t``, as a
    ``loss_mask``), 0 at the last position."""
    targets = encoded.target_mask
    mask = np.zeros(len(targets), np.uint8)
    mask[:-1] = targets[1:]
    if not mask.any():
        raise DataError(
            f"{where}: the {key!r} answer has no token that follows another, so it cannot be scored; give it a prompt"
        )
    return mask
