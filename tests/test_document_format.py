"""Formats as plugins, with arrays of their own beside each document's tokens (what audio needs):
a plugin's format is chosen by ``format.type``, the cache stores its per-document arrays and
resumes them, and the ``document`` layout gives one row per document with those arrays padded or
cut to the lengths the objective asks for."""

import json
import time
from typing import Literal

import numpy as np
import pytest
from pydantic import ValidationError

import levanter_core.plugins as plugins
from levanter_core.data.cache import open_cache
from levanter_core.data.config import CacheOptions
from levanter_core.data.dataset import Batch, TrainStream, sequence_dataset
from levanter_core.data.formats import Encoded, FormatConfig, append_eos
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.errors import DataError
from levanter_core.plugins import hookimpl

BYTE = ByteTokenizer()


class VectorFormat(FormatConfig):
    """A text and a list of numbers per record; each record one batch row."""

    type: Literal["vector"] = "vector"
    values_key: str = "values"

    @property
    def layout(self) -> str:
        return "document"

    def document_fields(self) -> dict[str, str]:
        return {"values": "float32"}

    def encode_batch(self, values, wheres, tokenizer, eos_id):
        out = []
        for value, where in zip(values, wheres):
            if not isinstance(value.get(self.values_key), list):
                out.append(DataError(f"{where}: no list of {self.values_key!r}"))
                continue
            ids = append_eos(tokenizer.encode_batch([value["text"]])[0], eos_id)
            out.append(Encoded(ids, fields={"values": np.asarray(value[self.values_key], np.float32)}))
        return out


class VectorPlugin:
    @hookimpl
    def register_data_formats(self, register):
        register("vector", VectorFormat)


@pytest.fixture(autouse=True)
def vector_format():
    plugins.reset(autoload=False)
    plugins.register_plugin(VectorPlugin(), name="vectors")
    yield
    plugins.reset()


def records(n: int, offset: int = 0) -> list[dict]:
    # lengths vary from 1 to 13 values, texts from 5 to 9 bytes
    return [
        {"text": f"doc {i}" + "!" * (i % 5), "values": [i + k / 10 for k in range(1 + i % 13)]}
        for i in range(offset, offset + n)
    ]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def vector_source(*urls, **kwargs) -> UrlSourceConfig:
    return UrlSourceConfig(train_urls=list(urls), format={"type": "vector"}, **kwargs)


def build(path, src, **kwargs):
    options = dict(enforce_eos=True, skip_bad_data=False, background=False) | kwargs
    return open_cache(str(path), src, "train", BYTE, **options)


def test_a_plugins_format_is_chosen_by_type_and_unknown_ones_are_named():
    assert vector_source("a.jsonl").format == VectorFormat()
    with pytest.raises(
        ValidationError,
        match=r"unknown data format type 'vectr'; installed: chat .*vector \(in-process plugin 'vectors'\)",
    ):
        UrlSourceConfig(train_urls=["a.jsonl"], format={"type": "vectr"})


def test_the_cache_stores_each_documents_own_arrays(tmp_path):
    rows = records(40)
    cache = build(
        tmp_path / "cache",
        vector_source(write(tmp_path / "a.jsonl", rows[:25]), write(tmp_path / "b.jsonl", rows[25:])),
    )
    assert cache.fields == {"values": "float32"} and cache.num_documents == 40
    found = cache.document_field("values", [39, 0, 24, 25, 7])
    for document, values in zip([39, 0, 24, 25, 7], found):
        np.testing.assert_array_equal(values, np.asarray(rows[document]["values"], np.float32))
    offsets = cache.document_offsets()
    assert BYTE.decode(cache.tokens(int(offsets[25]), int(offsets[26]))) == "doc 25<|endoftext|>"


