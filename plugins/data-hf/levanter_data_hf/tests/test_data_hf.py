"""The ``type: hf`` data source on datasets each test builds in ``tmp_path``, offline:
directories of JSON-lines and Parquet files, ``save_to_disk`` output, streaming and not."""

import json
import os
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import levanter_core.plugins as plugins
import levanter_data_hf.loading
import levanter_data_hf.plugin
from levanter_core.data.cache import open_cache
from levanter_core.data.config import validate_data_section
from levanter_core.data.formats import TextFormat
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import DataError
from levanter_data_hf import HfSourceConfig

TRAIN_FILES = {"train-00000-of-00002": 7, "train-00001-of-00002": 5}


def _rows(stem: str, count: int) -> list[dict]:
    return [{"text": f"{stem} document {i}", "n": i} for i in range(count)]


def _expected(split: str) -> list[dict]:
    if split == "validation":
        return _rows("validation", 3)
    return [row for stem, count in TRAIN_FILES.items() for row in _rows(stem, count)]


@pytest.fixture
def jsonl_dir(tmp_path):
    """Two training files (12 rows) and one validation file (3 rows), split by file name."""
    directory = tmp_path / "jsonl"
    directory.mkdir()
    for stem, count in {**TRAIN_FILES, "validation": 3}.items():
        with open(directory / f"{stem}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in _rows(stem, count))
    return str(directory)


@pytest.fixture
def parquet_dir(tmp_path):
    """The same rows as ``jsonl_dir``, as Parquet files under ``data/`` named the way the
    hub names them (``{split}-{i:05d}-of-{n:05d}``)."""
    directory = tmp_path / "parquet" / "data"
    directory.mkdir(parents=True)
    for stem, count in TRAIN_FILES.items():
        pq.write_table(pa.Table.from_pylist(_rows(stem, count)), directory / f"{stem}.parquet", row_group_size=2)
    pq.write_table(pa.Table.from_pylist(_expected("validation")), directory / "validation-00000-of-00001.parquet")
    return str(directory.parent)


@pytest.fixture
def saved_dict(tmp_path):
    """A ``DatasetDict`` with the same rows, written by ``save_to_disk``."""
    path = str(tmp_path / "saved")
    splits = {split: datasets.Dataset.from_list(_expected(split)) for split in ("train", "validation")}
    datasets.DatasetDict(splits).save_to_disk(path)
    return path


def _all_records(source: HfSourceConfig, split: str) -> list:
    return [record for shard in source.shards(split) for record in source.records(split, shard)]


# -- reading ---------------------------------------------------------------------------------


def test_a_directory_of_jsonl_files_is_read_in_row_shards(jsonl_dir):
    source = HfSourceConfig(id=jsonl_dir, rows_per_shard=5)
    assert source.shards("train") == ["rows[0:5]", "rows[5:10]", "rows[10:12]"]
    records = _all_records(source, "train")
    assert [r.value for r in records] == _expected("train")
    assert records[6].where == f"{jsonl_dir}:train:row 6"
    assert [r.value for r in _all_records(source, "validation")] == _expected("validation")


@pytest.mark.parametrize("data", ["jsonl_dir", "parquet_dir", "saved_dict"])
def test_streaming_gives_the_same_records_as_preparing(data, request):
    path = request.getfixturevalue(data)
    prepared, streamed = HfSourceConfig(id=path, rows_per_shard=4), HfSourceConfig(id=path, stream=True)
    for split in ("train", "validation"):
        assert [r.value for r in _all_records(streamed, split)] == [r.value for r in _all_records(prepared, split)]
        assert [r.value for r in _all_records(prepared, split)] == _expected(split)
    # file datasets stream one shard per data file; a saved dataset one per Arrow file
    assert streamed.shards("train") == (["shard[0/1]"] if data == "saved_dict" else ["shard[0/2]", "shard[1/2]"])


@pytest.mark.parametrize("stream", [False, True])
def test_start_resumes_a_shard_where_it_stopped(jsonl_dir, stream):
    source = HfSourceConfig(id=jsonl_dir, stream=stream, rows_per_shard=5)
    for shard in source.shards("train"):
        whole = list(source.records("train", shard))
        for start in (1, 3, len(whole)):
            assert list(source.records("train", shard, start)) == whole[start:]
    second = source.shards("train")[1]
    resumed = next(source.records("train", second, 2))
    # streamed, shard[1/2] is the second file, which starts at row 7
    assert resumed.value == _expected("train")[9 if stream else 7]
    assert resumed.where.endswith(f"{second}:row 2" if stream else ":train:row 7")


def test_a_single_saved_dataset_is_the_train_split(tmp_path):
    path = str(tmp_path / "one")
    datasets.Dataset.from_list(_rows("only", 4)).save_to_disk(path)
    source = HfSourceConfig(id=path)
    assert [r.value for r in _all_records(source, "train")] == _rows("only", 4)
    assert not source.has_split("validation")


def test_records_feed_the_text_format(parquet_dir):
    source = HfSourceConfig(id=parquet_dir, format={"type": "text", "text_key": "text"})
    records = list(source.records("validation", "rows[0:3]"))
    tokenizer = load_tokenizer("byte")
    encoded = source.format.encode_batch([r.value for r in records], [r.where for r in records], tokenizer, None)
    assert [tokenizer.decode(e.ids) for e in encoded] == [row["text"] for row in _expected("validation")]
    missing = TextFormat(text_key="body").encode_batch([records[0].value], [records[0].where], tokenizer, None)
    assert isinstance(missing[0], DataError) and f"{parquet_dir}:validation:row 0: no 'body' field" in str(missing[0])


# -- splits ------------------------------------------------------------------------------------


def test_without_a_validation_split_there_is_no_validation(tmp_path):
    directory = tmp_path / "train-only"
    directory.mkdir()
    (directory / "train.jsonl").write_text('{"text": "a"}\n')
    assert HfSourceConfig(id=str(directory)).has_split("train")
    assert not HfSourceConfig(id=str(directory)).has_split("validation")
    assert not HfSourceConfig(id=str(directory), validation_split=None).has_split("validation")


def test_a_named_split_that_does_not_exist_lists_the_splits(jsonl_dir):
    named = HfSourceConfig(id=jsonl_dir, validation_split="test")
    assert named.has_split("validation")  # named explicitly: its absence is an error, not "no validation"
    listing = r"validation_split: dataset .* has no split 'test'; its splits are 'train', 'validation'"
    with pytest.raises(DataError, match=listing):
        named.shards("validation")
    with pytest.raises(DataError, match=r"train_split: .* has no split 'tarin'"):
        HfSourceConfig(id=jsonl_dir, train_split="tarin", stream=True).shards("train")


def test_configuration_names_select_data_files_and_unknown_ones_are_listed(tmp_path):
    directory = tmp_path / "configs"
    directory.mkdir()
    (directory / "small.jsonl").write_text('{"text": "s"}\n')
    (directory / "large.jsonl").write_text('{"text": "l1"}\n{"text": "l2"}\n')
    (directory / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files: small.jsonl\n  default: true\n"
        "- config_name: large\n  data_files: large.jsonl\n---\n"
    )
    large = HfSourceConfig(id=str(directory), name="large")
    assert [r.value["text"] for r in _all_records(large, "train")] == ["l1", "l2"]
    with pytest.raises(DataError, match=r"name: dataset .* has no configuration 'medium'; it has: small, large"):
        HfSourceConfig(id=str(directory), name="medium").shards("train")


def test_data_files_choose_the_files_of_each_split(jsonl_dir):
    files = {"train": "validation.jsonl", "validation": ("train-00001-of-00002.jsonl",)}
    source = HfSourceConfig(id=jsonl_dir, data_files=files)
    assert [r.value for r in _all_records(source, "train")] == _expected("validation")
    assert [r.value for r in _all_records(source, "validation")] == _rows("train-00001-of-00002", 5)
    fingerprint = source.fingerprint("validation")
    assert json.loads(json.dumps(fingerprint)) == fingerprint


# -- fingerprints --------------------------------------------------------------------------------


def _rewrite(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later edit, even on coarse clocks


@pytest.mark.parametrize("stream", [False, True])
def test_fingerprint_is_stable_and_follows_the_files(jsonl_dir, stream):
    source = HfSourceConfig(id=jsonl_dir, stream=stream, rows_per_shard=5)
    before = source.fingerprint("train")
    assert set(before["shards"]) == set(source.shards("train"))
    assert before["type"] == "hf" and before["stream"] == stream and before["split"] == "train"
    assert json.loads(json.dumps(before)) == before  # compares equal once stored in a cache ledger
    levanter_data_hf.loading.load.cache_clear()
    assert source.fingerprint("train") == before  # the same inputs, loaded again

    _rewrite(os.path.join(jsonl_dir, "train-00001-of-00002.jsonl"), _rows("edited", 5))
    levanter_data_hf.loading.load.cache_clear()
    after = source.fingerprint("train")
    first, second = source.shards("train")[:2] if stream else (None, source.shards("train")[-1])
    assert after["shards"][second] != before["shards"][second]
    if stream:  # only the edited file's shard changed
        assert after["shards"][first] == before["shards"][first]
    assert source.fingerprint("validation")["shards"] != after["shards"]


def test_saved_dataset_fingerprint_is_its_own(saved_dict):
    prepared = HfSourceConfig(id=saved_dict).fingerprint("train")
    assert set(prepared["shards"].values()) == {datasets.load_from_disk(saved_dict)["train"]._fingerprint}
    streamed = HfSourceConfig(id=saved_dict, stream=True).fingerprint("train")
    (entry,) = streamed["shards"].values()
    assert entry["files"][0][0].endswith(".arrow") and entry["files"][0][1] > 0


# -- errors --------------------------------------------------------------------------------------


def test_missing_local_directory_and_unreachable_hub_id(tmp_path):
    with pytest.raises(DataError, match=r"no dataset '.*/nowhere': no such directory"):
        HfSourceConfig(id=str(tmp_path / "nowhere")).shards("train")
    with pytest.raises(DataError, match=r"no dataset 'nobody/nothing': .*\(offline: hub ids need network"):
        HfSourceConfig(id="nobody/nothing").shards("train")


def test_a_saved_dataset_has_no_configuration_name(saved_dict):
    with pytest.raises(DataError, match=r"name: .* was written by save_to_disk and has no name; remove name \('en'\)"):
        HfSourceConfig(id=saved_dict, name="en").shards("train")


def test_an_unparseable_file_is_a_data_error(tmp_path):
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "train.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"dataset '.*broken': cannot prepare it \(JSON parse error"):
        HfSourceConfig(id=str(directory)).shards("train")
    streamed = HfSourceConfig(id=str(directory), stream=True)
    with pytest.raises(DataError, match=r"broken:train:shard\[0/1\]: cannot read from row 0 on \(ArrowInvalid"):
        list(streamed.records("train", "shard[0/1]"))


def test_a_shard_name_from_another_listing_is_refused(jsonl_dir):
    with pytest.raises(DataError, match=r"no shard 'rows\[0:99\]' in the train split \(it has 12 rows\)"):
        list(HfSourceConfig(id=jsonl_dir).records("train", "rows[0:99]"))
    with pytest.raises(DataError, match=r"no shard 'shard\[0/3\]' in the streamed train split \(it has 2 shards\)"):
        list(HfSourceConfig(id=jsonl_dir, stream=True).records("train", "shard[0/3]"))


def test_local_paths_never_touch_the_network(jsonl_dir, saved_dict, tmp_path):
    """With the offline switches off, loading local data opens no connection."""
    script = f"""
import socket
def refuse(*args, **kwargs):
    raise AssertionError(f"network access: {{args}}")
socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse
from levanter_data_hf import HfSourceConfig
for path in ({jsonl_dir!r}, {saved_dict!r}):
    for stream in (False, True):
        source = HfSourceConfig(id=path, stream=stream)
        source.fingerprint("train")
        assert len([r for s in source.shards("validation") for r in source.records("validation", s)]) == 3
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "online-cache")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


# -- through the core ----------------------------------------------------------------------------


@pytest.fixture
def hf_plugin_only():
    """The core's built-ins plus this plugin, registered in process (installed or not)."""
    plugins.reset(autoload=False)
    plugins.register_plugin(levanter_data_hf.plugin, name="hf")
    yield
    plugins.reset()


def test_a_data_section_with_an_id_selects_the_hf_source(hf_plugin_only, jsonl_dir, tmp_path):
    data = validate_data_section(
        {"id": jsonl_dir, "cache_dir": str(tmp_path / "cache"), "format": {"type": "text", "text_key": "text"}}
    )
    source = data.configs["main"]
    assert isinstance(source, HfSourceConfig) and source.type == "hf"
    assert data.cache_path("main", "train") == f"{tmp_path}/cache/train"
    assert [r.value for r in _all_records(source, "train")] == _expected("train")
    assert validate_data_section({"train_urls": ["x.jsonl"]}).configs["main"].type == "url"


def test_the_entry_point_registers_the_plugin():
    """``pip install levanter-data-hf`` is all it takes: the core finds ``type: hf``."""
    manager = plugins.reset(autoload=True)
    try:
        entry = manager.registry("data_source").get("hf")
        assert (entry.config_cls, entry.distribution) == (HfSourceConfig, "levanter-data-hf")
    finally:
        plugins.reset()


def test_datasets_is_imported_only_to_read_a_dataset(jsonl_dir):
    """``datasets`` (with pyarrow and pandas, about a second) loads when a dataset is read, not
    when a config is validated: every ``levanter`` command validates one, and every data
    section without a ``type`` asks each source whether it is inferred from its keys."""
    script = f"""
import sys
from levanter_core.data.config import validate_data_section
assert validate_data_section({{"train_urls": ["x.jsonl"]}}).configs["main"].type == "url"
source = validate_data_section({{"id": {jsonl_dir!r}}}).configs["main"]
assert source.type == "hf" and "datasets" not in sys.modules, "validating imported datasets"
assert source.shards("train") == ["rows[0:12]"] and "datasets" in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("stream, workers", [(False, 2), (True, 1)])
def test_a_tokenized_cache_builds_from_the_source(jsonl_dir, tmp_path, stream, workers):
    source = HfSourceConfig(id=jsonl_dir, stream=stream, rows_per_shard=5)
    tokenizer = load_tokenizer("byte")
    path = str(tmp_path / "cache" / "train")

    def build():
        settings = dict(enforce_eos=True, skip_bad_data=False, num_workers=workers, background=False)
        return open_cache(path, source, "train", tokenizer, **settings)

    cache = build()
    assert cache.complete and cache.num_documents == 12
    texts = tokenizer.decode(cache.tokens(0, cache.num_tokens))
    assert texts == "".join(row["text"] + "<|endoftext|>" for row in _expected("train"))
    assert build().num_tokens == cache.num_tokens  # reused as it is

    _rewrite(os.path.join(jsonl_dir, "train-00000-of-00002.jsonl"), _rows("edited", 7))
    levanter_data_hf.loading.load.cache_clear()
    with pytest.raises(DataError, match=r"input (shard\[0/2\]|rows\[0:5\]) changed after it was cached") as refused:
        build()
    if stream:  # only the edited file's shard is stale
        assert "shard[1/2]" not in str(refused.value)
