"""Levanter's data fields do what they do in Levanter: ``max_train_batches``, simulated epoching
(``target_budget`` / ``experiment_budget``), ``num_validation_sequences``, ``stop_strategy``,
``epoch`` (``max_epochs``), ``shuffle_buffer_size``, batch-size schedules and ``cache_options``.

Every document is 7 bytes (a source letter and a 6-digit number) plus the end-of-text token,
so with the byte tokenizer and ``seq_len`` 8 each sequence is exactly one document, named by
its text."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from levanter_core.data.cache import _Job, open_cache, tokenize_shard
from levanter_core.data.config import CacheOptions, validate_data_section
from levanter_core.data.dataset import eval_batches
from levanter_core.data.dataset.sequences import held_out_count
from levanter_core.data.executor import Progress, ShardTask, run_shards, shard_groups
from levanter_core.data.formats import TextFormat
from levanter_core.data.pipeline import build_lm_data
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.errors import DataError, DataExhausted
from levanter_core.testing import write_jsonl
from levanter_core.trainer.config import BatchSchedule

SEQ = 8


def docs(letter: str, n: int, offset: int = 0) -> list[dict]:
    return [{"text": f"{letter}{i:06d}"} for i in range(offset, offset + n)]


def names(batch) -> list[str]:
    """The document each row holds (``a000003``...)."""
    return [bytes(row[:7].astype(np.uint8).tolist()).decode() for row in batch.tokens]


def read(stream, steps, batch_size=4) -> list[str]:
    return [name for step in steps for name in names(stream.batch(step, batch_size))]


def source(tmp_path, letter: str, n: int, *, validation: int = 0) -> dict:
    section = {"train_urls": [write_jsonl(tmp_path / f"{letter}.jsonl", docs(letter, n))]}
    if validation:
        section["validation_urls"] = [write_jsonl(tmp_path / f"{letter}-val.jsonl", docs(letter, validation, 900))]
    return section


def single(tmp_path, n: int = 40, *, validation: int = 0, **fields):
    """The data of one source ``a`` of ``n`` documents (its ``main`` source)."""
    return {
        "tokenizer": "byte",
        "cache_dir": f"memory://{uuid.uuid4().hex}",  # built by threads: no worker processes to start
        **source(tmp_path, "a", n, validation=validation),
        **fields,
    }


def mixture(tmp_path, sizes: dict[str, int], **fields):
    return {
        "tokenizer": "byte",
        "cache_dir": f"memory://{uuid.uuid4().hex}",
        "configs": {letter: source(tmp_path, letter, n) for letter, n in sizes.items()},
        "mixture_block_size": 4,
        **fields,
    }


@pytest.fixture
def lm_data():
    """``lm_data(section, **build_lm_data options)``: the data of a ``data:`` section, closed afterwards."""
    opened = []

    def make(section: dict, **options):
        data = build_lm_data(validate_data_section(section), seq_len=SEQ, seed=0, progress=False, **options)
        opened.append(data)
        return data

    yield make
    for data in opened:
        data.close()


# -- defaults ---------------------------------------------------------------------------------


def test_without_the_fields_the_stream_reads_in_order_endlessly_and_validates_on_its_split(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 10, validation=3), initial_batch_size=4)

    assert read(data.train, range(3)) == [f"a{i:06d}" for i in [*range(10), 0, 1]]  # shuffle: false by default
    assert names(data.train.batch(1000, 4)) == [f"a{i:06d}" for i in (0, 1, 2, 3)]  # restart: never ends
    assert data.train.end_position() is None
    assert [names(b) for b in eval_batches(data.validation["main"], 3)] == [["a000900", "a000901", "a000902"]]


def test_shuffle_true_and_shuffle_buffer_size_shuffle(tmp_path, lm_data):
    full = lm_data(single(tmp_path, 40, shuffle=True)).train
    first = read(full, range(10))
    assert sorted(first) == [f"a{i:06d}" for i in range(40)] and first != sorted(first)
    era = lm_data(single(tmp_path, 40, shuffle_buffer_size=10)).train  # Levanter's older shuffle buffer
    first = read(era, range(10))
    for k in range(4):  # a permutation within each era of 10 sequences
        assert sorted(first[10 * k : 10 * k + 10]) == [f"a{i:06d}" for i in range(10 * k, 10 * k + 10)]
    assert first != sorted(first)


# -- max_train_batches, simulated epoching, num_validation_sequences -----------------------------


def test_max_train_batches_trains_on_the_first_batches_over_and_over(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 40, max_train_batches={"main": 2}), initial_batch_size=4)
    first = [f"a{i:06d}" for i in range(8)]
    assert read(data.train, range(2)) == first
    assert read(data.train, range(2, 6)) == first + first

    shuffled = lm_data(single(tmp_path, 40, max_train_batches={"main": 2}, shuffle=True), initial_batch_size=4)
    once, again = read(shuffled.train, range(2)), read(shuffled.train, range(2, 4))
    assert sorted(once) == sorted(again) and len(set(once)) == 8  # the same 8 sequences, reshuffled
    assert sorted(once) != first  # the first 8 of the shuffled order, not of the file


def test_max_train_batches_beyond_the_source_is_an_error_naming_the_field(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 10, max_train_batches={"main": 3}), initial_batch_size=4)
    with pytest.raises(DataError, match=r"data\.max_train_batches\.main.*first 12 sequences.*only 10"):
        read(data.train, range(4))
    with pytest.raises(ValueError, match="initial batch size"):
        lm_data(single(tmp_path, 10, max_train_batches={"main": 1}))


def test_simulated_epoching_repeats_the_budgets_share_of_each_source(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 40, target_budget=100, experiment_budget=25))
    assert read(data.train, range(5)) == [f"a{i:06d}" for i in [*range(10), *range(10)]]

    shuffled = lm_data(single(tmp_path, 40, target_budget=100, experiment_budget=25, shuffle=True)).train
    once, again = read(shuffled, range(2), batch_size=5), read(shuffled, range(2, 4), batch_size=5)
    assert sorted(once) == sorted(again) and len(set(once)) == 10  # a random quarter, repeated reshuffled
    assert once != again
    assert sorted(once) != [f"a{i:06d}" for i in range(10)]


def test_num_validation_sequences_holds_out_the_tail_of_the_training_data(tmp_path, lm_data, caplog):
    caplog.set_level("INFO")
    data = lm_data(single(tmp_path, 20, validation=3, num_validation_sequences={"main": 5}))

    trained = read(data.train, range(10))  # 40 positions: two passes over what training keeps
    assert trained == [f"a{i:06d}" for i in [*range(15), *range(15), *range(10)]]
    held = [name for batch in eval_batches(data.validation["main"], 5) for name in names(batch)]
    assert held == [f"a{i:06d}" for i in range(15, 20)]  # replaces the 3-document validation split
    assert "instead of its validation split" in caplog.text


def test_num_validation_sequences_for_an_untrained_source_of_a_mixture(tmp_path, lm_data):
    section = mixture(tmp_path, {"a": 12, "b": 10}, train_weights={"a": 1, "b": 0}, num_validation_sequences={"b": 4})
    data = lm_data(section)
    assert set(read(data.train, range(3))) <= {f"a{i:06d}" for i in range(12)}
    assert [names(b) for b in eval_batches(data.validation["b"], 4)] == [[f"b{i:06d}" for i in range(6, 10)]]


def test_holding_out_every_sequence_is_an_error_naming_the_field(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 5, num_validation_sequences={"main": 5}))
    with pytest.raises(DataError, match=r"data\.num_validation_sequences\.main.*last 5.*only 5.*none for training"):
        data.train.batch(0, 2)


def test_shuffle_before_trainval_split_holds_out_a_random_subset_the_same_for_every_seed(tmp_path):
    section = single(tmp_path, 20, num_validation_sequences={"main": 5}, shuffle_before_trainval_split=True)
    every = {f"a{i:06d}" for i in range(20)}
    held = []
    for seed in (0, 1):
        data = build_lm_data(validate_data_section(section), seq_len=SEQ, seed=seed, progress=False)
        try:
            held.append([name for batch in eval_batches(data.validation["main"], 5) for name in names(batch)])
            trained = set(read(data.train, range(5)))  # 20 positions: more than the 15 kept
        finally:
            data.close()
        assert len(set(held[-1])) == 5 and trained | set(held[-1]) == every and not trained & set(held[-1])
    assert held[0] == held[1]  # one fixed order, whatever the seed
    assert held[0] != [f"a{i:06d}" for i in range(15, 20)]  # not the tail


def test_validation_split_fraction_holds_out_the_last_fraction_of_the_one_trained_source(tmp_path, lm_data):
    """Levanter's DPO split: the last int(20 x 0.1) = 2 of 20 sequences validate, in place of the
    source's own 3-document validation split; training reads the other 18."""
    data = lm_data(single(tmp_path, 20, validation=3, validation_split_fraction=0.1))
    assert read(data.train, range(9)) == [f"a{i:06d}" for i in [*range(18), *range(18)]]
    held = [name for batch in eval_batches(data.validation["main"], 2) for name in names(batch)]
    assert held == ["a000018", "a000019"]


