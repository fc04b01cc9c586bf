"""Data sources (files of every kind, URLs, braces and globs, resuming, fingerprints),
tokenizers, and the bad data that sources report as records."""

import bz2
import functools
import gzip
import http.server
import json
import lzma
import os
import sys
import threading

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from levanter_core.data import PythonStdlibSourceConfig, UrlSourceConfig, expand_braces, load_tokenizer, read_records
from levanter_core.errors import DataError
from levanter_core.testing import train_bpe_tokenizer

EOS = 256  # the byte tokenizer's <|endoftext|>

_COMPRESS = {
    None: lambda data: data,
    "gz": gzip.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
    "bz2": bz2.compress,
    "xz": lzma.compress,
}


def write_jsonl(path, texts, compress=None):
    data = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    path.write_bytes(_COMPRESS[compress](data))
    return str(path)


def write_parquet(path, texts, row_group_size):
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def values(records):
    return [r.value for r in records]


def texts_of(config, split="train"):
    out = []
    for shard in config.shards(split):
        for record in config.records(split, shard):
            if isinstance(record.value, DataError):
                raise record.value
            out.append(record.value["text"] if isinstance(record.value, dict) else record.value)
    return out


# -- file kinds ----------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [None, "gz", "zst", "bz2", "xz"])
def test_jsonl_plain_and_compressed(tmp_path, compress):
    suffix = f".{compress}" if compress else ""
    path = write_jsonl(tmp_path / f"a.jsonl{suffix}", ["one", "two", "three"], compress)

    records = list(read_records(path))

    assert values(records) == [{"text": "one", "id": 0}, {"text": "two", "id": 1}, {"text": "three", "id": 2}]
    assert [r.where for r in records] == [f"{path}:1", f"{path}:2", f"{path}:3"]


