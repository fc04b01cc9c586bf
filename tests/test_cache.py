"""The tokenized cache: built once (by worker processes, or by threads of this process when the
input is small), reused, refused when stale, readable while it grows."""

import json
import logging
import os
import time

import numpy as np
import pytest

from levanter_core.data.cache import _storage, open_cache, read_cache
from levanter_core.data.config import CacheOptions
from levanter_core.data.formats import TextFormat
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer, HfTokenizer
from levanter_core.errors import DataError

BYTE = ByteTokenizer()
PROCESSES = CacheOptions(in_process_below=0)
"""Worker processes however little there is to tokenize."""


def write_corpus(directory, files: int, lines: int, key: str = "text") -> list[str]:
    """``files`` JSON-lines files of ``lines`` short documents each; returns their texts in order."""
    os.makedirs(directory, exist_ok=True)
    texts = []
    for i in range(files):
        with open(os.path.join(directory, f"part{i:02d}.jsonl"), "w") as f:
            for j in range(lines):
                text = f"file {i} line {j} " + "é" * (j % 5)
                texts.append(text)
                f.write(json.dumps({key: text}) + "\n")
    return texts


def source(directory, **kwargs) -> UrlSourceConfig:
    return UrlSourceConfig(train_urls=[f"{directory}/part*.jsonl"], **kwargs)


def build(path, src, tokenizer=BYTE, **kwargs):
    options = dict(enforce_eos=True, skip_bad_data=False, background=False) | kwargs
    return open_cache(str(path), src, "train", tokenizer, **options)


def contents(path) -> tuple[dict, dict]:
    """The ledger without its timestamp, and every stored array up to the ledger's counts."""
    storage = _storage(str(path))
    ledger = storage.read_ledger()
    ledger.pop("updated")
    arrays = {}
    for i, shard in enumerate(ledger["shards"]):
        for name, length in (("tokens", shard["tokens"]), ("offsets", shard["documents"] + 1)):
            arrays[f"{i}/{name}"] = storage.open_array(f"shards/{i:05d}/{name}")[:length].read().result()
    return ledger, arrays


def assert_same_cache(a, b):
    ledger_a, arrays_a = contents(a)
    ledger_b, arrays_b = contents(b)
    assert ledger_a == ledger_b
    assert arrays_a.keys() == arrays_b.keys()
    for key in arrays_a:
        assert arrays_a[key].dtype == arrays_b[key].dtype
        np.testing.assert_array_equal(arrays_a[key], arrays_b[key], err_msg=key)


def expected_tokens(texts) -> np.ndarray:
    return np.concatenate([np.append(ids, BYTE.eos_id) for ids in BYTE.encode_batch(texts)])


def test_built_once_then_reused(tmp_path, caplog):
    texts = write_corpus(tmp_path / "data", files=3, lines=1500)
    cache = build(tmp_path / "cache", source(tmp_path / "data"), num_workers=2)

    assert cache.complete and cache.num_documents == 4500
    np.testing.assert_array_equal(cache.tokens(0, cache.num_tokens), expected_tokens(texts))
    offsets = cache.document_offsets()
    assert offsets[0] == 0 and offsets[-1] == cache.num_tokens and len(offsets) == 4501
    assert BYTE.decode(cache.tokens(int(offsets[1500]), int(offsets[1501]))) == "file 1 line 0 <|endoftext|>"
    ledger = cache.ledger
    assert ledger["identity"] == {
        "tokenizer": "byte-v1",
        "vocab_size": 257,
        "eos_id": 256,
        "format": {"type": "text", "text_key": "text"},
        "enforce_eos": True,
    }
    assert ledger["token_dtype"] == "uint16" and ledger["num_tokens"] == len(expected_tokens(texts))
    assert [s["name"].rsplit("/", 1)[1] for s in ledger["shards"]] == ["part00.jsonl", "part01.jsonl", "part02.jsonl"]
    assert all(
        s["finished"] and s["records"] == s["documents"] == 1500 and s["skipped"] == {} for s in ledger["shards"]
    )
    assert sum(s["tokens"] for s in ledger["shards"]) == ledger["num_tokens"]

    ledger_file = tmp_path / "cache" / "ledger.json"
    written = ledger_file.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="levanter_core.data.cache"):
        again = build(tmp_path / "cache", source(tmp_path / "data"))
    assert next(r.message for r in caplog.records if "cache" in r.message).startswith("reusing the cache")
    assert not any(r.message.startswith("built") for r in caplog.records)
    assert ledger_file.stat().st_mtime_ns == written
    np.testing.assert_array_equal(again.tokens(100, 200), cache.tokens(100, 200))