@pytest.mark.parametrize(
    ("n", "fraction", "count"), [(20, 0.1, 2), (5, 0.01, 1), (3, 0.9, 2), (1, 0.5, 0), (9, 0.0, 0)]
)
def test_the_held_out_count_is_levanters(n, fraction, count):
    assert held_out_count(n, fraction) == count


def test_validation_split_fraction_holds_out_part_of_one_trained_source_only(tmp_path):
    with pytest.raises(ValueError, match=r"one source trained on, but 2 are \(a, b\)"):
        validate_data_section(mixture(tmp_path, {"a": 4, "b": 4}, validation_split_fraction=0.1))
    # a mixture whose other sources only validate is fine
    section = mixture(tmp_path, {"a": 4, "b": 4}, train_weights={"a": 1, "b": 0}, validation_split_fraction=0.1)
    assert validate_data_section(section).held_out() == {"a": 0.1}


# -- where the stream ends ----------------------------------------------------------------------


def read_to_the_end(stream) -> tuple[list[str], DataExhausted]:
    """Every sequence of the stream, one position per step, and the error that ended it."""
    seen = []
    for step in range(10_000):
        try:
            seen += names(stream.batch(step, 1))
        except DataExhausted as e:
            return seen, e
    raise AssertionError("the stream did not end")


