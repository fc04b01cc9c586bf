"""Placing a host batch on the mesh: which rows of a global batch this process holds, and the
objective's example of a batch laid out over the devices, each receiving only its own rows."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
from haliax import Axis

from levanter_core.trainer.base import TrainerBase


class BatchPlacement(TrainerBase):
    """The host-to-device part of the Trainer."""

    _local_rows: dict[int, np.ndarray]
    """The rows of a global batch of each size that this process's devices hold."""

    def local_rows(self, Batch: Axis) -> np.ndarray:
        """The rows of a global batch that this process's devices hold, in order: all of them in
        a single-process run; in a multi-process run, the only rows this process reads."""
        if Batch.size not in self._local_rows:
            sharding = self._sharding((Batch,))
            rows: set[int] = set()
            for index in sharding.addressable_devices_indices_map((Batch.size,)).values():
                rows.update(range(*index[0].indices(Batch.size)))
            self._local_rows[Batch.size] = np.array(sorted(rows), np.int64)
        return self._local_rows[Batch.size]

    def _sharding(self, axes: tuple[Axis, ...]):
        """How an array of ``axes`` (the batch axis first) lies on the mesh."""
        mapping = self.plan.placement_mapping(self.compute_mapping, axes[0])
        return hax.partitioning.sharding_for_axis(axes, mapping, self.mesh)

    def to_device(self, batch, Batch: Axis):
        """A host batch as the objective's example laid out on the mesh (an
        :class:`~levanter_core.models.lm.LmExample` for language modelling). ``batch`` is what
        the run's data gives (token ids ``[rows, seq_len]``, or a ``data.Batch``), holding either
        the whole global batch or only this process's :meth:`local_rows`; each device receives
        just its own rows of each array the objective names."""
        return self._place(self.objective.fields(batch), Batch)

    def _place(self, fields: dict, Batch: Axis):
        """The objective's example of a host batch's ``fields`` (``BatchField`` s), on the mesh."""
        present = [f.values for f in fields.values() if f.values is not None]
        if not present:
            raise ValueError("the batch holds no array")
        count = len(present[0])
        rows = self.local_rows(Batch)
        if count not in (Batch.size, len(rows)):
            raise ValueError(
                f"a batch of {count} rows is neither the global batch ({Batch.size}) nor this process's {len(rows)}"
            )
        whole = count == Batch.size

        def put(field):
            if field.values is None:
                return None
            values = np.asarray(field.values, field.dtype)
            axes = (Batch, *(Axis(name, size) for name, size in zip(field.axes, values.shape[1:])))
            shape = tuple(ax.size for ax in axes)

            def piece(index):
                wanted = np.arange(Batch.size)[index[0]]
                return values[wanted if whole else np.searchsorted(rows, wanted)][(slice(None), *index[1:])]

            return hax.named(jax.make_array_from_callback(shape, self._sharding(axes), piece), axes)

        return self.objective.example({name: put(field) for name, field in fields.items()})
