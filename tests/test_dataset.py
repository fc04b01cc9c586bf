"""Sequences, packing, shuffling and mixtures over a tokenized cache (levanter_core/data/dataset.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from levanter_core.data.dataset import (
    Batch,
    PackedSequences,
    TextSequences,
    TrainStream,
    block_counts,
    eval_batches,
    sequence_dataset,
)
from levanter_core.data.permutation import Permutation, derive_key
from levanter_core.errors import DataError


class GrowingCache:
    """The reader interface of ``TokenCache`` over documents held in memory, which the test
    appends (possibly from another thread), completes, or fails."""

    def __init__(self, path: str = "memory://cache/train", *, with_target_mask: bool = False):
        self.path = path
        self.has_target_mask = with_target_mask
        self._tokens = np.zeros(0, np.int32)
        self._mask = np.zeros(0, np.uint8)
        self._offsets = [0]
        self._complete = False
        self._error: Exception | None = None
        self._changed = threading.Condition()
        self.blocked = threading.Event()
        """Set when a reader first waits for what the cache does not hold yet: a test grows the
        cache once this is set, which shows that the reader waited for it."""

    def append(self, docs, masks=None) -> None:
        docs = [np.asarray(d, np.int32) for d in docs]
        masks = masks or [np.ones(len(d), np.uint8) for d in docs]
        with self._changed:
            self._tokens = np.concatenate([self._tokens, *docs])
            self._mask = np.concatenate([self._mask, *[np.asarray(m, np.uint8) for m in masks]])
            for d in docs:
                self._offsets.append(self._offsets[-1] + len(d))
            self._changed.notify_all()

    def finish(self) -> None:
        with self._changed:
            self._complete = True
            self._changed.notify_all()

    def fail(self, error: Exception) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def tokens(self, start: int, stop: int) -> np.ndarray:
        assert 0 <= start <= stop <= self.num_tokens, f"read [{start}, {stop}) past the ready prefix"
        return self._tokens[start:stop].copy()

    def target_mask(self, start: int, stop: int) -> np.ndarray | None:
        assert 0 <= start <= stop <= self.num_tokens
        return self._mask[start:stop].copy() if self.has_target_mask else None

    def document_offsets(self) -> np.ndarray:
        return np.array(self._offsets, np.int64)

    def wait_for(self, *, tokens: int = 0, documents: int = 0) -> None:
        def ready() -> bool:
            return (
                self._error is not None
                or self._complete
                or (self.num_tokens >= tokens and self.num_documents >= documents)
            )

        with self._changed:
            if not ready():
                self.blocked.set()
            self._changed.wait_for(ready)
            if self._error is not None:
                raise self._error

    def wait_complete(self) -> None:
        self.wait_for(tokens=2**62)


def text_cache(num_tokens: int, *, base: int = 0, complete: bool = True) -> GrowingCache:
    """A text cache whose token ids are ``base + position`` (documents of 5 tokens)."""
    cache = GrowingCache()
    ids = base + np.arange(num_tokens)
    cache.append(np.split(ids, range(5, num_tokens, 5)))
    if complete:
        cache.finish()
    return cache


def starts(batch: Batch, seq_len: int, base: int = 0) -> list[int]:
    """Which text sequence each row is (from its first token id)."""
    return [(int(row[0]) - base) // seq_len for row in batch.tokens]


# -- the keyed permutation ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 2**16 + 3])
def test_permutation_is_a_bijection_with_its_inverse(n):
    perm = Permutation(n, derive_key(0, "web", 0))
    image = perm(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    assert (perm.inverse(image) == np.arange(n)).all()


def test_permutation_keys_give_different_orders():
    keys = [derive_key(seed, "web", epoch) for seed in range(3) for epoch in range(3)]
    orders = {tuple(Permutation(1000, key)(np.arange(1000))) for key in keys}
    assert len(orders) == 9
    assert derive_key(1, "web", 0) != derive_key(1, "code", 0)
    identity = tuple(range(1000))
    assert identity not in orders


def test_permutation_is_the_same_in_another_process():
    code = (
        "import numpy as np; from levanter_core.data.permutation import Permutation, derive_key; "
        "print(Permutation(12345, derive_key(7, 'web', 3))(np.arange(0, 12345, 997)).tolist())"
    )
    here = Permutation(12345, derive_key(7, "web", 3))(np.arange(0, 12345, 997)).tolist()
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": hash_seed}
        )
        assert eval(out.stdout) == here


def test_permutation_rejects_out_of_range_indices():
    with pytest.raises(IndexError, match="permutation of 5"):
        Permutation(5, 1)(np.array([5]))


# -- text sequences -----------------------------------------------------------------------


def test_text_sequences_are_consecutive_windows_and_another_seq_len_reuses_the_cache():
    cache = text_cache(103)
    short, long = TextSequences(cache, 8), TextSequences(cache, 16)
    assert (short.final_length(), long.final_length()) == (12, 6)  # tails dropped
    assert (short.rows(np.array([3])).tokens == np.arange(24, 32)).all()
    assert (long.rows(np.array([1])).tokens[0] == np.concatenate(short.rows(np.array([2, 3])).tokens)).all()
    batch = long.rows(np.array([0, 5, 1]))
    assert batch.tokens.dtype == np.int32 and batch.loss_mask is None and batch.segment_ids is None
    assert starts(batch, 16) == [0, 5, 1]


def test_text_sequences_grow_with_the_cache():
    cache = text_cache(20, complete=False)
    data = TextSequences(cache, 8)
    assert (data.available(), data.final_length()) == (2, None)
    cache.append([np.arange(20, 30)])
    cache.finish()
    assert (data.available(), data.final_length()) == (3, 3)


def test_a_cache_too_small_for_one_sequence_is_an_error_naming_it():
    with pytest.raises(DataError, match=r"memory://cache/train.*7 tokens.*seq_len 8"):
        TrainStream({"main": TextSequences(text_cache(7), 8)}, seed=0).batch(0, 2)


# -- the training stream ------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, 4, False])
def test_batch_at_step_n_is_the_same_read_directly_or_through(shuffle):
    cache = text_cache(8 * 13)  # 13 sequences: batches of 3 cross epochs
    through = TrainStream({"main": TextSequences(cache, 8)}, seed=3, shuffle=shuffle)
    read = [through.batch(step, 3).tokens for step in range(12)]
    for step in (11, 4, 0, 9):
        direct = TrainStream({"main": TextSequences(cache, 8)}, seed=3, shuffle=shuffle)
        assert (direct.batch(step, 3).tokens == read[step]).all()


def test_full_shuffle_reads_every_sequence_once_per_epoch_in_a_new_order():
    stream = TrainStream({"main": TextSequences(text_cache(8 * 50), 8)}, seed=0, shuffle=True)
    first = [s for step in range(10) for s in starts(stream.batch(step, 5), 8)]
    second = [s for step in range(10, 20) for s in starts(stream.batch(step, 5), 8)]
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != list(range(50)) and first != second
    other_seed = TrainStream({"main": TextSequences(text_cache(8 * 50), 8)}, seed=1, shuffle=True)
    assert starts(other_seed.batch(0, 5), 8) != first[:5]


def test_era_shuffle_permutes_within_each_era_and_starts_before_the_cache_is_complete():
    cache = text_cache(8 * 20, complete=False)  # 20 sequences ready, more to come
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=10)
    order = [s for step in range(4) for s in starts(stream.batch(step, 5), 8)]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10, 20))
    assert order != list(range(20))
    cache.append([np.arange(8 * 20, 8 * 25)])  # 25 sequences: the last era holds 5
    cache.finish()
    tail = [s for step in range(4, 7) for s in starts(stream.batch(step, 5), 8)]
    assert sorted(tail[:5]) == list(range(20, 25))
    assert sorted(tail[5:]) == list(range(10))  # the next epoch, reshuffled
    assert tail[5:] != order[:10]


def test_era_shuffle_waits_for_its_whole_era():
    cache = text_cache(8 * 16, complete=False)
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=10)

    def grow():
        cache.blocked.wait(timeout=60)
        cache.append([np.arange(8 * 16, 8 * 20)])

    threading.Thread(target=grow).start()
    batch = stream.batch(2, 5)  # positions 10..14 are there, but their era runs to 19
    assert cache.blocked.is_set()
    assert set(starts(batch, 8)) <= set(range(10, 20)) and starts(batch, 8) != [10, 11, 12, 13, 14]


def test_no_shuffle_reads_in_order_and_wraps_into_the_next_epoch():
    stream = TrainStream({"main": TextSequences(text_cache(8 * 7), 8)}, seed=0, shuffle=False)
    assert starts(stream.batch(1, 5), 8) == [5, 6, 0, 1, 2]


def test_batch_waits_for_the_cache_to_grow():
    cache = text_cache(16, complete=False)
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=False)

    def grow():
        cache.blocked.wait(timeout=60)
        cache.append([np.arange(16, 40)])

    threading.Thread(target=grow).start()
    batch = stream.batch(1, 2)  # sequences 2 and 3 are not in the cache yet
    assert cache.blocked.is_set()
    assert starts(batch, 8) == [2, 3]


def test_full_shuffle_waits_for_the_complete_cache():
    cache = text_cache(8 * 10, complete=False)
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=True)

    def finish():
        cache.blocked.wait(timeout=60)
        cache.append([np.arange(80, 96)])
        cache.finish()

    threading.Thread(target=finish).start()
    first = [s for step in range(4) for s in starts(stream.batch(step, 3), 8)]
    assert cache.blocked.is_set()
    assert sorted(first) == list(range(12))


def test_batch_raises_the_cache_build_error():
    cache = text_cache(16, complete=False)
    stream = TrainStream({"main": TextSequences(cache, 8)}, seed=0, shuffle=False)

    def fail():
        cache.blocked.wait(timeout=60)
        cache.fail(DataError("train.jsonl:3: not JSON"))

    threading.Thread(target=fail).start()
    with pytest.raises(DataError, match="train.jsonl:3: not JSON"):
        stream.batch(5, 2)


# -- packing ------------------------------------------------------------------------------


def packed_cache(lengths, *, complete=True) -> GrowingCache:
    """Examples of ``lengths`` with ids ``1000 * (example + 1) + position``, whose target
    mask is 0 on their first half (the prompt) and 1 on the rest."""
    cache = GrowingCache(with_target_mask=True)
    docs = [1000 * (i + 1) + np.arange(n) for i, n in enumerate(lengths)]
    cache.append(docs, [np.arange(n) >= n // 2 for n in lengths])
    if complete:
        cache.finish()
    return cache


def test_packing_is_greedy_in_order_with_segments_masks_and_truncation():
    lengths = [3, 4, 2, 10, 5, 8, 1]
    cache = packed_cache(lengths)
    data = PackedSequences(cache, 8)
    assert data.final_length() == 6 and data.truncated == 1
    batch = data.rows(np.arange(6))
    examples = [[int(t) // 1000 - 1 for t in row if t] for row in batch.tokens]
    assert [sorted(set(e)) for e in examples] == [[0, 1], [2], [3], [4], [5], [6]]
    assert batch.tokens[2].tolist() == (4000 + np.arange(8)).tolist()  # the 10-token example, cut to 8
    assert batch.segment_ids[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 0]
    assert batch.segment_ids[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch.tokens[0, 7] == 0  # padding

    # examples 0 and 1 with target masks [0 1 1] and [0 0 1 1]: loss at t is the target at t + 1
    assert cache.target_mask(0, 7).tolist() == [0, 1, 1, 0, 0, 1, 1]
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert batch.loss_mask[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]  # no loss on padding
    assert batch.loss_mask.dtype == np.float32 and batch.loss_mask[:, -1].sum() == 0


def test_packing_does_not_depend_on_how_the_cache_grew():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 300).tolist()
    reference = PackedSequences(packed_cache(lengths), 16)
    expected = reference.rows(np.arange(reference.final_length()))
    for step in (1, 7, 64):
        cache = GrowingCache(with_target_mask=True)
        data = PackedSequences(cache, 16)
        full = packed_cache(lengths)
        offsets = full.document_offsets()
        for first in range(0, len(lengths), step):
            last = min(first + step, len(lengths))
            cache.append(
                [full.tokens(offsets[i], offsets[i + 1]) for i in range(first, last)],
                [full.target_mask(offsets[i], offsets[i + 1]) for i in range(first, last)],
            )
            ready = data.available()
            if ready:  # what is final now stays what it is when complete
                assert (data.rows(np.arange(ready)).tokens == expected.tokens[:ready]).all()
        cache.finish()
        got = data.rows(np.arange(data.final_length()))
        assert (got.tokens == expected.tokens).all()
        assert (got.segment_ids == expected.segment_ids).all()
        assert (got.loss_mask == expected.loss_mask).all()
        assert data.truncated == reference.truncated > 0


def test_a_pack_is_final_only_when_the_next_example_does_not_fit():
    cache = packed_cache([3, 2], complete=False)
    data = PackedSequences(cache, 8)
    assert data.available() == 0  # a third example could still join
    cache.append([np.arange(1, 5)])
    assert data.available() == 1  # 3 + 2 + 4 > 8
    cache.finish()
    assert data.final_length() == 2


def test_packed_and_text_sources_mix_into_one_batch_format():
    datasets = {"chat": PackedSequences(packed_cache([3, 4] * 20), 8), "web": TextSequences(text_cache(8 * 40), 8)}
    batch = TrainStream(datasets, seed=0, stages=[(0, {"chat": 1, "web": 1})], block_size=4).batch(0, 8)
    text_rows = batch.tokens[:, 0] < 1000
    assert text_rows.sum() == 4
    assert (batch.segment_ids[text_rows] == 1).all()
    assert (batch.loss_mask[text_rows][:, :-1] == 1).all() and (batch.loss_mask[:, -1] == 0).all()
    assert (batch.segment_ids[~text_rows][:, 0] == 1).all()


def test_every_batch_of_a_stream_with_a_packed_source_has_the_same_structure():
    """A batch drawn from the text source alone still carries masks and segments: the step is
    compiled once, for one structure (the template's)."""
    datasets = {"chat": PackedSequences(packed_cache([3, 4] * 20), 8), "web": TextSequences(text_cache(8 * 40), 8)}
    stages = [(0, {"chat": 0, "web": 1}), (2, {"chat": 1, "web": 0})]
    stream = TrainStream(datasets, seed=0, stages=stages, block_size=4)
    text_only, packed_only, template = stream.batch(0, 4), stream.batch(2, 4), stream.template(4)
    for batch in (text_only, packed_only, template):
        assert batch.tokens.shape == batch.loss_mask.shape == batch.segment_ids.shape == (4, 8)
    assert (text_only.segment_ids == 1).all() and (template.tokens == 0).all()
    plain = TrainStream({"web": TextSequences(text_cache(8 * 40), 8)}, seed=0)
    assert plain.batch(0, 4).loss_mask is None and plain.template(4).segment_ids is None


# -- mixtures -----------------------------------------------------------------------------


def test_block_counts_round_by_largest_remainder():
    assert block_counts([0.5, 0.3, 0.2], 10).tolist() == [5, 3, 2]
    assert block_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
    assert block_counts([2, 0, 1], 7).tolist() == [5, 0, 2]


def mixture(weights_or_stages, *, seed=0, block_size=10, shuffle=False, sizes=None):
    """A stream over sources a, b, c whose token ids are 10000 * (source + 1) + position."""
    names = ["a", "b", "c"]
    sizes = sizes or {}
    datasets = {
        name: TextSequences(text_cache(8 * sizes.get(name, 100), base=10000 * (i + 1)), 8)
        for i, name in enumerate(names)
    }
    stages = weights_or_stages if isinstance(weights_or_stages, list) else [(0, weights_or_stages)]
    return TrainStream(datasets, seed=seed, shuffle=shuffle, stages=stages, block_size=block_size)


def source_of(batch: Batch) -> list[str]:
    return ["abc"[int(row[0]) // 10000 - 1] for row in batch.tokens]


def test_every_mixture_block_holds_each_share_exactly():
    stream = mixture({"a": 0.5, "b": 0.3, "c": 0.2})
    drawn = [s for step in range(20) for s in source_of(stream.batch(step, 5))]
    for block in range(10):
        part = drawn[block * 10 : (block + 1) * 10]
        assert (part.count("a"), part.count("b"), part.count("c")) == (5, 3, 2)
    assert drawn[:10] != drawn[10:20]  # each block in its own keyed order
    other = mixture({"a": 0.5, "b": 0.3, "c": 0.2}, seed=1)
    assert [s for step in range(2) for s in source_of(other.batch(step, 5))] != drawn[:10]


def test_each_source_is_read_in_its_own_order_across_blocks():
    stream = mixture({"a": 0.5, "b": 0.3, "c": 0.2})
    seen = {"a": [], "b": [], "c": []}
    for step in range(8):
        batch = stream.batch(step, 5)
        for name, row in zip(source_of(batch), batch.tokens):
            seen[name].append((int(row[0]) % 10000) // 8)
    assert seen == {"a": list(range(20)), "b": list(range(12)), "c": list(range(8))}


@pytest.mark.parametrize("switch_step", [4, 3])
def test_staged_weights_switch_at_the_first_block_that_starts_at_or_after_the_stage(switch_step):
    # blocks of 4 sequences, batches of 2: block j starts at step 2j
    stream = mixture([(0, {"a": 1, "b": 0}), (switch_step, {"a": 0, "b": 1})], block_size=4)
    drawn = [source_of(stream.batch(step, 2)) for step in range(8)]
    assert drawn[:4] == [["a", "a"]] * 4  # a stage at step 3 waits for the block starting at 4
    assert drawn[4:] == [["b", "b"]] * 4
    later = stream.batch(4, 2)
    assert ((later.tokens[:, 0] % 10000) // 8).tolist() == [0, 1]  # b starts at its first sequence


def test_resuming_a_staged_mixture_equals_reading_through():
    stages = [(0, {"a": 0.7, "b": 0.3}), (5, {"a": 0.2, "b": 0.5, "c": 0.3})]
    through = mixture(stages, shuffle=3, block_size=6, sizes={"a": 11, "b": 9, "c": 7})
    read = [through.batch(step, 4).tokens for step in range(15)]
    for step in (14, 6, 2):
        direct = mixture(stages, shuffle=3, block_size=6, sizes={"a": 11, "b": 9, "c": 7})
        assert (direct.batch(step, 4).tokens == read[step]).all()


def test_a_source_with_weight_zero_is_never_read():
    never = GrowingCache()  # empty and never complete: reading it would wait forever
    datasets = {"a": TextSequences(text_cache(8 * 30), 8), "z": TextSequences(never, 8)}
    stream = TrainStream(datasets, seed=0, stages=[(0, {"a": 1.0, "z": 0.0})], block_size=4)
    assert len(starts(stream.batch(2, 5), 8)) == 5
    assert stream.names == ["a"]


def test_a_weighted_source_without_data_is_an_error():
    with pytest.raises(DataError, match="data.train_weights: source b"):
        TrainStream({"a": TextSequences(text_cache(80), 8)}, seed=0, stages=[(0, {"a": 1, "b": 1})])


def test_a_packed_era_shuffled_stream_does_not_depend_on_build_timing():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 12, 400).tolist()
    complete = packed_cache(lengths)
    expected = TrainStream({"main": PackedSequences(complete, 16)}, seed=5, shuffle=6).batch(7, 4)

    growing = GrowingCache(with_target_mask=True)
    offsets = complete.document_offsets()

    def grow():
        for i in range(len(lengths)):
            span = (offsets[i], offsets[i + 1])
            growing.append([complete.tokens(*span)], [complete.target_mask(*span)])
            if i % 50 == 0:
                time.sleep(0.01)
        growing.finish()

    threading.Thread(target=grow).start()
    got = TrainStream({"main": PackedSequences(growing, 16)}, seed=5, shuffle=6).batch(7, 4)
    assert (got.tokens == expected.tokens).all() and (got.loss_mask == expected.loss_mask).all()


# -- evaluation ---------------------------------------------------------------------------


def test_eval_batches_are_in_order_and_wrap_a_small_set():
    data = sequence_dataset(text_cache(8 * 7), 8, packed=False)
    assert [starts(b, 8) for b in eval_batches(data, 3)] == [[0, 1, 2], [3, 4, 5]]
    assert len(list(eval_batches(data, 3, max_batches=1))) == 1
    assert [starts(b, 8) for b in eval_batches(data, 10)] == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]


def test_eval_batches_wait_for_the_complete_cache():
    cache = text_cache(8 * 4, complete=False)
    data = sequence_dataset(cache, 8, packed=True)
    assert isinstance(data, PackedSequences)
    threading.Timer(0.1, cache.finish).start()
    batches = list(eval_batches(data, 2))
    assert cache.complete and len(batches) == 3  # 32 tokens in 5-token documents: 6 packs of 8


# -- a process's share of a batch ----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_share_of_the_rows_is_those_rows_of_the_whole_batch(shuffle):
    """A process of a multi-process run reads only its rows; they are the rows the whole batch has."""
    datasets = {"chat": PackedSequences(packed_cache([3, 4] * 20), 8), "web": TextSequences(text_cache(8 * 40), 8)}
    stream = TrainStream(datasets, seed=0, shuffle=shuffle, stages=[(0, {"chat": 1, "web": 1})], block_size=4)
    for step in range(3):
        whole = stream.batch(step, 8)
        for rows in ([4, 5, 6, 7], [0, 2], [7]):
            share = stream.batch(step, 8, np.array(rows))
            for name in ("tokens", "loss_mask", "segment_ids"):
                assert (getattr(share, name) == getattr(whole, name)[rows]).all()


def test_eval_batches_give_a_share_of_each_batch():
    data = TextSequences(text_cache(8 * 7), 8)
    whole, share = list(eval_batches(data, 3)), list(eval_batches(data, 3, rows=np.array([1, 2])))
    assert [b.tokens.tolist() for b in share] == [b.tokens[1:].tolist() for b in whole]