def test_first_exhausted_ends_where_any_source_would_start_again(tmp_path, lm_data):
    data = lm_data(mixture(tmp_path, {"a": 6, "b": 30}, stop_strategy="first_exhausted"))
    seen, ended = read_to_the_end(data.train)

    a_seen = [n for n in seen if n.startswith("a")]
    assert sorted(a_seen) == [f"a{i:06d}" for i in range(6)]  # a's one pass, and the stream ends
    assert 10 <= len(seen) <= 14  # a has half of every block of 4
    assert data.train.end_position() == len(seen) and ended.step == len(seen)
    assert isinstance(ended, DataError) and "source 'a' ran out" in str(ended) and "first_exhausted" in str(ended)
    # A batch that is only partly before the end is dropped too.
    with pytest.raises(DataExhausted):
        data.train.batch(0, len(seen) + 1)
    assert len(names(data.train.batch(0, len(seen)))) == len(seen)


def test_all_exhausted_restarts_sources_until_each_has_run_out(tmp_path, lm_data):
    data = lm_data(mixture(tmp_path, {"a": 6, "b": 30}, stop_strategy="all_exhausted"))
    seen, ended = read_to_the_end(data.train)

    b_seen = [n for n in seen if n.startswith("b")]
    assert sorted(b_seen) == [f"b{i:06d}" for i in range(30)]
    a_seen = [n for n in seen if n.startswith("a")]
    assert len(a_seen) >= 24 and set(a_seen) == {f"a{i:06d}" for i in range(6)}  # a restarted
    assert data.train.end_position() == len(seen)
    assert "every source" in str(ended) and "all_exhausted" in str(ended)


