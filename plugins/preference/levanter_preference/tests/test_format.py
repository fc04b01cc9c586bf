"""``format: {type: preference}`` through the core's cache: each pair is one row, the chosen
sequence as its tokens and the rejected one beside it, with masks that score exactly the answers
(1 where the *next* token is an answer's); a bad record is named by its file and line."""

from __future__ import annotations

import numpy as np
import pytest

from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.errors import DataError
from levanter_core.testing import write_jsonl
from levanter_preference.format import PreferenceFormat
from levanter_preference.tests.conftest import CHAT, PAIRS, cached_rows, preference_batch

BYTE = ByteTokenizer()

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def scored(tokens: np.ndarray, mask: np.ndarray) -> str:
    """The text of the tokens that ``mask`` scores: token ``t + 1`` wherever ``mask[t]`` is 1."""
    return BYTE.decode(tokens[1:][mask[:-1].astype(bool)])


def sides(batch, row: int) -> tuple[str, str]:
    """What a batch row scores of its chosen and of its rejected sequence."""
    chosen = scored(batch.tokens[row], batch.fields["chosen_mask"][row])
    rejected = scored(batch.fields["rejected_ids"][row], batch.fields["rejected_mask"][row])
    return chosen, rejected


def test_the_plugin_is_found_with_its_format_and_objectives():
    from levanter_core.testing import listed_plugin

    ours = listed_plugin("levanter-preference")
    assert ours["error"] is None and ours["types"] == {
        "data_format": ["preference"],
        "objective": ["dpo", "simpo", "ipo", "orpo"],
    }


def test_the_format_is_registered_with_a_row_per_pair():
    source = UrlSourceConfig(train_urls=["pairs.jsonl"], format={"type": "preference", "chosen_key": "good"})
    assert isinstance(source.format, PreferenceFormat) and source.format.layout == "document"
    assert source.format.document_fields() == {
        "chosen_mask": "uint8",
        "rejected_ids": "int32",
        "rejected_mask": "uint8",
    }
    assert PreferenceFormat().fingerprint() != PreferenceFormat(prompt_key="question").fingerprint()


def test_each_form_of_pair_scores_its_answers_only(tmp_path):
    batch = preference_batch(tmp_path, PAIRS, seq_len=96)

    assert batch.tokens.shape == batch.fields["rejected_ids"].shape == batch.fields["chosen_mask"].shape == (4, 96)
    # text: the prompt, then the answer and the end-of-text token, which is scored
    assert BYTE.decode(batch.tokens[0][batch.tokens[0] > 0]) == "Q: 2+2=4<|endoftext|>"
    assert sides(batch, 0) == ("4<|endoftext|>", "5<|endoftext|>")
    assert sides(batch, 1) == (" blue.<|endoftext|>", " made of green cheese.<|endoftext|>")
    # conversations: the template's rendering (the core's built-in one), the assistant's turn scored
    assert BYTE.decode(batch.tokens[2][: batch.fields["chosen_mask"][2].nonzero()[0][0] + 1]) == (
        "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nWhat does a cat sit on?<|endoftext|>\n<|assistant|>\n"
    )
    assert sides(batch, 2) == ("A mat.<|endoftext|>\n", "The moon, mostly.<|endoftext|>\n")
    # a conversation as the prompt, answered by a string and by a message: the same rendering
    assert sides(batch, 3) == ("A mat.<|endoftext|>\n", "Nothing<|endoftext|>\n")
    np.testing.assert_array_equal(batch.tokens[3], batch.tokens[2])
    # nothing past a sequence's end is scored, and the last position never is
    for name, ids in (("chosen_mask", batch.tokens), ("rejected_mask", batch.fields["rejected_ids"])):
        mask = batch.fields[name]
        lengths = (ids > 0).sum(axis=1)
        assert all(mask[row, lengths[row] - 1 :].sum() == 0 for row in range(4))


def test_answers_after_the_shared_turns_are_scored_and_the_rest_is_context(tmp_path):
    first = [{"role": "user", "content": "Name a colour."}]
    chosen = first + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"},
                      {"role": "assistant", "content": "Blue."}]  # fmt: skip
    rejected = first + [{"role": "assistant", "content": "Cat."}, {"role": "user", "content": "Another?"},
                        {"role": "assistant", "content": "Dog."}]  # fmt: skip
    same = first + [{"role": "assistant", "content": "Green."}]
    records = [
        {"chosen": chosen, "rejected": rejected},
        {"chosen": same, "rejected": same},  # identical: the final answer is scored on both sides
    ]
    batch = preference_batch(tmp_path, records, seq_len=256, fmt={"chat_template": CHATML})
    # ChatML: each turn ends with <|im_end|> and a newline, which are scored with the answer; the
    # user turn between the answers is not
    mask = batch.fields["chosen_mask"][0]
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]]).astype(np.int8)))
    tokens = batch.tokens[0]
    assert [BYTE.decode(tokens[lo + 1 : hi + 1]) for lo, hi in zip(runs[::2], runs[1::2])] == [
        "Red.<|im_end|>\n", "Blue.<|im_end|>\n"]  # fmt: skip
    assert sides(batch, 0) == ("Red.<|im_end|>\nBlue.<|im_end|>\n", "Cat.<|im_end|>\nDog.<|im_end|>\n")
    assert sides(batch, 1) == ("Green.<|im_end|>\n", "Green.<|im_end|>\n")


