"""How records become training examples: the ``format`` of a data source.

A source yields records (a line of text, or a JSON object / table row); its
format turns each into token ids and, for formats that train on only part of
each example, a *target mask* (1 where a token is one the model should learn
to predict). Three formats ship with the core:

* ``text`` (the default): one document per record, from its ``text_key``
  field; documents are joined into one stream and cut into sequences;
* ``chat``: a list of messages rendered with a chat template, trained on the
  assistant turns only;
* ``supervised``: an input and an output field, trained on the output only.

Formats with a target mask are *packed*: several whole examples share one
sequence, and attention does not cross from one to the next.

Plugins add formats with the ``register_data_formats`` hook: a subclass of
:class:`FormatConfig` (``format: {type: audio}`` selects the one registered as
``audio``). A format may store arrays of its own beside each document's token ids
(:meth:`FormatConfig.document_fields`: the samples of an utterance, say) and ask for
each document to be a batch row of its own (:attr:`FormatConfig.layout`).
"""

from __future__ import annotations

import functools
import json
import re
import string
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import Field, field_validator

from levanter_core.config.base import Typed, TypedConfig
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

if TYPE_CHECKING:
    import jinja2

LAYOUTS = ("stream", "packed", "document")

TEXT_KEY_HINT = "set format.text_key to the field that holds the text"
MESSAGES_FIELD_HINT = "set format.messages_field to the field that holds the messages"
"""What a record without the field a format reads is told to do (settings of a training
config's source; ``levanter eval --data`` says what it can do instead)."""
"""How a format's documents become the rows of a batch (:attr:`FormatConfig.layout`)."""


class Encoded(NamedTuple):
    """One example's token ids (int32) and, for packed formats, its target mask
    (uint8, same length: 1 where the token is a training target); ``fields``: the
    arrays of :meth:`FormatConfig.document_fields`, one-dimensional, by name."""

    ids: np.ndarray
    target_mask: np.ndarray | None = None
    fields: dict[str, np.ndarray] | None = None


class FormatConfig(TypedConfig):
    """Base class of every data format (the ``format`` section of a data source): how a
    source's records become documents of token ids, and how documents become batch rows.

    A plugin's format subclasses this, implements :meth:`encode_batch`, and is registered
    with ``register_data_formats``::

        @hookimpl
        def register_data_formats(register):
            register("audio", "levanter_audio.format:AudioFormat")

    Every field of the format keys the tokenized cache (:meth:`fingerprint`): a cache built
    with other settings is refused, never silently reused."""

    @property
    def packed(self) -> bool:
        """Whether examples are packed whole into sequences (with a target mask),
        rather than joined into one stream."""
        return False

    @property
    def layout(self) -> str:
        """How documents become batch rows: ``stream`` (joined into one token stream, cut into
        ``seq_len`` windows), ``packed`` (whole examples packed into rows, with target masks)
        or ``document`` (each document one row of its own: its tokens padded or cut to
        ``seq_len``, each of its :meth:`document_fields` padded or cut to the length the
        training objective asks for). By default ``packed`` for packed formats, else ``stream``."""
        return "packed" if self.packed else "stream"

    def document_fields(self) -> dict[str, str]:
        """Arrays stored with each document besides its token ids: name -> numpy dtype name
        (``{"audio": "float32"}``); each document's :class:`Encoded` carries a one-dimensional
        array of that dtype under each name. None by default."""
        return {}

    def fingerprint(self) -> dict[str, Any]:
        """What the cache must match: every field of the format."""
        return self.model_dump(mode="json")

    def encode_batch(
        self, values: list[Any], wheres: list[str], tokenizer: Tokenizer, eos_id: int | None
    ) -> list[Encoded | DataError]:
        """Encode records ``values`` (each a ``str`` or a ``dict``), read from
        ``wheres`` (``file:line``). A record that cannot be used gives a
        :class:`DataError` naming its ``where`` in its place, so the caller may raise it
        or skip and count it. ``eos_id`` (None: do not append) ends each example."""
        raise NotImplementedError


