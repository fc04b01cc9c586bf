"""Formats: how records become token ids and target masks (text, chat, supervised)."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from levanter_core.data import UrlSourceConfig, load_tokenizer
from levanter_core.data.formats import BUILTIN_CHAT_TEMPLATE, ChatFormat, SupervisedFormat, TextFormat
from levanter_core.errors import DataError
from levanter_core.testing import train_bpe_tokenizer

EOS = 256  # the byte tokenizer's <|endoftext|>

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the cat on?"},
    {"role": "assistant", "content": "The mat."},
    {"role": "user", "content": "And the dog?"},
    {"role": "assistant", "content": "It ate the hat, sadly."},
]
ASSISTANT = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE trained here, with a ChatML template in its tokenizer_config.json."""
    corpus = [m["content"] for m in CONVERSATION] + ["user assistant system", "the cat sat on the mat"]
    directory = tmp_path_factory.mktemp("chat_tok")
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    train_bpe_tokenizer(corpus * 20, str(directory / "tokenizer.json"), vocab_size=400, special_tokens=specials)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def target_runs(tokenizer, encoded):
    """The decoded text of each maximal run of target tokens."""
    mask = encoded.target_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tokenizer.decode(encoded.ids[lo:hi]) for lo, hi in zip(edges[::2], edges[1::2])]


def encode_one(fmt, record, tokenizer, eos_id=None):
    (out,) = fmt.encode_batch([record], ["data.jsonl:7"], tokenizer, eos_id)
    return out


# -- chat ----------------------------------------------------------------------------------


def test_chat_targets_are_the_assistant_turns_with_the_byte_tokenizer():
    tok = load_tokenizer("byte")

    encoded = encode_one(ChatFormat(), {"messages": CONVERSATION}, tok, eos_id=EOS)

    assert encoded.ids.dtype == np.int32 and encoded.target_mask.dtype == np.uint8
    text = tok.decode(encoded.ids)
    assert text.startswith("<|system|>\nYou are terse.<|endoftext|>\n<|user|>\n")
    assert (encoded.ids == EOS).sum() == len(CONVERSATION)  # the template's eos is one token
    assert target_runs(tok, encoded) == [f"{a}<|endoftext|>\n" for a in ASSISTANT]


def test_chat_targets_with_a_trained_tokenizer_and_its_template(chat_tokenizer_dir):
    tok = load_tokenizer(str(chat_tokenizer_dir))
    assert tok.chat_template == CHATML

    encoded = encode_one(ChatFormat(), {"messages": CONVERSATION}, tok)

    assert len(encoded.ids) < len(tok.decode(encoded.ids))  # merges, not bytes
    assert target_runs(tok, encoded) == [f"{a}<|im_end|>\n" for a in ASSISTANT]
    (im_start,) = tok.encode_batch(["<|im_start|>"])
    assert (encoded.ids == im_start[0]).sum() == len(CONVERSATION)


def test_chat_ids_match_transformers_apply_chat_template(chat_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    expected = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]

    encoded = encode_one(ChatFormat(), {"messages": CONVERSATION}, load_tokenizer(str(chat_tokenizer_dir)))

    assert encoded.ids.tolist() == list(expected)


def test_chat_options(chat_tokenizer_dir):
    tok = load_tokenizer(str(chat_tokenizer_dir))
    record = {"conversation": CONVERSATION[1:3]}

    everything = encode_one(ChatFormat(messages_field="conversation", mask_user_turns=False), record, tok)
    builtin = encode_one(ChatFormat(messages_field="conversation", chat_template=BUILTIN_CHAT_TEMPLATE), record, tok)

    assert everything.target_mask.all() and len(everything.ids) > 0
    assert tok.decode(builtin.ids).startswith("<|user|>\nWhat is the cat on?<|im_end|>\n<|assistant|>\n")
    assert target_runs(tok, builtin) == ["The mat.<|im_end|>\n"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"text": "hi"},
            r"data\.jsonl:7: no 'messages' field \(the record's fields: 'text'\); set format\.messages_field",
        ),
        ("a line of text", r"data\.jsonl:7: no 'messages' field \(the record's fields: not an object"),
        ({"messages": []}, r"data\.jsonl:7: 'messages' should be a non-empty list of messages, found \[\]"),
        ({"messages": [{"content": "hi"}]}, r"data\.jsonl:7: message 0 should have a string 'role', found nothing"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            r"data\.jsonl:7: message 1 should have a string 'content', found NoneType null",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            r"data\.jsonl:7: no assistant message, so nothing to train on \(roles: user\)",
        ),
    ],
)
def test_malformed_chats_are_data_errors_in_place(record, message):
    tok = load_tokenizer("byte")
    good = {"messages": CONVERSATION[1:3]}

    first, bad, last = ChatFormat().encode_batch(
        [good, record, good], ["data.jsonl:6", "data.jsonl:7", "data.jsonl:8"], tok, EOS
    )

    assert np.array_equal(first.ids, last.ids) and first.target_mask.sum() > 0
    with pytest.raises(DataError, match=message):
        raise bad