def test_restart_never_ends(tmp_path, lm_data):
    data = lm_data(mixture(tmp_path, {"a": 6, "b": 30}))
    assert len(read(data.train, range(100, 103))) == 12
    assert data.train.end_position() is None


def test_epoch_ends_a_single_source_after_that_many_passes(tmp_path, lm_data):
    data = lm_data(single(tmp_path, 10), initial_batch_size=4, max_epochs=2)
    assert read(data.train, range(5)) == [f"a{i:06d}" for i in [*range(10), *range(10)]]
    assert data.train.end_position() == 20
    ran_out = r"the training data ran out after 2 passes over its 10 sequences \(epoch\)"
    with pytest.raises(DataExhausted, match=ran_out) as e:
        data.train.batch(5, 4)
    assert e.value.step == 5
    with pytest.raises(DataExhausted):
        data.train.batch(6, 3)  # positions 18..20: partly past the end


def test_the_end_of_a_cut_source_is_the_end_of_its_cut(tmp_path, lm_data):
    section = single(tmp_path, 40, max_train_batches={"main": 2}, stop_strategy="first_exhausted")
    data = lm_data(section, initial_batch_size=4)
    assert data.train.end_position() == 8
    read(data.train, range(2))
    with pytest.raises(DataExhausted):
        data.train.batch(2, 4)


# -- batch-size schedules -------------------------------------------------------------------------


def test_a_position_holds_the_same_data_whatever_the_batch_size(tmp_path, lm_data):
    data = lm_data(mixture(tmp_path, {"a": 12, "b": 30}, shuffle=True))
    whole = names(data.train.batch(1, 8))  # positions 8..15
    halves = names(data.train.batch(3, 4, start=8)) + names(data.train.batch(7, 4, start=12))
    assert whole == halves


def test_weight_stages_are_placed_by_the_schedules_offsets(tmp_path, lm_data):
    schedule = BatchSchedule(((0, 2), (1, 6)))  # step 2 starts at position 2 + 6 = 8
    stages = [[0, {"a": 1, "b": 0}], [2, {"a": 0, "b": 1}]]
    section = mixture(tmp_path, {"a": 30, "b": 30}, train_weights=stages)
    scheduled = lm_data(section, initial_batch_size=2, offsets=schedule.offset_at).train
    start = schedule.offset_at(2)
    assert {n[0] for n in names(scheduled.batch(2, 6, start=start))} == {"b"}
    assert {n[0] for n in names(scheduled.batch(1, 6, start=schedule.offset_at(1)))} == {"a"}
    # Without the offsets, step 2 of batches of 6 would start the stage at position 12.
    unscheduled = lm_data(section).train
    assert {n[0] for n in names(unscheduled.batch(2, 6, start=start))} == {"a", "b"}


# -- cache_options ---------------------------------------------------------------------------------


@pytest.fixture
def tokenizer_calls(monkeypatch) -> list[int]:
    """The number of records of each call of the text format's tokenizing."""
    calls = []
    original = TextFormat.encode_batch

    def counted(self, values, *args, **kwargs):
        calls.append(len(values))
        return original(self, values, *args, **kwargs)

    monkeypatch.setattr(TextFormat, "encode_batch", counted)
    return calls


def shard_reports(tmp_path, options: CacheOptions) -> list[Progress]:
    """The progress reports of tokenizing a shard of 300 documents with ``options``."""
    src = UrlSourceConfig(train_urls=[write_jsonl(tmp_path / "shard.jsonl", docs("a", 300))])
    tokenizer = ByteTokenizer()
    job = _Job(
        path=str(tmp_path / f"cache-{uuid.uuid4().hex}"),
        source=src,
        split="train",
        tokenizer="byte",
        tokenizer_fingerprint=tokenizer.fingerprint,
        eos_id=tokenizer.eos_id,
        skip_bad_data=False,
        token_dtype="uint16",
        batch_size=options.batch_size,
        flush_bytes=options.target_bytes_per_flush,
    )
    return list(tokenize_shard(job, ShardTask(0, src.shards("train")[0], 0, 0, 0, {})))