class TextFormat(FormatConfig):
    """Plain text: each record is one document."""

    type: Literal["text"] = "text"
    """``text``: one document per record."""

    text_key: str = Field("text", min_length=1)
    """The field of a JSON record that holds the document's text. Records that are already
    text (lines of a ``.txt`` file, files of ``python_stdlib``) are used as they are."""

    def encode_batch(
        self, values: list[Any], wheres: list[str], tokenizer: Tokenizer, eos_id: int | None
    ) -> list[Encoded | DataError]:
        texts: list[str] = []
        problems: dict[int, DataError] = {}
        for i, (value, where) in enumerate(zip(values, wheres)):
            try:
                texts.append(self.text_of(value, where))
            except DataError as e:
                problems[i] = e
                texts.append("")
        ids = tokenizer.encode_batch(texts)
        out: list[Encoded | DataError] = []
        for i, x in enumerate(ids):
            if i in problems:
                out.append(problems[i])
            else:
                out.append(Encoded(append_eos(x, eos_id)))
        return out

    def text_of(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            return value
        if not isinstance(value, dict):
            raise DataError(f"{where}: expected a JSON object with a {self.text_key!r} field, found {_clip(value)}")
        if self.text_key not in value:
            keys = ", ".join(map(repr, value)) or "none"
            raise DataError(f"{where}: no {self.text_key!r} field (the record's fields: {keys}); {TEXT_KEY_HINT}")
        text = value[self.text_key]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field {self.text_key!r} should be a string, found {type(text).__name__} {_clip(text)}"
            )
        return text


