"""Where scores are computed: on this process's devices, or on every process of a
``jax.distributed`` run in step.

lm-eval is not written for several processes that each hold part of a model: it decides on
one process which requests to make. So process 0 runs lm-eval (through :class:`Scorer`) and
every other process runs :func:`follow`: before each batch, process 0 broadcasts what comes
next (a small header, then the batch's arrays), and every process feeds the same arrays to the
same compiled function, each computing its part of the batch's rows. In a single process the
broadcasts are skipped.

Before each header the processes first meet at a barrier of the coordination service, which
waits as long as a run's other barriers: process 0 may work alone for a long time between two
messages (indexing lm-eval's tasks, loading their data, generating), longer than a collective
of the CPU backend waits for its peers (30 s) before it fails.
"""

from __future__ import annotations

import itertools
import logging

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from haliax import Axis
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from levanter_core import distributed
from levanter_core.inference import decoding
from levanter_core.models.lm import DEFAULT_BLOCK_LOGITS
from levanter_eval_harness.scoring import Batch, continuation_scores, prefixed_scores

logger = logging.getLogger(__name__)

# What process 0 tells the others to do next (the first entry of each header).
_STOP, _SCORE, _GATHER, _SCORE_PREFIXED = 0, 1, 2, 3
_HEADER = 5  # op, rows, length, queries, width
# Each Leader (in process 0) and each follow() (in the others) is one session of messages; every
# process counts them in the same order, so their barriers have the same names.
_sessions = itertools.count()