def test_text_json_and_parquet_files(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("five\n\n  \nsix\r\n")
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    wrapped = tmp_path / "wrapped.json.gz"
    wrapped.write_bytes(gzip.compress(json.dumps({"version": 2, "rows": [{"text": "c"}]}).encode()))
    parquet = write_parquet(tmp_path / "t.parquet", ["p0", "p1", "p2"], row_group_size=2)
    config = UrlSourceConfig(train_urls=[str(txt), str(array), str(wrapped), parquet])

    records = [r for shard in config.shards("train") for r in config.records("train", shard)]

    assert values(records) == [
        "five",
        "six",
        {"text": "a"},
        {"text": "b"},
        {"text": "c"},
        {"text": "p0", "id": 0},
        {"text": "p1", "id": 1},
        {"text": "p2", "id": 2},
    ]
    assert [r.where for r in records] == [
        f"{txt}:1",
        f"{txt}:4",
        f"{array}:item 0",
        f"{array}:item 1",
        f"{wrapped}:item 0",
        f"{parquet}:row 0",
        f"{parquet}:row 1",
        f"{parquet}:row 2",
    ]


def test_file_kind_comes_from_the_name(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "t.parquet.gz").write_bytes(b"")

    with pytest.raises(
        DataError, match=r"data\.csv: cannot tell the format .* expected \.jsonl, \.json, \.parquet, \.txt"
    ):
        list(read_records(str(tmp_path / "data.csv")))
    with pytest.raises(DataError, match="Parquet files are compressed internally"):
        list(read_records(str(tmp_path / "t.parquet.gz")))
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        list(read_records(str(tmp_path / "missing.jsonl")))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", ["x"], row_group_size=1)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)

    with pytest.raises(DataError, match=r"t\.parquet: reading Parquet files needs pyarrow \(pip install pyarrow\)"):
        list(read_records(path))


# -- URLs, braces, globs -------------------------------------------------------------------


def test_brace_expansion_and_globs(tmp_path):
    assert expand_braces("s{1..3}.jsonl") == ["s1.jsonl", "s2.jsonl", "s3.jsonl"]
    assert expand_braces("s{08..10}") == ["s08", "s09", "s10"]
    assert expand_braces("{a,b{c,d}}.txt") == ["a.txt", "bc.txt", "bd.txt"]
    assert expand_braces("{x}") == ["{x}"]

    for i in range(1, 4):
        write_jsonl(tmp_path / f"train.{i}-of-3.jsonl", [f"doc {i}"])
    (tmp_path / "extra.txt").write_text("extra\n")
    (tmp_path / "more.txt").write_text("more\n")

    braces = UrlSourceConfig(train_urls=[str(tmp_path / "train.{1..3}-of-3.jsonl"), str(tmp_path / "{extra,more}.txt")])
    assert texts_of(braces) == ["doc 1", "doc 2", "doc 3", "extra", "more"]

    globbed = UrlSourceConfig(train_urls=str(tmp_path / "*.jsonl"))
    assert globbed.shards("train") == [str(tmp_path / f"train.{i}-of-3.jsonl") for i in range(1, 4)]
    assert texts_of(globbed) == ["doc 1", "doc 2", "doc 3"]


def test_memory_and_file_urls(tmp_path):
    fs = fsspec.filesystem("memory")
    for i in range(2):
        with fs.open(f"/corpus/part-{i}.jsonl.gz", "wb") as f:
            f.write(gzip.compress(json.dumps({"text": f"in memory {i}"}).encode() + b"\n"))
    local = write_jsonl(tmp_path / "local.jsonl", ["on disk"])
    config = UrlSourceConfig(train_urls=["memory://corpus/part-*.jsonl.gz", f"file://{local}"])

    assert config.shards("train") == [
        "memory:///corpus/part-0.jsonl.gz",
        "memory:///corpus/part-1.jsonl.gz",
        f"file://{local}",
    ]
    assert texts_of(config) == ["in memory 0", "in memory 1", "on disk"]
    assert next(config.records("train", f"file://{local}")).where == f"file://{local}:1"
    fs.rm("/corpus", recursive=True)


def test_http_urls(tmp_path):
    write_jsonl(tmp_path / "served.jsonl", ["over http"])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/served.jsonl"
    config = UrlSourceConfig(train_urls=[url])
    try:
        assert texts_of(config) == ["over http"]
        assert config.fingerprint("train")["shards"][url]["size"] == os.path.getsize(tmp_path / "served.jsonl")
        gz = write_jsonl(tmp_path / "served.jsonl.gz", ["compressed, over http"], compress="gz")
        assert texts_of(UrlSourceConfig(train_urls=[url.replace("served.jsonl", os.path.basename(gz))])) == [
            "compressed, over http"
        ]
    finally:
        server.shutdown()
        server.server_close()


def test_pattern_matching_no_file_is_named(tmp_path):
    pattern = str(tmp_path / "shard.{1..2}.jsonl")

    with pytest.raises(DataError, match=r"data\.validation_urls\[0\]: .*shard\.\{1\.\.2\}\.jsonl' matches no file"):
        UrlSourceConfig(validation_urls=[pattern]).fingerprint("validation")


# -- resuming at a record ------------------------------------------------------------------


def test_start_skips_records_without_parsing_them(tmp_path):
    path = tmp_path / "a.jsonl"
    # The skipped records are broken: reading past them must not even decode them.
    path.write_bytes(b'{"text": broken\n\n\xff\xfe not utf-8\n{"text": "third"}\n\n{"text": "fourth"}\n')

    resumed = list(read_records(str(path), start=2))

    assert values(resumed) == [{"text": "third"}, {"text": "fourth"}]
    assert [r.where for r in resumed] == [f"{path}:4", f"{path}:6"]
    assert list(read_records(str(path), start=4)) == []


@pytest.mark.parametrize("start", [0, 1, 3, 4, 9, 10, 11])
def test_start_in_parquet_json_and_compressed_files(tmp_path, start):
    texts = [f"t{i}" for i in range(10)]
    parquet = write_parquet(tmp_path / "t.parquet", texts, row_group_size=3)
    array = tmp_path / "a.json.zst"
    array.write_bytes(zstandard.ZstdCompressor().compress(json.dumps([{"text": t} for t in texts]).encode()))
    lines = write_jsonl(tmp_path / "l.jsonl.zst", texts, compress="zst")

    for path, where in ((parquet, "row"), (str(array), "item")):
        records = list(read_records(path, start))
        assert [r.value["text"] for r in records] == texts[start:]
        assert [r.where for r in records] == [f"{path}:{where} {n}" for n in range(start, 10)]
    assert [r.value["text"] for r in read_records(lines, start)] == texts[start:]


# -- bad data ------------------------------------------------------------------------------


def test_bad_lines_are_yielded_as_errors_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\n{"text": "no closing quote}\n["a list"]\ncaf\xe9\n{"text": "still read"}\n')

    records = list(read_records(str(path)))

    assert [r.where for r in records] == [f"{path}:{n}" for n in (1, 3, 4, 5, 6)]
    assert records[0].value == {"text": "ok"} and records[4].value == {"text": "still read"}
    errors = [str(r.value) for r in records[1:4]]
    assert errors[0].startswith(f"{path}:3: not valid JSON (Unterminated string")
    assert errors[1] == f'{path}:4: expected a JSON object, found ["a list"]'
    assert errors[2] == f"{path}:5: not UTF-8 text (byte 0xe9 at column 4)"


def test_text_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("fine\ncafé\n".encode("latin-1"))

    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        texts_of(UrlSourceConfig(train_urls=[str(path)]))


def test_bad_json_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"text": "a"},\n  {"text": }\n]')
    two_lists = tmp_path / "two.json"
    two_lists.write_text(json.dumps({"train": [{"text": "a"}], "test": []}))
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps([{"text": "a"}, "not an object"]))

    (bad,) = read_records(str(broken))
    assert bad.where == f"{broken}:3"
    assert str(bad.value).startswith(f"{broken}:3: not valid JSON (Expecting value at column 12)")
    assert list(read_records(str(broken), start=1)) == []

    (bad,) = read_records(str(two_lists))
    assert "exactly one list of objects; found an object with keys 'train', 'test'" in str(bad.value)

    good, bad = read_records(str(mixed))
    assert good.value == {"text": "a"}
    assert str(bad.value) == f'{mixed}:item 1: expected a JSON object, found "not an object"'


