"""How a global batch is cut up: over the data-parallel devices, and into the microbatches of
gradient accumulation (``per_device_parallelism``), for each batch size of the schedule."""

from __future__ import annotations

import dataclasses
from typing import Any

from haliax import Axis

from levanter_core.errors import ConfigError
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh_config import MODEL_AXIS


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How the global batch is cut up across devices and microbatches.

    ``data_parallel_size`` is how many ways the batch is split (``replica_dcn x replica x data``
    devices). Batches are multiples of it, unless ``trainer.allow_nondivisible_batch_size``."""

    batch_size: int
    microbatch_size: int
    eval_batch_size: int
    data_parallel_size: int = 1

    @property
    def num_microbatches(self) -> int:
        return self.batch_size // self.microbatch_size

    def placement_mapping(self, mapping: dict[str, Any], Batch: Axis) -> dict[str, Any]:
        """The axis mapping to place a host batch of ``Batch`` rows on the mesh with:
        ``mapping`` itself, or ``mapping`` without ``Batch`` when the rows do not split evenly
        over the data-parallel devices. JAX cannot store an unevenly split array, so such a
        batch goes whole to every device, and the sharding constraints inside the step (which
        may be uneven) split the activations over the devices."""
        if Batch.size % self.data_parallel_size == 0:
            return mapping
        return {name: physical for name, physical in mapping.items() if name != Batch.name}

    @staticmethod
    def from_config(config: TrainerConfig, data_size: int, batch: int | None = None) -> BatchPlan:
        """The plan for ``config`` on ``data_size`` data-parallel devices, for batches of ``batch``
        sequences (default: the first of ``train_batch_size``'s schedule); a :class:`ConfigError`
        naming the field when the sizes do not fit."""
        if batch is None:
            batch = config.batch_schedule.size_at(0)
        if batch % data_size and not config.allow_nondivisible_batch_size:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be a multiple of the {data_size} data-parallel device(s) "
                f"(devices / {config.resolved_mesh.size_field(MODEL_AXIS)}); choose a multiple, or set "
                "trainer.allow_nondivisible_batch_size: true to split it unevenly (at the cost of a copy of each "
                "batch on every device)"
            )
        per_device = config.per_device_parallelism
        micro = batch if per_device == -1 else per_device * data_size
        if micro > batch or batch % micro:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be a multiple of per_device_parallelism ({per_device}) "
                f"x {data_size} data-parallel device(s) = {micro}"
            )
        per_device_eval = config.per_device_eval_parallelism
        eval_batch = micro if per_device_eval == -1 else per_device_eval * data_size
        return BatchPlan(batch, micro, eval_batch, data_size)