class Scorer:
    """Scores :class:`~levanter_eval_harness.scoring.Batch` es with ``model``.

    ``mesh`` and ``compute_mapping`` (a training run's) lay the batch's rows out along the
    mapping's ``batch`` axes, as the trainer lays out its evaluation batches; without them the
    model runs where its arrays are. ``cast`` (the trainer's ``mp.cast_to_compute``) is applied
    to the model inside the compiled function."""

    def __init__(self, model, *, mesh=None, compute_mapping=None, cast=None):
        self.model = model
        self.mesh = mesh
        self.compute_mapping = dict(compute_mapping or {})
        self.cast = cast
        backend = jax.default_backend()
        block = DEFAULT_BLOCK_LOGITS.get(backend, DEFAULT_BLOCK_LOGITS["gpu"])

        def scores(model, tokens, row, start, targets, mask, suffix=None):
            if cast is not None:
                model = cast(model)
            if suffix is None:
                return continuation_scores(model, tokens, row, start, targets, mask, block_logits=block)
            return prefixed_scores(model, tokens, row, start, targets, mask, suffix, block_logits=block)

        self._scores = hax.named_jit(scores, axis_resources=self.compute_mapping or None)
        self.shapes: set[tuple[int, ...]] = set()
        """The batch shapes compiled so far (rows, length, queries, width)."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether batches may share prefixes: the model has a key/value cache."""
        return decoding.has_cache(self.model)

    @property
    def row_multiple(self) -> int:
        """The number of rows of a batch must be a multiple of this (the devices the rows are
        split over)."""
        if self.mesh is None:
            return 1
        axes = self.compute_mapping.get("batch")
        if axes is None:
            return 1
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def run(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """The summed log-probability and the greedy flag of each of the batch's queries (in
        :attr:`Batch.indices` order). With several processes, every process calls this with the
        same batch."""
        tokens, *rest = batch.arrays()
        self.shapes.add((batch.suffix is not None, *tokens.shape, *batch.targets.shape))
        axes = (Axis("batch", tokens.shape[0]), Axis("position", tokens.shape[1]))
        if self.mesh is None:
            named = hax.named(jax.numpy.asarray(tokens), axes)
            logprob, greedy = self._scores(self.model, named, *rest)
        else:
            with hax.partitioning.set_mesh(self.mesh):
                named = hax.named(self._put(tokens, sharded=True), axes)
                logprob, greedy = self._scores(self.model, named, *(self._put(a, sharded=False) for a in rest))
        n = len(batch.indices)
        return _host(logprob)[:n].astype(np.float64), _host(greedy)[:n].astype(bool)

    def _put(self, array: np.ndarray, *, sharded: bool):
        """``array`` (the same in every process) as a global array on the mesh: rows split over
        the batch's axes, or whole on every device."""
        spec = PartitionSpec(self.compute_mapping.get("batch")) if sharded else PartitionSpec()
        sharding = NamedSharding(self.mesh, spec)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _host(x) -> np.ndarray:
    """A result as a numpy array in every process (every process must call this)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def multi_process() -> bool:
    return jax.process_count() > 1


class Leader:
    """Process 0's side: tells the followers what to compute before computing it too."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self._session = next(_sessions) if multi_process() else 0
        self._sent = 0

    def score(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        if multi_process():
            self._send(_SCORE if batch.suffix is None else _SCORE_PREFIXED, batch)
        return self.scorer.run(batch)

    def gather_model(self):
        """The model whole on one device of this process (for generating, which process 0 does
        alone), in the compute precision; the followers take part in the gathering."""
        if self.scorer.mesh is None:
            model = self.scorer.model
        else:
            if multi_process():
                self._send(_GATHER, None)
            model = _gathered(self.scorer.model)
        return model if self.scorer.cast is None else self.scorer.cast(model)

    def stop(self) -> None:
        """Release the followers (they return from :func:`follow`)."""
        if multi_process():
            self._send(_STOP, None)

    def _send(self, op: int, batch: Batch | None) -> None:
        header = np.zeros(_HEADER, np.int32)
        header[0] = op
        if batch is not None:
            header[1:] = (*batch.tokens.shape, *batch.targets.shape)
        _meet(self._session, self._sent)
        self._sent += 1
        multihost_utils.broadcast_one_to_all(header)
        if batch is not None:
            multihost_utils.broadcast_one_to_all(batch.arrays())


def follow(scorer: Scorer) -> int:
    """A follower's loop: compute what process 0 asks for until it says stop. Returns how many
    batches were scored."""
    done, session, message = 0, next(_sessions), 0
    while True:
        _meet(session, message)
        message += 1
        header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32)))
        op = int(header[0])
        if op == _STOP:
            return done
        if op == _GATHER:
            _gathered(scorer.model)
            continue
        rows, length, queries, width = (int(v) for v in header[1:])
        empty = (
            np.zeros((rows, length), np.int32),
            np.zeros(queries, np.int32),
            np.zeros(queries, np.int32),
            np.zeros((queries, width), np.int32),
            np.zeros((queries, width), bool),
        )
        if op == _SCORE_PREFIXED:
            empty += (np.zeros((queries, width), np.int32),)
        arrays = [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(empty)]
        scorer.run(Batch([], *arrays))
        done += 1


def _meet(session: int, message: int) -> None:
    """Every process waits here before ``message`` of ``session`` is broadcast (see the module's
    docstring)."""
    distributed.barrier(f"eval_harness/{session}/{message}")


def _gathered(model):
    """``model`` with every array whole on this process's first device (every process calls it)."""
    arrays, rest = eqx.partition(model, eqx.is_array)
    local = multihost_utils.process_allgather(arrays, tiled=True)
    device = jax.local_devices()[0]
    return eqx.combine(jax.tree.map(lambda a: jax.device_put(np.asarray(a), device), local), rest)


def replicate(model, mesh):
    """``model`` (loaded by every process onto its own first device) as global arrays held
    whole on every device of ``mesh``, so that a program over the mesh can use it."""
    sharding = NamedSharding(mesh, PartitionSpec())
    arrays, rest = eqx.partition(model, eqx.is_array)
    leaves, structure = jax.tree.flatten(arrays)
    host = [np.asarray(x) for x in leaves]
    placed = [jax.make_array_from_callback(h.shape, sharding, lambda index, h=h: h[index]) for h in host]
    return eqx.combine(jax.tree.unflatten(structure, placed), rest)
