"""The training stream: :class:`TrainStream` puts the sources' orders
(:mod:`~levanter_core.data.dataset.order`) and their mixing
(:mod:`~levanter_core.data.dataset.mixture`) together into the batch at each step, and says
where the stream ends (``data.stop_strategy``, ``epoch``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from levanter_core.data.dataset.mixture import _Mixture
from levanter_core.data.dataset.order import _EpochOrder
from levanter_core.data.dataset.sequences import Batch, SequenceDataset, held_out
from levanter_core.errors import DataError, DataExhausted

# The package's logger, as before the split: log lines still name levanter_core.data.dataset.
logger = logging.getLogger(__package__)

if TYPE_CHECKING:
    from levanter_core.data.config import DataConfig


class TrainStream:
    """The training stream over named sequence datasets: ``batch(step, batch_size)``.

    ``stages``: ``[(first_step, {name: weight})]`` as :meth:`DataConfig.weight_stages` gives
    (None: equal weights). A source with weight 0 in every stage is never read. ``shuffle``
    is ``DataConfig.effective_shuffle``. With one source read, no mixing is done.

    ``limits``: per source, train on only the first that many sequences (of its first epoch's
    order), repeated. ``fraction``: every source cut to that share of its sequences
    (simulated epoching). ``stop_strategy``: ``restart`` (endless), ``first_exhausted`` (the
    stream ends where any source would start its second pass) or ``all_exhausted`` (sources
    restart until each has run out once; the stream ends where the last one does).
    ``max_epochs`` (one source only): the stream ends after that many passes; 0: no limit.
    ``offsets``: the stream position of a step's first sequence, for a batch-size schedule
    (places the weight stages, which are given in steps); default ``step * batch_size``.
    ``initial_batch_size``: the first step's batch size, for :meth:`end_position`."""

    def __init__(
        self,
        datasets: Mapping[str, SequenceDataset],
        *,
        seed: int,
        shuffle: bool | int = True,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None = None,
        block_size: int = 2048,
        limits: Mapping[str, int] | None = None,
        fraction: float | None = None,
        stop_strategy: str = "restart",
        max_epochs: int = 0,
        offsets: Callable[[int], int] | None = None,
        initial_batch_size: int | None = None,
    ):
        if stages is None:
            stages = [(0, dict.fromkeys(datasets, 1.0))]
        names = sorted({name for _, weights in stages for name, w in weights.items() if w > 0})
        missing = [name for name in names if name not in datasets]
        if missing:
            raise DataError(
                f"data.train_weights: source {', '.join(missing)} has a positive weight but no training data"
            )
        lengths = {datasets[name].seq_len for name in names}
        if len(lengths) != 1:
            raise ValueError(f"the sources' datasets have different seq_len: {sorted(lengths)}")
        if stop_strategy not in ("restart", "first_exhausted", "all_exhausted"):
            raise ValueError(f"unknown stop_strategy {stop_strategy!r}")
        if max_epochs and len(names) > 1:
            raise ValueError("max_epochs limits the passes over a single source; this stream mixes several")
        self.names = names
        self.seq_len = lengths.pop()
        # Every batch has the same structure (a pytree the step is compiled for): with loss
        # masks and segments as soon as one source read is packed, and the same fields.
        self.packed = any(datasets[name].packed for name in names)
        shapes = {name: datasets[name].field_shapes for name in names}
        if len({repr(sorted(s.items())) for s in shapes.values()}) > 1:
            described = "; ".join(f"{name}: {', '.join(s) or 'tokens only'}" for name, s in shapes.items())
            raise DataError(
                f"data.train_weights: the sources trained on give batches of different kinds ({described}); "
                "a run trains on sources of one kind (all text, or all audio with transcripts)"
            )
        self.field_shapes = shapes[names[0]] if names else {}
        limits = limits or {}
        self._orders = [
            _EpochOrder(name, datasets[name], seed, shuffle, limit=limits.get(name), fraction=fraction)
            for name in names
        ]
        for order in self._orders:
            if order.limit is not None:
                logger.info(
                    "source %s: training on its first %d sequences (data.max_train_batches)", order.name, order.limit
                )
        self.stop_strategy = stop_strategy
        self.max_epochs = max_epochs
        # The passes any source may take before the stream ends (None: no such limit).
        passes = [p for p in (1 if stop_strategy == "first_exhausted" else None, max_epochs or None) if p]
        self._passes = min(passes) if passes else None
        self._offsets = offsets
        self._initial_batch_size = initial_batch_size
        self._mixture = None
        if len(names) > 1:
            weights = [(step, np.array([w.get(name, 0.0) for name in names])) for step, w in stages]
            self._mixture = _Mixture(weights, block_size, seed)

    @classmethod
    def from_config(
        cls,
        datasets: Mapping[str, SequenceDataset],
        config: DataConfig,
        seed: int,
        *,
        initial_batch_size: int | None = None,
        max_epochs: int = 0,
        offsets: Callable[[int], int] | None = None,
    ) -> TrainStream:
        """The stream that ``config`` (the ``data:`` section) describes over the training
        ``datasets``, seeded by ``seed`` (``data_seed`` or ``trainer.seed``).

        ``initial_batch_size``: the batch size at step 0 (``data.max_train_batches`` counts in
        batches of it; required when that is set). ``max_epochs``: the top-level ``epoch``.
        ``offsets``: step -> stream position of its first sequence, with a batch-size
        schedule. ``data.num_validation_sequences`` holds the last sequences of those sources
        out of ``datasets`` here; :func:`held_out` gives the validation part."""
        datasets = dict(datasets)
        for name, count in config.held_out().items():
            if name in datasets:
                datasets[name] = held_out(datasets[name], name, count, shuffled=config.shuffles_split(count))[0]
                what = f"a fraction {count} of" if isinstance(count, float) else f"the last {count}"
                logger.info("source %s: %s its training sequences are held out for validation", name, what)
        limits = {}
        if config.max_train_batches:
            if initial_batch_size is None:
                raise ValueError("data.max_train_batches needs the initial batch size (initial_batch_size)")
            limits = {name: batches * initial_batch_size for name, batches in config.max_train_batches.items()}
        return cls(
            datasets,
            seed=seed,
            shuffle=config.effective_shuffle,
            stages=config.weight_stages(),
            block_size=config.mixture_block_size,
            limits=limits,
            fraction=config.budget_fraction,
            stop_strategy=config.stop_strategy,
            max_epochs=max_epochs,
            offsets=offsets,
            initial_batch_size=initial_batch_size,
        )

    @property
    def endless(self) -> bool:
        """Whether the stream never ends (``restart`` and no ``max_epochs``)."""
        return self._passes is None and self.stop_strategy != "all_exhausted"

    def batch(self, step: int, batch_size: int, rows: np.ndarray | None = None, *, start: int | None = None) -> Batch:
        """Stream positions ``start ..`` ``start + batch_size - 1`` (``start`` default
        ``step * batch_size``; with a batch-size schedule, where the step's batch starts).
        Waits for the cache where they are not yet built, and raises its build's error.
        ``rows``: only these rows of the batch, in this order (a process of a multi-process
        run reads its share only); the rows are the same whichever others are read.

        Raises :class:`DataExhausted` when the batch would read past the end of the stream
        (a batch only partly there raises too: partial batches are dropped)."""
        if start is None:
            start = step * batch_size
        stage_starts = self._stage_starts(batch_size)
        self._check_not_ended(step, start, start + batch_size, stage_starts)
        if rows is None:
            rows = np.arange(batch_size, dtype=np.int64)
        positions = start + np.asarray(rows, np.int64)
        if self._mixture is None:
            sources, drawn = np.zeros_like(positions), positions
        else:
            sources, drawn = self._mixture.locate(positions, stage_starts)
        parts = []
        for source in np.unique(sources).tolist():
            here = sources == source
            order = self._orders[source]
            parts.append((here, order.dataset.rows(order.indices(drawn[here]))))
        return _assemble(len(positions), self.seq_len, parts, self.packed, self.field_shapes)

    def end_position(self, batch_size: int | None = None) -> int | None:
        """The stream position where the stream ends (a batch reaching past it raises
        :class:`DataExhausted`); None when it is endless or not known yet (a source's cache
        is still being built). Never waits. ``batch_size`` places staged weights when there
        is no ``offsets`` (default: ``initial_batch_size``)."""
        if self.endless:
            return None
        stage_starts = self._stage_starts(batch_size or self._initial_batch_size)
        if stage_starts is None:
            return None
        lengths = [order.pass_length(wait=False) for order in self._orders]
        known = [length for length in lengths if length is not None]
        if len(known) < len(lengths):
            return None
        return self._end(known, stage_starts)

    def template(self, batch_size: int) -> Batch:
        """A batch of zeros with the shapes and structure of every batch of this stream (to
        compile the training step before the data is there)."""
        return _assemble(batch_size, self.seq_len, [], self.packed, self.field_shapes)

    # -- where the stream ends

    @overload
    def _stage_starts(self, batch_size: int) -> list[int]: ...
    @overload
    def _stage_starts(self, batch_size: int | None) -> list[int] | None: ...
    def _stage_starts(self, batch_size: int | None) -> list[int] | None:
        steps = [0] if self._mixture is None else self._mixture.steps
        if self._offsets is not None:
            return [int(self._offsets(step)) for step in steps]
        if batch_size is None:
            return None if len(steps) > 1 else [0]
        return [step * batch_size for step in steps]

    def _drawn_before(self, position: int, stage_starts: list[int]) -> list[int]:
        if self._mixture is None:
            return [position]
        return self._mixture.drawn_before(position, stage_starts).tolist()

    def _position_of(self, source: int, draw: int, stage_starts: list[int]) -> int | None:
        if self._mixture is None:
            return draw
        return self._mixture.position_of(source, draw, stage_starts)

    def _end(self, lengths: list[int], stage_starts: list[int]) -> int | None:
        ends = []
        if self._passes is not None:  # the first source to use up its passes ends the stream
            found = [self._position_of(s, self._passes * n, stage_starts) for s, n in enumerate(lengths)]
            ends += [min(p for p in found if p is not None)] if any(p is not None for p in found) else []
        if self.stop_strategy == "all_exhausted":  # the last source to run out ends it
            found = [self._position_of(s, n, stage_starts) for s, n in enumerate(lengths)]
            reached = [p for p in found if p is not None]
            ends += [max(reached)] if len(reached) == len(found) else []
        return min(ends) if ends else None

    def _check_not_ended(self, step: int, start: int, stop: int, stage_starts: list[int]) -> None:
        if self.endless:
            return
        needed = self._drawn_before(stop, stage_starts)
        why = None
        if self._passes is not None:
            for order, n in zip(self._orders, needed):
                if n and order.exceeds(n, self._passes):
                    length = order.pass_length(wait=True)
                    passes = f"{self._passes} passes" if self._passes > 1 else "one pass"
                    reason = "epoch" if self._passes == self.max_epochs else "data.stop_strategy: first_exhausted"
                    source = f"source {order.name!r}" if self._mixture is not None else "the training data"
                    why = f"{source} ran out after {passes} over its {length} sequences ({reason})"
                    break
        if (
            why is None
            and self.stop_strategy == "all_exhausted"
            and all(order.exceeds(n, 1) for order, n in zip(self._orders, needed))
        ):
            sources = "every source has" if self._mixture is not None else "the training data has"
            why = f"{sources} run out at least once (data.stop_strategy: all_exhausted)"
        if why is None:
            return
        lengths = [order.pass_length(wait=True) for order in self._orders]
        end = self._end(lengths, stage_starts)
        raise DataExhausted(
            step,
            f"step {step}: the training stream has ended: {why}; this batch would read stream positions "
            f"{start}..{stop - 1}, but the stream ends at position {end}",
        )


