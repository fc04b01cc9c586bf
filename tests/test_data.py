import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import zstandard

from levanter_core.data import (
    PythonStdlibSourceConfig,
    TokenSequenceDataset,
    UrlSourceConfig,
    build_lm_data,
    build_or_load_cache,
    expand_braces,
    load_tokenizer,
)
from levanter_core.errors import DataError

EOS = 256  # the byte tokenizer's <|endoftext|>


def write_jsonl(path, texts, compress=None):
    data = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    if compress == "gz":
        data = gzip.compress(data)
    elif compress == "zst":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return str(path)


def texts_of(config, split="train"):
    return [doc.text for doc in config.documents(split)]


def cache_dirs(cache_dir, split):
    return sorted(d for d in os.listdir(cache_dir) if d.startswith(f"{split}-"))


# -- reading -------------------------------------------------------------------------------


def test_reads_jsonl_plain_gz_zst_and_text_files(tmp_path):
    plain = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    gz = write_jsonl(tmp_path / "b.jsonl.gz", ["three"], compress="gz")
    zst = write_jsonl(tmp_path / "c.jsonl.zst", ["four"], compress="zst")
    txt = tmp_path / "d.txt"
    txt.write_text("five\n\nsix\n")
    config = UrlSourceConfig(train_urls=[plain, gz, zst, str(txt)])

    docs = list(config.documents("train"))

    assert [d.text for d in docs] == ["one", "two", "three", "four", "five", "six"]
    assert docs[1].where == f"{plain}:2"
    assert docs[-1].where == f"{txt}:3"


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
    assert texts_of(globbed) == ["doc 1", "doc 2", "doc 3"]


def test_stdlib_source_is_large_disjoint_and_stable():
    config = PythonStdlibSourceConfig()
    train, validation = config.files("train"), config.files("validation")

    assert len(train) + len(validation) > 500
    assert 0 < len(validation) < len(train) / 5
    assert not set(train) & set(validation)
    assert not any("test" in p.split(os.sep)[:-1] for p in train)
    assert PythonStdlibSourceConfig().files("validation") == validation
    assert PythonStdlibSourceConfig(max_files=3).files("train") == train[:3]


# -- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    text = "héllo wörld ✓ 🙂"

    (ids,) = tok.encode_batch([text])

    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([ids, [EOS], ids[:5]])) == text + "<|endoftext|>" + "héll"
    assert (tok.vocab_size, tok.eos_id) == (257, EOS)


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the hat"] * 20, trainer)
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_hf_tokenizer_from_file_and_directory(hf_tokenizer_dir):
    from_file = load_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    from_dir = load_tokenizer(str(hf_tokenizer_dir))
    text = "the cat ate the hat"

    (ids,) = from_file.encode_batch([text])

    assert len(ids) < len(text)  # merges were learned
    assert from_dir.encode_batch([text])[0].tolist() == ids.tolist()
    assert from_file.decode(ids) == text
    assert from_file.eos_id == 0  # the first special token
    assert from_file.fingerprint == from_dir.fingerprint != load_tokenizer("byte").fingerprint


def test_unknown_tokenizer_is_an_error(tmp_path):
    with pytest.raises(DataError, match="gpt2.*neither 'byte' nor"):
        load_tokenizer("gpt2")
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))


# -- the cache -----------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    texts = [f"document number {i} " * (i % 5 + 1) for i in range(50)]
    train = write_jsonl(tmp_path / "train.jsonl", texts)
    validation = write_jsonl(tmp_path / "validation.jsonl", texts[:5])
    return UrlSourceConfig(train_urls=[train], validation_urls=[validation], cache_dir=str(tmp_path / "cache"))


def test_documents_are_joined_with_eos(tmp_path):
    config = UrlSourceConfig(train_urls=[write_jsonl(tmp_path / "d.jsonl", ["ab", "", "cd"])], cache_dir=str(tmp_path))
    cache = build_or_load_cache(config, "train", load_tokenizer("byte"), progress=False)

    assert cache.tokens().tolist() == [97, 98, EOS, EOS, 99, 100, EOS]
    assert cache.document_offsets().tolist() == [0, 3, 4, 7]
    assert cache.tokens().dtype == np.uint16

    no_eos = config.model_copy(update={"enforce_eos": False})
    without = build_or_load_cache(no_eos, "train", load_tokenizer("byte"), progress=False)
    assert without.tokens().tolist() == [97, 98, 99, 100]


def test_cache_is_built_once_reused_across_seq_len_and_rebuilt_for_a_new_tokenizer(corpus, hf_tokenizer_dir, caplog):
    caplog.set_level(logging.INFO, logger="levanter_core.data.cache")
    first = build_lm_data(corpus, seq_len=16, seed=0, progress=False)
    (train_dir,) = cache_dirs(corpus.cache_dir, "train")
    ledger = os.path.join(corpus.cache_dir, train_dir, "ledger.json")
    built_at = os.stat(ledger).st_mtime_ns
    assert "built the train cache" in caplog.text
    caplog.clear()

    again = build_lm_data(corpus, seq_len=32, seed=0, progress=False)

    assert "reusing the train cache" in caplog.text and "built the" not in caplog.text
    assert os.stat(ledger).st_mtime_ns == built_at
    assert cache_dirs(corpus.cache_dir, "train") == [train_dir]
    assert len(again.train) == len(first.train) // 2
    assert np.array_equal(again.train.sequence(0), np.concatenate([first.train.sequence(0), first.train.sequence(1)]))
    assert json.load(open(ledger))["num_documents"] == 50

    other = corpus.model_copy(update={"tokenizer": str(hf_tokenizer_dir)})
    hf = build_lm_data(other, seq_len=16, seed=0, progress=False)
    assert len(cache_dirs(corpus.cache_dir, "train")) == 2
    assert hf.tokenizer.name == str(hf_tokenizer_dir) and len(hf.train) < len(first.train)