def test_number_of_workers_does_not_change_the_cache(tmp_path):
    """One thread of this process (the corpus is under ``in_process_below``), and two worker
    processes: the same cache."""
    write_corpus(tmp_path / "data", files=4, lines=1200)
    build(tmp_path / "one", source(tmp_path / "data"), num_workers=1)
    build(tmp_path / "two", source(tmp_path / "data"), num_workers=2, cache_options=PROCESSES)
    assert_same_cache(tmp_path / "one", tmp_path / "two")


def test_a_small_input_is_tokenized_in_process_and_a_larger_one_by_worker_processes(tmp_path, caplog):
    write_corpus(tmp_path / "data", files=2, lines=300)  # about 13 KB
    said = "in this process"
    with caplog.at_level(logging.DEBUG, logger="levanter_core.data.cache"):
        build(tmp_path / "small", source(tmp_path / "data"))
    assert any(said in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="levanter_core.data.cache"):
        build(tmp_path / "large", source(tmp_path / "data"), cache_options=CacheOptions(in_process_below="10KB"))
    assert not any(said in r.message for r in caplog.records)
    assert_same_cache(tmp_path / "small", tmp_path / "large")


@pytest.mark.parametrize(("value", "expected"), [("1MB", 1_000_000), (0, 0), ("0", 0), (4096, 4096)])
def test_in_process_below_reads_a_size_or_zero(value, expected):
    assert CacheOptions(in_process_below=value).in_process_bytes == expected


def test_in_process_below_refuses_a_negative_size():
    with pytest.raises(ValueError, match="in_process_below"):
        CacheOptions(in_process_below="-1MB")


@pytest.fixture
def built(tmp_path):
    write_corpus(tmp_path / "data", files=2, lines=10, key="body")
    src = source(tmp_path / "data", format=TextFormat(text_key="body"))
    build(tmp_path / "cache", src)
    return tmp_path, src


def test_refuses_another_tokenizer(built):
    tmp_path, src = built
    other = HfTokenizer(str(tmp_path / "tok.json"), BYTE.to_tokenizer_json())
    with pytest.raises(
        DataError, match=r"tokenizer 'byte'\): tokenizer \(cached: 'byte-v1', now: 'hf-.*remove .*cache"
    ):
        build(tmp_path / "cache", src, tokenizer=other)


def test_refuses_another_format(built):
    tmp_path, _ = built
    with pytest.raises(
        DataError, match=r"format \(cached: \{'type': 'text', 'text_key': 'body'\}, now: .*'text_key': 'text'"
    ):
        build(tmp_path / "cache", source(tmp_path / "data"))


def test_refuses_another_enforce_eos(built):
    tmp_path, src = built
    with pytest.raises(DataError, match=r"enforce_eos \(cached: True, now: False\)"):
        build(tmp_path / "cache", src, enforce_eos=False)


def test_refuses_an_input_changed_after_it_was_cached(built):
    tmp_path, src = built
    with open(tmp_path / "data" / "part01.jsonl", "a") as f:
        f.write(json.dumps({"body": "one more document"}) + "\n")
    with pytest.raises(DataError, match=r"input .*part01.jsonl changed after it was cached"):
        build(tmp_path / "cache", src)