def test_unreadable_file_raises(tmp_path):
    path = tmp_path / "truncated.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40])
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")

    with pytest.raises(DataError, match=r"truncated\.jsonl\.gz: cannot read the file \(EOFError"):
        list(read_records(str(path)))
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable Parquet file"):
        list(read_records(str(not_parquet)))


# -- fingerprints --------------------------------------------------------------------------


def test_shard_fingerprint_changes_only_for_the_changed_file(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["one"])
    b = write_jsonl(tmp_path / "b.jsonl", ["two"])
    config = UrlSourceConfig(train_urls=[a, b])
    before = config.fingerprint("train")

    write_jsonl(tmp_path / "b.jsonl", ["two, longer"])
    grown = config.fingerprint("train")
    os.utime(b, ns=(0, os.stat(b).st_mtime_ns + 10**9))  # same size, rewritten a second later
    touched = config.fingerprint("train")

    assert list(before["shards"]) == [a, b]
    assert grown["shards"][a] == touched["shards"][a] == before["shards"][a]
    assert grown["shards"][b]["size"] != before["shards"][b]["size"]
    assert touched["shards"][b]["size"] == grown["shards"][b]["size"]
    assert touched["shards"][b] != grown["shards"][b]


def test_memory_fingerprint_changes_when_rewritten():
    fs = fsspec.filesystem("memory")
    fs.pipe("/fp/a.txt", b"one\n")
    config = UrlSourceConfig(train_urls=["memory://fp/a.txt"])
    before = config.fingerprint("train")["shards"]["memory://fp/a.txt"]

    fs.pipe("/fp/a.txt", b"two\n")
    after = config.fingerprint("train")["shards"]["memory://fp/a.txt"]

    assert before["size"] == after["size"] == 4 and before != after
    fs.rm("/fp", recursive=True)


# -- python_stdlib -------------------------------------------------------------------------