def test_cache_batch_size_and_flush_size_set_the_tokenizer_calls_and_the_writes(tmp_path, tokenizer_calls):
    reports = shard_reports(tmp_path, CacheOptions())
    assert tokenizer_calls == [128, 128, 44] and len(reports) == 1  # 512MB is never reached: one write at the end

    tokenizer_calls.clear()
    # 8 tokens of 2 bytes and an 8-byte offset: 24 bytes a document, 1200 per tokenizer call of 50
    reports = shard_reports(tmp_path, CacheOptions(batch_size=50, target_size_per_flush="2KB"))
    assert tokenizer_calls == [50] * 6
    assert [r.documents for r in reports] == [100, 200, 300, 300] and reports[-1].finished


def test_cache_options_do_not_change_the_cache_and_an_existing_one_is_reused(tmp_path, caplog):
    for shard in range(5):
        write_jsonl(tmp_path / f"part{shard}.jsonl", docs("a", 40, 100 * shard))
    src = UrlSourceConfig(train_urls=[str(tmp_path / "part*.jsonl")])
    settings = dict(enforce_eos=True, skip_bad_data=False, background=False)
    plain = open_cache(str(tmp_path / "plain"), src, "train", ByteTokenizer(), **settings)
    options = CacheOptions(batch_size=3, num_shard_groups=2, target_size_per_flush=100)
    tuned = open_cache(str(tmp_path / "tuned"), src, "train", ByteTokenizer(), cache_options=options, **settings)
    assert tuned.ledger["identity"] == plain.ledger["identity"]
    np.testing.assert_array_equal(tuned.tokens(0, tuned.num_tokens), plain.tokens(0, plain.num_tokens))
    np.testing.assert_array_equal(tuned.document_offsets(), plain.document_offsets())

    caplog.set_level("INFO")
    open_cache(str(tmp_path / "tuned"), src, "train", ByteTokenizer(), **settings)  # other options: reused
    assert "reusing the cache" in caplog.text


def test_num_shard_groups_bounds_the_tasks_shards_are_grouped_into():
    tasks = [ShardTask(i, f"s{i}", 0, 0, 0, {}) for i in range(10)]
    assert [[t.index for t in g] for g in shard_groups(tasks, 3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert len(shard_groups(tasks, None)) == 10 and len(shard_groups(tasks, 128)) == 10

    ran: list[tuple[int, int]] = []  # (worker thread, shard) in the order the shards ran

    def work(task):
        ran.append((threading.get_ident(), task.index))
        yield Progress(task.index, 1, 1, 1, {}, [], True)

    reports = []
    run_shards(work, tasks, reports.append, num_workers=4, max_groups=1, stop=threading.Event(), processes=False)
    assert [index for _, index in ran] == list(range(10)) and len({worker for worker, _ in ran}) == 1
    assert sorted(r.index for r in reports) == list(range(10))


def test_an_ending_stream_reads_a_cache_that_is_still_being_built():
    from test_dataset import GrowingCache  # the cache reader over documents held in memory

    from levanter_core.data.dataset import TextSequences, TrainStream

    cache = GrowingCache()
    cache.append([np.arange(8 * 5)])  # 5 sequences so far
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=False, stop_strategy="first_exhausted")
    assert stream.batch(1, 2).tokens[:, 0].tolist() == [16, 24]  # no need to wait for the end
    assert stream.end_position() is None  # not known while the cache grows
    cache.append([np.arange(8 * 5, 8 * 7)])
    cache.finish()
    assert stream.end_position() == 7
    with pytest.raises(DataExhausted):
        stream.batch(3, 2)