def test_incomplete_cache_is_never_used(corpus, caplog):
    caplog.set_level(logging.INFO, logger="levanter_core.data.cache")
    tok = load_tokenizer("byte")
    good = build_or_load_cache(corpus, "train", tok, progress=False)
    expected = good.tokens()
    # A build killed before finishing leaves a directory without a ledger.
    os.remove(os.path.join(good.path, "ledger.json"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = f"{good.path}.building.{socket.gethostname()}.{dead.stdout.strip()}"
    os.makedirs(abandoned)
    caplog.clear()

    rebuilt = build_or_load_cache(corpus, "train", tok, progress=False)

    assert "built the train cache" in caplog.text
    assert rebuilt.path == good.path and np.array_equal(rebuilt.tokens(), expected)
    assert not os.path.exists(abandoned)


def test_failed_build_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    config = UrlSourceConfig(train_urls=[str(bad)], cache_dir=str(tmp_path / "cache"))

    with pytest.raises(DataError):
        build_lm_data(config, seq_len=4, seed=0, progress=False)

    assert os.listdir(tmp_path / "cache") == []


# -- batches -------------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10 * 4, dtype=np.uint16)  # 10 sequences of 4
    data = TokenSequenceDataset(tokens, 4, seed=1)
    first_of = lambda batch: (batch[:, 0] // 4).tolist()  # noqa: E731 — which sequence each row is

    resumed = TokenSequenceDataset(tokens, 4, seed=1)
    assert np.array_equal(resumed.batch(7, 3), data.batch(7, 3))
    assert data.batch(7, 3).dtype == np.int32 and data.batch(7, 3).shape == (3, 4)

    epoch0 = first_of(np.concatenate([data.batch(s, 5) for s in range(2)]))
    epoch1 = first_of(np.concatenate([data.batch(s, 5) for s in range(2, 4)]))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))

    # A batch that straddles two epochs still covers each sequence once per epoch.
    stream = first_of(np.concatenate([data.batch(s, 3) for s in range(10)]))
    assert stream[:10] == epoch0 and sorted(stream[10:20]) == list(range(10))

    other_seed = TokenSequenceDataset(tokens, 4, seed=2)
    assert first_of(np.concatenate([other_seed.batch(s, 5) for s in range(2)])) != epoch0
    assert first_of(TokenSequenceDataset(tokens, 4, seed=1, shuffle=False).batch(1, 5)) == [5, 6, 7, 8, 9]


def test_eval_batches_are_sequential_and_wrap_a_tiny_set():
    data = TokenSequenceDataset(np.arange(7 * 2), 2, seed=0)

    batches = list(data.eval_batches(3, None))
    assert [b[:, 0].tolist() for b in batches] == [[0, 2, 4], [6, 8, 10]]
    assert len(list(data.eval_batches(3, max_batches=1))) == 1

    (tiny,) = list(data.eval_batches(10, None))
    assert tiny[:, 0].tolist() == [0, 2, 4, 6, 8, 10, 12, 0, 2, 4]


def test_stdlib_source_builds_sequences(tmp_path):
    config = PythonStdlibSourceConfig(max_files=4, cache_dir=str(tmp_path))

    data = build_lm_data(config, seq_len=64, seed=0, progress=False)

    assert len(data.train) > 20 and data.validation is not None and len(data.validation) > 0
    first_file = os.path.join(sysconfig.get_paths()["stdlib"], config.files("train")[0])
    with open(first_file, encoding="utf-8") as f:
        assert data.tokenizer.decode(data.train.sequence(0)) == f.read()[:64]


# -- errors people see ---------------------------------------------------------------------


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "no closing quote}\n')

    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        texts_of(UrlSourceConfig(train_urls=[str(path)]))


def test_missing_text_key_names_file_line_and_key(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["ok"])
    with open(path, "a") as f:
        f.write('{"content": "where is text?"}\n')

    with pytest.raises(DataError, match=rf"{path}:2: no 'text' field \(the object's fields: 'content'\)"):
        texts_of(UrlSourceConfig(train_urls=[path]))


def test_text_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("fine\ncafé\n".encode("latin-1"))

    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        texts_of(UrlSourceConfig(train_urls=[str(path)]))


def test_pattern_matching_no_file_is_named(tmp_path):
    pattern = str(tmp_path / "shard.{1..2}.jsonl")

    with pytest.raises(DataError, match=r"data\.validation_urls\[0\]: .*shard\.\{1\.\.2\}\.jsonl' matches no file"):
        UrlSourceConfig(validation_urls=[pattern]).fingerprint("validation")


def test_empty_dataset_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="hold no documents"):
        build_lm_data(UrlSourceConfig(train_urls=[str(empty)], cache_dir=str(tmp_path)), seq_len=8, seed=0)

    short = write_jsonl(tmp_path / "short.jsonl", ["tiny"])
    with pytest.raises(DataError, match="train split has 5 tokens, fewer than one sequence of seq_len 8"):
        build_lm_data(UrlSourceConfig(train_urls=[short], cache_dir=str(tmp_path)), seq_len=8, seed=0)

    with pytest.raises(DataError, match="no training data"):
        build_lm_data(UrlSourceConfig(cache_dir=str(tmp_path)), seq_len=8, seed=0)