def test_stdlib_source_is_large_disjoint_and_stable():
    config = PythonStdlibSourceConfig()
    train, validation = config.files("train"), config.files("validation")

    assert len(train) + len(validation) > 500
    assert 0 < len(validation) < len(train) / 5
    assert not set(train) & set(validation)
    assert not any("test" in p.split(os.sep)[:-1] for p in train)
    assert PythonStdlibSourceConfig().files("validation") == validation
    assert PythonStdlibSourceConfig(max_files=3).files("train") == train[:3]


def test_stdlib_shards_records_and_start():
    config = PythonStdlibSourceConfig(max_files=40)
    shards = config.shards("train")

    assert shards == ["files[0:32]", "files[32:40]"]
    assert list(config.fingerprint("train")["shards"]) == shards
    records = list(config.records("train", shards[1]))
    assert len(records) == 8 and all(isinstance(r.value, str) for r in records)
    with open(records[0].where, encoding="utf-8") as f:
        assert records[0].value == f.read()
    assert [r.where for r in config.records("train", shards[1], start=6)] == [r.where for r in records[6:]]


# -- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    text = "héllo wörld ✓ 🙂"

    (ids,) = tok.encode_batch([text])

    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([ids, [EOS], ids[:5]])) == text + "<|endoftext|>" + "héll"
    assert (tok.vocab_size, tok.eos_id) == (257, EOS)


def test_byte_tokenizer_offsets_are_characters():
    tok = load_tokenizer("byte")

    ((ids, offsets),) = tok.encode_with_offsets(["é<|endoftext|>a"])

    assert ids.tolist() == [0xC3, 0xA9, EOS, ord("a")]
    assert offsets.tolist() == [[0, 1], [0, 1], [1, 14], [14, 15]]


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    texts = ["the cat sat on the mat", "the dog ate the hat"] * 20
    train_bpe_tokenizer(texts, str(directory / "tokenizer.json"), vocab_size=300)
    return directory


def test_hf_tokenizer_from_file_and_directory(hf_tokenizer_dir):
    from_file = load_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    from_dir = load_tokenizer(str(hf_tokenizer_dir))
    text = "the cat ate the hat"

    (ids,) = from_file.encode_batch([text])
    ((same_ids, offsets),) = from_file.encode_with_offsets([text])

    assert len(ids) < len(text)  # merges were learned
    assert from_dir.encode_batch([text])[0].tolist() == ids.tolist() == same_ids.tolist()
    assert "".join(text[s:e] for s, e in offsets) == text
    assert from_file.decode(ids) == text
    assert from_file.eos_id == 0  # the first special token
    assert from_file.chat_template is None and from_file.bos_token is None
    assert from_file.fingerprint == from_dir.fingerprint != load_tokenizer("byte").fingerprint


def test_tokenizer_config_gives_chat_template_and_special_tokens(hf_tokenizer_dir):
    plain = load_tokenizer(str(hf_tokenizer_dir))
    config = {
        "eos_token": {"content": "<|endoftext|>"},
        "bos_token": "<|endoftext|>",
        "chat_template": "{{ messages }}",
    }
    (hf_tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))

    tok = load_tokenizer(str(hf_tokenizer_dir))

    assert (tok.chat_template, tok.bos_token, tok.eos_token) == ("{{ messages }}", "<|endoftext|>", "<|endoftext|>")
    assert tok.fingerprint != plain.fingerprint  # chats would render differently

    (hf_tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool", "template": "x"}]})
    )
    (hf_tokenizer_dir / "chat_template.jinja").write_text("{{ bos_token }}")
    assert load_tokenizer(str(hf_tokenizer_dir)).chat_template == "{{ bos_token }}"

    (hf_tokenizer_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer_config\.json:1: not valid JSON"):
        load_tokenizer(str(hf_tokenizer_dir))


def test_unknown_tokenizer_is_an_error(tmp_path):
    # (Hub names such as gpt2 are read through the Hugging Face cache: tests/test_tokenizer_hub.py.)
    with pytest.raises(DataError, match="missing.json.*neither 'byte', an existing tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))