def test_templates_that_cannot_be_used():
    tok = load_tokenizer("byte")
    record = {"messages": CONVERSATION[1:3]}
    # Marks the last message, so a prefix renders differently from the whole conversation.
    last_marked = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    refusing = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    )

    with pytest.raises(DataError, match=r"data\.jsonl:7: the chat template does not render message 1 as an extension"):
        raise encode_one(ChatFormat(chat_template=last_marked), record, tok)
    with pytest.raises(
        DataError, match=r"data\.jsonl:7: the chat template refused this conversation: a system message comes first"
    ):
        raise encode_one(ChatFormat(chat_template=refusing), record, tok)
    with pytest.raises(DataError, match=r"format\.chat_template: not a valid Jinja template \(line 1"):
        encode_one(ChatFormat(chat_template="{% for m in messages %}"), record, tok)
    sandboxed = "{{ messages.__class__.__mro__ }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(
        DataError, match=r"data\.jsonl:7: the chat template failed on this conversation \(SecurityError"
    ):
        raise encode_one(ChatFormat(chat_template=sandboxed), record, tok)


# -- supervised ----------------------------------------------------------------------------


def test_supervised_trains_on_the_output_and_eos():
    tok = load_tokenizer("byte")
    record = {"prompt": "2+2=", "response": "4", "id": 3}

    masked = encode_one(SupervisedFormat(separator=" "), record, tok, eos_id=EOS)
    unmasked = encode_one(SupervisedFormat(mask_inputs=False), record, tok, eos_id=None)

    assert tok.decode(masked.ids) == "2+2= 4<|endoftext|>"
    assert masked.target_mask.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert tok.decode(unmasked.ids) == "2+2=4" and unmasked.target_mask.tolist() == [1] * 5


def test_supervised_with_a_trained_tokenizer(chat_tokenizer_dir):
    tok = load_tokenizer(str(chat_tokenizer_dir))
    fmt = SupervisedFormat(input_field="question", output_field="answer", separator="\n")
    records = [
        {"question": "What is the cat on?", "answer": "The mat."},
        {"question": "Dog?", "answer": "It ate the hat"},
    ]

    encoded = fmt.encode_batch(records, ["q.jsonl:1", "q.jsonl:2"], tok, tok.eos_id)

    assert [target_runs(tok, e) for e in encoded] == [["The mat.<|im_end|>"], ["It ate the hat<|im_end|>"]]
    assert tok.decode(encoded[0].ids) == "What is the cat on?\nThe mat.<|im_end|>"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": "q"},
            r"q\.jsonl:2: no 'response' field \(the record's fields: 'prompt'\); set format\.output_field",
        ),
        (
            {"response": "a"},
            r"q\.jsonl:2: no 'prompt' field \(the record's fields: 'response'\); set format\.input_field",
        ),
        ({"prompt": "q", "response": ""}, r"q\.jsonl:2: field 'response' is empty, so there is nothing to train on"),
        ({"prompt": 7, "response": "a"}, r"q\.jsonl:2: field 'prompt' should be a string, found int 7"),
        ("just text", r"q\.jsonl:2: expected a JSON object with 'prompt' and 'response', found just text"),
    ],
)
def test_malformed_supervised_records_are_data_errors(record, message):
    good, bad = SupervisedFormat().encode_batch(
        [{"prompt": "q", "response": "a"}, record], ["q.jsonl:1", "q.jsonl:2"], load_tokenizer("byte"), EOS
    )

    assert good.target_mask.tolist() == [0, 1, 1]
    with pytest.raises(DataError, match=message):
        raise bad


# -- text, and choosing a format -----------------------------------------------------------


def test_text_format_reads_its_key_and_names_missing_fields():
    tok = load_tokenizer("byte")
    fmt = TextFormat(text_key="content")

    ok, line, missing, wrong = fmt.encode_batch(
        [{"content": "ab"}, "cd", {"text": "x"}, {"content": 5}], ["t:1", "t:2", "t:3", "t:4"], tok, EOS
    )

    assert ok.ids.tolist() == [97, 98, EOS] and ok.target_mask is None and line.ids.tolist() == [99, 100, EOS]
    assert (
        str(missing)
        == "t:3: no 'content' field (the record's fields: 'text'); set format.text_key to the field that holds the text"
    )
    assert str(wrong) == "t:4: field 'content' should be a string, found int 5"
    assert not fmt.packed and ChatFormat().packed and SupervisedFormat().packed


def test_format_is_chosen_by_type_in_a_source_section():
    def fmt(section):
        return UrlSourceConfig(train_urls=["a.jsonl"], format=section).format

    assert UrlSourceConfig(train_urls=["a.jsonl"]).format == TextFormat()
    assert fmt({"text_key": "content"}) == TextFormat(text_key="content")
    assert fmt({"type": "chat", "mask_user_turns": False}) == ChatFormat(mask_user_turns=False)
    assert fmt({"type": "supervised", "separator": "\n"}) == SupervisedFormat(separator="\n")
    assert ChatFormat().fingerprint() != ChatFormat(chat_template=BUILTIN_CHAT_TEMPLATE).fingerprint()
    with pytest.raises(
        ValidationError, match=r"unknown data format type 'sign-language'; installed: .*chat .*supervised .*text"
    ):
        fmt({"type": "sign-language"})
    with pytest.raises(ValidationError, match="messages_fieldd"):
        fmt({"type": "chat", "messages_fieldd": "m"})