def test_bad_line_stops_the_build_with_its_place(tmp_path):
    write_corpus(tmp_path / "data", files=2, lines=5)
    with open(tmp_path / "data" / "part01.jsonl", "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"title": "no text"}) + "\n")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"part01.jsonl:6: not valid JSON.*skip_bad_data"):
        build(tmp_path / "cache", source(tmp_path / "data"), num_workers=2)
    assert time.monotonic() - start < 30
    ledger = json.loads((tmp_path / "cache" / "ledger.json").read_text())
    assert not ledger["complete"]

    cache = build(tmp_path / "cache", source(tmp_path / "data"), skip_bad_data=True)
    assert cache.complete and cache.num_documents == 10
    assert cache.skipped() == {"no 'text' field": 1, "not valid JSON": 1}
    assert cache.ledger["shards"][1]["skipped"] == {"no 'text' field": 1, "not valid JSON": 1}
    assert cache.ledger["shards"][1]["records"] == 7
    assert any("part01.jsonl:7: no 'text' field" in p for p in cache.problems())


def test_bad_line_fails_a_background_build_for_its_readers(tmp_path):
    write_corpus(tmp_path / "data", files=1, lines=3)
    with open(tmp_path / "data" / "part00.jsonl", "a") as f:
        f.write(json.dumps({"text": 5}) + "\n")
    cache = build(tmp_path / "cache", source(tmp_path / "data"), background=True)
    with pytest.raises(DataError, match=r"part00.jsonl:4: field 'text' should be a string"):
        cache.wait_complete()


def test_a_worker_process_that_dies_fails_the_build_instead_of_hanging(tmp_path):
    from slow_source import DyingUrlSourceConfig

    write_corpus(tmp_path / "data", files=2, lines=5)
    os.rename(tmp_path / "data" / "part01.jsonl", tmp_path / "data" / "part01-die.jsonl")
    dying = DyingUrlSourceConfig(train_urls=[f"{tmp_path}/data/part*.jsonl"])

    with pytest.raises(RuntimeError, match=r"a tokenizer worker process died \(exit code 9\)"):
        build(tmp_path / "cache", dying, num_workers=2, cache_options=PROCESSES)
    assert not json.loads((tmp_path / "cache" / "ledger.json").read_text())["complete"]


def test_empty_dataset_names_its_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part00.jsonl").write_text("\n\n")
    (tmp_path / "data" / "part01.jsonl").write_text("")
    with pytest.raises(DataError, match=r"train split has no documents: its inputs .*part00.jsonl, .*part01.jsonl"):
        build(tmp_path / "cache", source(tmp_path / "data"))


def test_missing_file(tmp_path):
    src = UrlSourceConfig(train_urls=[str(tmp_path / "absent.jsonl")])
    with pytest.raises(DataError, match=r"absent.jsonl'? matches no file"):
        build(tmp_path / "cache", src)


def test_background_build_grows_a_readable_prefix(tmp_path):
    texts = write_corpus(tmp_path / "data", files=30, lines=400)
    everything = expected_tokens(texts)
    cache = build(tmp_path / "cache", source(tmp_path / "data"), background=True)
    seen = []
    while not cache.complete:
        seen.append(cache.num_tokens)
        if seen[-1]:
            np.testing.assert_array_equal(cache.tokens(0, seen[-1]), everything[: seen[-1]])
        time.sleep(0.02)
    assert seen == sorted(seen)
    assert any(0 < n < len(everything) for n in seen), "never saw a partial prefix"
    assert cache.num_tokens == len(everything)

    again = build(tmp_path / "cache2", source(tmp_path / "data"), background=True)
    again.wait_for(documents=500)
    assert again.num_documents >= 500
    assert again.document_offsets()[500] == cache.document_offsets()[500]
    again.close()


def test_close_stops_a_build_that_resumes_later(tmp_path):
    write_corpus(tmp_path / "data", files=20, lines=400)
    cache = build(tmp_path / "cache", source(tmp_path / "data"), background=True)
    cache.wait_for(documents=1)
    cache.close()
    assert not json.loads((tmp_path / "cache" / "ledger.json").read_text())["complete"]
    with pytest.raises(DataError, match="stopped before it completed"):
        cache.wait_complete()
    build(tmp_path / "cache", source(tmp_path / "data"))
    build(tmp_path / "whole", source(tmp_path / "data"))
    assert_same_cache(tmp_path / "cache", tmp_path / "whole")


def test_reader_of_another_process_build(tmp_path):
    write_corpus(tmp_path / "data", files=2, lines=20)
    build(tmp_path / "cache", source(tmp_path / "data"))
    reader = read_cache(str(tmp_path / "cache"))
    reader.wait_complete()
    assert reader.num_documents == 40
    with pytest.raises(DataError, match="no tokenized cache here"):
        read_cache(str(tmp_path / "nothing"))


def test_memory_cache_dir_round_trip(tmp_path):
    texts = write_corpus(tmp_path / "data", files=2, lines=1500)
    url = f"memory://caches/{tmp_path.name}"
    cache = build(url, source(tmp_path / "data"), num_workers=2)
    np.testing.assert_array_equal(cache.tokens(0, cache.num_tokens), expected_tokens(texts))
    reopened = read_cache(url)
    assert reopened.complete and reopened.num_documents == 3000
    np.testing.assert_array_equal(reopened.tokens(10, 5000), expected_tokens(texts)[10:5000])
    build(tmp_path / "local", source(tmp_path / "data"))
    assert_same_cache(url, tmp_path / "local")


@pytest.mark.slow
def test_ray_builds_the_same_cache(tmp_path):
    from levanter_core.trainer.config import RayConfig

    ray = pytest.importorskip("ray")
    write_corpus(tmp_path / "data", files=2, lines=1200)
    try:
        build(tmp_path / "ray", source(tmp_path / "data"), ray=RayConfig(address="local"))
    finally:
        ray.shutdown()
    build(tmp_path / "local", source(tmp_path / "data"), num_workers=2)
    assert_same_cache(tmp_path / "ray", tmp_path / "local")