def _assemble(
    batch_size: int,
    seq_len: int,
    parts: list[tuple[np.ndarray, Batch]],
    packed: bool,
    field_shapes: Mapping[str, tuple[int, np.dtype]] | None = None,
) -> Batch:
    """One batch from row groups (``where``, rows); when ``packed``, a text source's rows get
    the packed defaults (one segment, loss everywhere but the last position). ``field_shapes``:
    the fields every row holds (zeros in a template)."""
    tokens = np.zeros((batch_size, seq_len), np.int32)
    fields = {name: np.zeros((batch_size, length), dtype) for name, (length, dtype) in (field_shapes or {}).items()}
    for where, rows in parts:
        tokens[where] = rows.tokens
        if fields:
            assert rows.fields is not None  # every source's rows hold the fields (TrainStream checks they agree)
            for name, values in fields.items():
                values[where] = rows.fields[name]
    if not packed:
        return Batch(tokens, fields=fields or None)
    loss_mask = np.ones((batch_size, seq_len), np.float32)
    loss_mask[:, -1] = 0.0
    segment_ids = np.ones((batch_size, seq_len), np.int32)
    for where, rows in parts:
        if rows.segment_ids is not None:
            loss_mask[where] = rows.loss_mask
            segment_ids[where] = rows.segment_ids
    return Batch(tokens, loss_mask, segment_ids, fields or None)