class ChatFormat(FormatConfig):
    """Conversations: each record holds a list of messages (``{"role": ..., "content": ...}``,
    roles ``system``, ``user``, ``assistant``...) that a Jinja chat template renders into
    one text, as Hugging Face's ``apply_chat_template`` does (same variables: ``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token``; same ``trim_blocks`` and
    ``lstrip_blocks`` settings; a sandboxed environment). The template's own special
    tokens are encoded as such, and nothing else is added (no ``enforce_eos``: the
    template says how a conversation ends).

    The targets are each assistant message and what the template writes after it to end
    the turn: the text between the conversation up to that message rendered with
    ``add_generation_prompt`` and the conversation through that message. A template must
    therefore render every conversation as an extension of its prefixes.

    Without a template of its own or from the tokenizer, the built-in one is used: each
    message as ``<|{role}|>``, a newline, the content, the end-of-text token and a newline;
    the generation prompt is ``<|assistant|>`` and a newline."""

    type: Literal["chat"] = "chat"
    """``chat``: a list of messages per record, trained on the assistant turns."""

    messages_field: str = Field("messages", min_length=1)
    """The field of a record that holds the list of messages."""

    chat_template: str | None = None
    """A Jinja chat template. None: the tokenizer's (``chat_template`` in its
    ``tokenizer_config.json``), else the built-in template described above."""

    mask_user_turns: bool = True
    """Train on the assistant turns only. ``false``: train on every token of the
    conversation (system and user messages and the template's markup too)."""

    @property
    def packed(self) -> bool:
        return True

    def encode_batch(
        self, values: list[Any], wheres: list[str], tokenizer: Tokenizer, eos_id: int | None
    ) -> list[Encoded | DataError]:
        template = _compile(self.chat_template or tokenizer.chat_template or BUILTIN_CHAT_TEMPLATE)
        specials = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
        examples: list[tuple[str, list[tuple[int, int]]] | DataError] = []
        for value, where in zip(values, wheres):
            try:
                examples.append(self.render(value, where, template, specials))
            except DataError as e:
                examples.append(e)
        return _encode_targets(examples, tokenizer, add_special_tokens=False, eos_id=None)

    def render(
        self, value: Any, where: str, template: jinja2.Template, specials: dict[str, str]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, and the character spans ``[start, end)`` to train on."""
        messages = self.messages_of(value, where)
        full = _render(template, messages, False, specials, where)
        if not self.mask_user_turns:
            return full, [(0, len(full))]
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = _render(template, messages[:i], True, specials, where)
            through = _render(template, messages[: i + 1], False, specials, where)
            if not (through.startswith(before) and full.startswith(through)):
                raise DataError(
                    f"{where}: the chat template does not render message {i} as an extension of the "
                    "messages before it, so its tokens cannot be told apart; use a template that "
                    "renders conversations prefix by prefix (format.chat_template)"
                )
            spans.append((len(before), len(through)))
        if not spans:
            raise DataError(f"{where}: no assistant message, so nothing to train on (roles: {_roles(messages)})")
        return full, spans

    def messages_of(self, value: Any, where: str) -> list[dict[str, Any]]:
        """The record's messages, checked: a non-empty list of objects with string
        ``role`` and ``content``."""
        if not isinstance(value, dict) or self.messages_field not in value:
            keys = ", ".join(map(repr, value)) if isinstance(value, dict) else f"not an object: {_clip(value)}"
            raise DataError(
                f"{where}: no {self.messages_field!r} field (the record's fields: {keys or 'none'}); "
                f"{MESSAGES_FIELD_HINT}"
            )
        messages = value[self.messages_field]
        if not isinstance(messages, list) or not messages:
            raise DataError(
                f"{where}: {self.messages_field!r} should be a non-empty list of messages, found {_clip(messages)}"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise DataError(
                    f"{where}: message {i} should be an object with 'role' and 'content', found {_clip(message)}"
                )
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    found = "nothing" if key not in message else f"{type(message[key]).__name__} {_clip(message[key])}"
                    raise DataError(f"{where}: message {i} should have a string {key!r}, found {found}")
        return messages


def render_chat_prompt(
    messages: Any, tokenizer: Tokenizer, *, template: str | None = None, where: str = "the conversation"
) -> str:
    """The text that asks a model for the next assistant message of ``messages`` (a list of
    ``{"role", "content"}``): rendered by ``template``, else the tokenizer's chat template, else the
    built-in one, with ``add_generation_prompt``, as :class:`ChatFormat` renders training data.
    Encode it without the tokenizer's own special tokens (the template writes them). Raises
    :class:`DataError` naming ``where`` for messages or a template that do not fit."""
    messages = ChatFormat().messages_of({"messages": messages}, where)
    specials = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
    compiled = _compile(template or tokenizer.chat_template or BUILTIN_CHAT_TEMPLATE)
    return _render(compiled, messages, True, specials, where)


BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The chat template used when neither the format nor the tokenizer has one."""


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the blocks with which Hugging Face's (and
    Levanter's) templates mark what the assistant writes, rendered as their content. What a
    format trains on is found here by rendering the conversation up to each message, not from
    these marks, so they need no meaning of their own."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox, with the settings and the ``raise_exception``
    helper that Hugging Face's templates expect (and their ``generation`` blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlocks]
    )
    env.globals["raise_exception"] = _raise_from_template
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"format.chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None


class _TemplateRaised(Exception):
    pass