def test_the_records_fields_are_read_under_the_configured_keys(tmp_path):
    records = [{"question": "Say hi.", "good": [{"role": "assistant", "content": "Hi!"}], "bad": "Go away."}]
    batch = preference_batch(tmp_path, records, seq_len=64,
                             fmt={"chosen_key": "good", "rejected_key": "bad", "prompt_key": "question"})  # fmt: skip
    assert BYTE.decode(batch.tokens[0][batch.tokens[0] > 0]).startswith("<|user|>\nSay hi.<|endoftext|>\n")
    assert sides(batch, 0) == ("Hi!<|endoftext|>\n", "Go away.<|endoftext|>\n")


def test_a_hugging_face_dataset_of_conversations(tmp_path):
    datasets = pytest.importorskip("datasets")
    from levanter_data_hf import HfSourceConfig

    rows = [{"chosen": CHAT + [{"role": "assistant", "content": answer}],
             "rejected": CHAT + [{"role": "assistant", "content": "The moon."}]} for answer in ("A mat.", "A rug.")]  # fmt: skip
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    batch = cached_rows(tmp_path, HfSourceConfig(id=str(tmp_path / "saved"), format={"type": "preference"}), 96)
    assert [sides(batch, row) for row in range(2)] == [
        ("A mat.<|endoftext|>\n", "The moon.<|endoftext|>\n"), ("A rug.<|endoftext|>\n", "The moon.<|endoftext|>\n")]  # fmt: skip


def test_rows_longer_than_seq_len_are_cut_with_their_masks(tmp_path):
    records = [{"prompt": "Q: ", "chosen": "a" * 40, "rejected": "b" * 10}]
    batch = preference_batch(tmp_path, records, seq_len=16)
    assert batch.tokens.shape == (1, 16)
    # "Q: " and 13 of the 40 a's: each position up to the last scores the next; the last position
    # (whose next token was cut off) is left to the objective, which never scores it
    assert sides(batch, 0) == ("a" * 13, "b" * 10 + "<|endoftext|>")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "Q: hi", "rejected": "no"}, "no 'chosen' field (the record's fields: 'prompt', 'rejected')"),
        ({"prompt": "Q: hi", "chosen": "yes"}, "set format.rejected_key"),
        ({"prompt": "Q: hi"}, "no 'chosen' field"),
        ({"prompt": "Q: hi", "chosen": "", "rejected": "no"}, "'chosen' is empty"),
        ({"prompt": "Q: hi", "chosen": "yes", "rejected": "  "}, "'rejected' is empty"),
        ({"chosen": "yes", "rejected": "no"}, "answers given as text need the prompt they answer"),
        ({"prompt": "Q", "chosen": 3, "rejected": "no"}, "'chosen' should be a string or a list of messages, found int 3"),
        ({"chosen": CHAT, "rejected": CHAT}, "the 'chosen' conversation ends with a 'user' message"),
        ({"chosen": CHAT + [{"role": "assistant", "content": "A mat."}],
          "rejected": CHAT[:1] + [{"role": "user", "content": "Hm?"}, {"role": "assistant", "content": "A mat."}]},
         "first differ at message 1, a 'user' message"),
        ({"prompt": CHAT, "chosen": "A mat.", "rejected": [{"role": "assistant", "content": ""}]},
         "the 'rejected' answer (message 2) is empty"),
        ({"prompt": CHAT, "chosen": "A mat.", "rejected": [{"role": "assistant"}]},
         "message 0 should have a string 'content', found nothing (in 'rejected')"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)  # fmt: skip
def test_a_bad_record_is_named_by_file_and_line(tmp_path, record, message):
    with pytest.raises(DataError) as raised:
        preference_batch(tmp_path, [PAIRS[0], record, PAIRS[1]], seq_len=64)
    assert f"{tmp_path / 'pairs.jsonl'}:2: " in str(raised.value) and message in str(raised.value)


def test_bad_records_can_be_skipped_and_counted(tmp_path):
    from levanter_core.data.cache import open_cache

    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], {"prompt": "Q"}, PAIRS[1]])
    source = UrlSourceConfig(train_urls=[path], format={"type": "preference"})
    cache = open_cache(str(tmp_path / "cache"), source, "train", BYTE, enforce_eos=True, skip_bad_data=True,
                       background=False)  # fmt: skip
    assert cache.num_documents == 2