def test_a_stopped_build_resumes_to_the_same_arrays(tmp_path):
    rows = records(3000)
    src = vector_source(write(tmp_path / "a.jsonl", rows[:1500]), write(tmp_path / "b.jsonl", rows[1500:]))
    # every 50 records stored: a stop lands inside a shard, and its arrays must continue from there
    options = dict(cache_options=CacheOptions(batch_size=50, target_size_per_flush=1000))
    whole = build(tmp_path / "whole", src, **options)

    partial = build(tmp_path / "stopped", src, background=True, **options)
    deadline = time.monotonic() + 60
    while partial.num_documents < 200 and time.monotonic() < deadline:
        time.sleep(0.005)
    partial.close()
    stopped_at = partial.ledger["num_documents"]
    resumed = build(tmp_path / "stopped", src, **options)
    assert 0 < stopped_at < 3000 and resumed.complete
    everything = np.arange(3000)
    for a, b in zip(whole.document_field("values", everything), resumed.document_field("values", everything)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.tokens(0, whole.num_tokens), resumed.tokens(0, resumed.num_tokens))
    np.testing.assert_array_equal(whole.document_offsets(), resumed.document_offsets())


def test_each_document_is_a_row_padded_or_cut(tmp_path):
    rows = records(30)
    cache = build(tmp_path / "cache", vector_source(write(tmp_path / "a.jsonl", rows)))
    dataset = sequence_dataset(cache, 8, layout="document", field_lengths={"values": 6})
    assert dataset.final_length() == 30 and dataset.field_shapes == {"values": (6, np.dtype("float32"))}

    batch = dataset.rows(np.array([2, 9, 12]))
    # "doc 2!!" + EOS fits in 8; "doc 9!!!!" + EOS (10 tokens) is cut to 8
    assert BYTE.decode(batch.tokens[0, :8]) == "doc 2!!<|endoftext|>"
    np.testing.assert_array_equal(batch.tokens[1], BYTE.encode_batch(["doc 9!!!"])[0])
    # the loss scores each next token of the document, nothing past it
    np.testing.assert_array_equal(batch.loss_mask[0], [1, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [1, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [1] * 8)
    np.testing.assert_array_equal(batch.fields["values"][0], np.float32([2.0, 2.1, 2.2, 0, 0, 0]))  # padded with zeros
    np.testing.assert_array_equal(batch.fields["values"][2], np.asarray(rows[12]["values"][:6], np.float32))  # cut
    assert dataset.truncated == 2  # row 9's tokens, row 12's values

    short = dataset.rows(np.array([0])).loss_mask[0]
    np.testing.assert_array_equal(short, [1, 1, 1, 1, 1, 0, 0, 0])  # "doc 0" + EOS: 6 tokens, 5 predicted


def test_the_training_stream_carries_the_fields_and_refuses_mixing_with_text(tmp_path):
    cache = build(tmp_path / "vectors", vector_source(write(tmp_path / "a.jsonl", records(30))))
    vectors = sequence_dataset(cache, 8, layout="document", field_lengths={"values": 6})
    stream = TrainStream({"vectors": vectors}, seed=0, shuffle=True)
    batch = stream.batch(3, 4)
    assert isinstance(batch, Batch) and batch.fields["values"].shape == (4, 6) and batch.loss_mask.shape == (4, 8)
    again = stream.batch(3, 4)
    np.testing.assert_array_equal(batch.fields["values"], again.fields["values"])  # a pure function of the step
    template = stream.template(4)
    assert template.fields["values"].shape == (4, 6) and not template.fields["values"].any()

    text_source = UrlSourceConfig(train_urls=[write(tmp_path / "t.jsonl", [{"text": "plain text " * 20}] * 10)])
    text = sequence_dataset(build(tmp_path / "text", text_source), 8)
    with pytest.raises(DataError, match="different kinds .text: tokens only; vectors: values."):
        TrainStream({"vectors": vectors, "text": text}, seed=0)


def test_document_fields_without_a_length_are_refused(tmp_path):
    cache = build(tmp_path / "cache", vector_source(write(tmp_path / "a.jsonl", records(3))))
    with pytest.raises(DataError, match="holds values with each document, but the training objective gives no length"):
        sequence_dataset(cache, 8, layout="document")


class Forgetful(VectorFormat):
    def encode_batch(self, values, wheres, tokenizer, eos_id):
        return [Encoded(e.ids) for e in super().encode_batch(values, wheres, tokenizer, eos_id)]


def test_a_format_that_forgets_its_fields_is_named(tmp_path):
    src = UrlSourceConfig(train_urls=[write(tmp_path / "a.jsonl", records(3))], format=Forgetful())
    with pytest.raises(
        RuntimeError,
        match=r"a.jsonl:1: the Forgetful format declares the document field .values. but encoded this record with nothing",
    ):
        build(tmp_path / "cache", src, num_workers=1)
