"""Sequences of ``seq_len`` tokens read from a tokenized cache, and the batches training reads.

Three kinds of sequence dataset sit over one cache (the same cache serves any ``seq_len``),
one per format layout (:attr:`~levanter_core.data.formats.FormatConfig.layout`):

* :class:`TextSequences` (``stream``): the token stream of all documents, cut into
  consecutive ``seq_len`` windows (the tail that does not fill one is dropped);
* :class:`PackedSequences` (``packed``: chat, supervised): whole examples packed greedily, in
  order, into ``seq_len`` slots, with segment ids so attention does not cross examples and a
  loss mask from the examples' target masks;
* :class:`DocumentExamples` (``document``: audio with its transcript): each document one row,
  its tokens and its format's own arrays (``Batch.fields``) padded or cut to fixed lengths.

:class:`TrainStream` turns named datasets into the training stream: each source a stream of
passes (a keyed permutation, an era shuffle, or in order; possibly cut to a part of the
source, see ``data.max_train_batches`` and simulated epoching), mixed block-wise by
``train_weights``. The batch at step N holds stream positions ``N*B .. N*B+B-1`` (or from
the position a batch-size schedule gives) and is computed directly from (seed, data config,
position), never by reading through earlier steps; it does not depend on how fast the cache
was built, because a sequence is only read once it is final, and reading one that is not
waits for the cache. The stream is endless unless ``data.stop_strategy`` or ``epoch`` ends
it; a batch past its end raises :class:`~levanter_core.errors.DataExhausted`.

The package, one job a module: :mod:`~levanter_core.data.dataset.sequences` the sequence
datasets over one cache (and the batches evaluation reads); :mod:`~levanter_core.data.dataset.order`
which sequence each draw from one source reads (epochs, shuffling, cuts);
:mod:`~levanter_core.data.dataset.mixture` which source each stream position draws from;
:mod:`~levanter_core.data.dataset.stream` the training stream that puts those together. This
module is the public face: every name imported from ``levanter_core.data.dataset``.
"""

from levanter_core.data.dataset.mixture import block_counts
from levanter_core.data.dataset.sequences import (
    TOO_SHORT_HINT,
    Batch,
    DocumentExamples,
    PackedSequences,
    SequenceDataset,
    SlicedSequences,
    TextSequences,
    eval_batches,
    held_out,
    sequence_dataset,
)
from levanter_core.data.dataset.stream import TrainStream

__all__ = [
    "TOO_SHORT_HINT",
    "Batch",
    "DocumentExamples",
    "PackedSequences",
    "SequenceDataset",
    "SlicedSequences",
    "TextSequences",
    "TrainStream",
    "block_counts",
    "eval_batches",
    "held_out",
    "sequence_dataset",
]