def _raise_from_template(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _render(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    specials: dict[str, str],
    where: str,
) -> str:
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
    except _TemplateRaised as e:
        raise DataError(f"{where}: the chat template refused this conversation: {e}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise DataError(f"{where}: the chat template failed on this conversation ({type(e).__name__}: {e})") from None


def _roles(messages: list[dict[str, Any]]) -> str:
    return ", ".join(dict.fromkeys(m["role"] for m in messages))


class SupervisedFormat(FormatConfig):
    """Input/output pairs: each record's input, the separator and its output are encoded
    as one text, trained on the output (and the end-of-text token after it).

    The input may instead be made from a template filled with the record's fields
    (``prompt_input``, and ``prompt_no_input`` for records without an input), as Stanford
    Alpaca's instruction-tuning prompts are::

        format:
          type: supervised
          input_field: input
          output_field: output
          prompt_input: "### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n### Response:"
          prompt_no_input: "### Instruction:\\n{instruction}\\n\\n### Response:"
    """

    type: Literal["supervised"] = "supervised"
    """``supervised``: an input and an output field per record, trained on the output."""

    input_field: str = Field("prompt", min_length=1)
    """The field of a record that holds the input (the prompt). With ``prompt_input``, the field
    whose emptiness picks ``prompt_no_input``."""

    output_field: str = Field("response", min_length=1)
    """The field of a record that holds the output to learn (the response)."""

    separator: str = ""
    """Text put between the input and the output (``"\\n"``, ``" "``...); not trained on."""

    mask_inputs: bool = True
    """Train on the output only. ``false``: train on the input and separator too."""

    prompt_input: str | None = None
    """A template that makes the input (instead of ``input_field``): a Python format string
    filled with the record's fields by name (``str.format_map``: ``{instruction}`` is the
    record's ``instruction``; ``{{`` and ``}}`` are literal braces). A record without a field
    the template names is bad data (its file and line, and the field). None: the input is
    ``input_field``."""

    prompt_no_input: str | None = None
    """With ``prompt_input``: the template used instead for a record whose ``input_field`` is
    missing, null or empty (Alpaca's prompt for instructions without an input). None: always
    ``prompt_input``."""

    output_replacements: tuple[tuple[str, str], ...] = ()
    """Text replaced in the output before training on it: ``[old, new]`` pairs applied in order
    (GSM8K's answers: ``[["####", "The answer is"], ["\\n", " "]]``)."""

    output_suffix: str = ""
    """Text put after the output, before the end-of-text token; trained on (``".\\n"``)."""

    @property
    def packed(self) -> bool:
        return True

    @field_validator("prompt_input", "prompt_no_input")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        if value is not None:
            _template_fields(value)
        return value

    @field_validator("output_replacements")
    @classmethod
    def _replaces_something(cls, value: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        if any(not old for old, _ in value):
            raise ValueError("an output replacement needs a non-empty text to replace")
        return value

    def fingerprint(self) -> dict[str, Any]:
        """Every field, but the prompt and output options where unset, so that caches built
        before they existed keep their key."""
        optional = ("prompt_input", "prompt_no_input", "output_replacements", "output_suffix")
        unset = {name for name in optional if getattr(self, name) == type(self).model_fields[name].default}
        return self.model_dump(mode="json", exclude=unset)

    def encode_batch(
        self, values: list[Any], wheres: list[str], tokenizer: Tokenizer, eos_id: int | None
    ) -> list[Encoded | DataError]:
        examples: list[tuple[str, list[tuple[int, int]]] | DataError] = []
        for value, where in zip(values, wheres):
            try:
                prompt, output = self._prompt(value, where), self._output(value, where)
            except DataError as e:
                examples.append(e)
                continue
            text = prompt + self.separator + output
            examples.append((text, [(len(text) - len(output) if self.mask_inputs else 0, len(text))]))
        return _encode_targets(examples, tokenizer, add_special_tokens=True, eos_id=eos_id)

    def _prompt(self, value: Any, where: str) -> str:
        if self.prompt_input is None:
            return self._field(value, self.input_field, where)
        self._check_record(value, where)
        name, template = "prompt_input", self.prompt_input
        if self.prompt_no_input is not None and value.get(self.input_field) in (None, ""):
            name, template = "prompt_no_input", self.prompt_no_input
        try:
            return template.format_map(value)
        except KeyError as e:
            keys = ", ".join(map(repr, value)) or "none"
            raise DataError(
                f"{where}: format.{name} names the field {e.args[0]!r}, which the record lacks (the record's "
                f"fields: {keys})"
            ) from None
        except (ValueError, TypeError, IndexError, AttributeError) as e:
            raise DataError(f"{where}: format.{name} cannot be filled from this record: {e}") from None

    def _output(self, value: Any, where: str) -> str:
        output = self._field(value, self.output_field, where)
        if not output:
            raise DataError(f"{where}: field {self.output_field!r} is empty, so there is nothing to train on")
        for old, new in self.output_replacements:
            output = output.replace(old, new)
        return output + self.output_suffix

    def _check_record(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            wanted = f"{self.input_field!r} and {self.output_field!r}" if self.prompt_input is None else "fields"
            raise DataError(f"{where}: expected a JSON object with {wanted}, found {_clip(value)}")

    def _field(self, value: Any, field: str, where: str) -> str:
        self._check_record(value, where)
        if field not in value:
            keys = ", ".join(map(repr, value)) or "none"
            which = "input_field" if field == self.input_field else "output_field"
            raise DataError(f"{where}: no {field!r} field (the record's fields: {keys}); set format.{which}")
        text = value[field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {field!r} should be a string, found {type(text).__name__} {_clip(text)}")
        return text


def _template_fields(template: str) -> list[str]:
    """The record fields a ``str.format_map`` template names (``{a}``, ``{a[0]}``, ``{a.b}``
    name ``a``); ValueError for a template that cannot be filled by name."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"not a valid template ({e}; write {{{{ and }}}} for literal braces)") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError(f"the template's fields are filled by name; {{{name}}} has none")
        fields.append(root)
    return fields


def _encode_targets(
    examples: list[tuple[str, list[tuple[int, int]]] | DataError],
    tokenizer: Tokenizer,
    add_special_tokens: bool,
    eos_id: int | None,
) -> list[Encoded | DataError]:
    """Encode each example's text in one batch, its target mask 1 on the tokens of its
    character spans; errors stay in their places."""
    texts = [e[0] for e in examples if not isinstance(e, DataError)]
    encoded = iter(tokenizer.encode_with_offsets(texts, add_special_tokens=add_special_tokens))
    out: list[Encoded | DataError] = []
    for example in examples:
        if isinstance(example, DataError):
            out.append(example)
            continue
        ids, offsets = next(encoded)
        out.append(_end_with_eos(ids, _span_mask(offsets, example[1]), eos_id))
    return out


def _span_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose character span overlaps one of ``spans``. A token that
    straddles a span's edge is a target: it holds some of the text to learn."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask.astype(np.uint8)


def _end_with_eos(ids: np.ndarray, mask: np.ndarray, eos_id: int | None) -> Encoded:
    """The example ending in ``eos_id`` (None: unchanged), which is a target: the model
    learns where an output ends, whether the tokenizer added the token or we do."""
    if eos_id is None:
        return Encoded(ids, mask)
    if not (len(ids) and ids[-1] == eos_id):
        ids = np.concatenate([ids, np.array([eos_id], np.int32)])
        mask = np.concatenate([mask, np.zeros(1, np.uint8)])
    mask[-1] = 1
    return Encoded(ids, mask)


def append_eos(ids: np.ndarray, eos_id: int | None) -> np.ndarray:
    """``ids`` ending in ``eos_id`` (unchanged if it already does, or ``eos_id`` is None)."""
    if eos_id is None or (len(ids) and ids[-1] == eos_id):
        return ids
    return np.concatenate([ids, np.array([eos_id], np.int32)])


def _clip(value: Any, limit: int = 80) -> str:
    text = value.strip() if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


DataFormat = Typed("data_format", "text")
"""The ``format`` of a data source, chosen by its ``type`` (default ``text``) among the
registered formats (``text``, ``chat`` and ``supervised`` are built in)."""


# -- for plugins' formats --------------------------------------------------------------------
# The pieces a plugin's format builds on (levanter-preference renders conversations and masks
# answers as `chat` and `supervised` do), under names that are part of the public API.

compile_chat_template = _compile
"""Compile a Jinja chat template as the ``chat`` format does (sandboxed, with Hugging Face's
helpers); render it with the format's rendering conventions."""

encode_targets = _encode_targets
"""Tokenize ``(text, target character spans)`` examples in one batch into :class:`Encoded` ids
and target masks (a :class:`DataError` in an example's place is passed through)."""

clip_text = _clip
"""A record (or part of one) shortened for an error message."""
