"""The device mesh, with seven axes, outermost first:

* ``replica_dcn``: data-parallel replicas across process groups (TPU slices), over the
  data-center network (``trainer.mesh.dcn_axes.replica_dcn``, or ``trainer.replica_dcn_axis_size``);
* ``stage``: the layers in consecutive stages, where ``layers`` is mapped onto it (pipeline
  parallelism, by default when its size is not 1; ``trainer.mesh.axes.stage``);
* ``replica``: data-parallel replicas within a group (``trainer.mesh.axes.replica``, or
  ``trainer.replica_ici_axis_size``);
* ``data``: the batch and, with FSDP, the parameters (by default the devices left over);
* ``expert``: a mixture of experts' experts, where ``experts`` is mapped onto it (expert
  parallelism; ``trainer.mesh.axes.expert``), and the batch;
* ``context``: the positions of each sequence, where ``position`` is mapped onto it (context
  parallelism; ``trainer.mesh.axes.context``);
* ``model``: tensor parallelism (``trainer.mesh.axes.model``, or ``trainer.model_axis_size``).

The sizes and the mappings of logical axes onto them come from the trainer config's
:attr:`~levanter_core.trainer.config.TrainerConfig.resolved_mesh` (``compute_axis_mapping``,
``parameter_axis_mapping``). Devices are laid out in process order, so each process's devices
form a contiguous block of the data-parallel axes, and with them of the batch rows (unless the
TPU topology asks for another order).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from levanter_core.errors import ConfigError
from levanter_core.trainer.mesh_config import (
    CONTEXT_AXIS,
    DATA_AXIS,
    DATA_PARALLEL_AXES,
    EXPERT_AXIS,
    MESH_AXES,
    MODEL_AXIS,
    REPLICA_AXIS,
    REPLICA_DCN_AXIS,
    STAGE_AXIS,
    MeshConfig,
)

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from levanter_core.trainer.config import TrainerConfig


def make_mesh(config: TrainerConfig, devices: list | None = None) -> Mesh:
    """The mesh of ``devices`` (default: all of the run's devices) with the axis sizes
    ``config`` asks for (its :attr:`~levanter_core.trainer.config.TrainerConfig.resolved_mesh`);
    a :class:`ConfigError` naming the field when they do not fit."""
    devices = list(jax.devices() if devices is None else devices)
    mesh_config = config.resolved_mesh
    granule_of = _granule_key(devices)
    slices = len({d.slice_index for d in devices}) if granule_of is _slice_index else 1
    sizes = mesh_config.resolved_sizes(len(devices), slices)
    ici_shape = (
        1,
        *(sizes[axis] for axis in (STAGE_AXIS, REPLICA_AXIS, DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)),
    )
    groups = _dcn_groups(devices, sizes[REPLICA_DCN_AXIS], mesh_config)
    return Mesh(np.concatenate([_ici_mesh(ici_shape, group) for group in groups]), MESH_AXES)


def _dcn_groups(devices: list, dcn: int, mesh_config: MeshConfig) -> list[list]:
    """``devices`` cut into ``dcn`` groups of whole granules (TPU slices, else processes), in
    granule order: the replicas across the data-center network."""
    granule_of = _granule_key(devices)
    granules: dict[int, list] = {}
    for device in sorted(devices, key=lambda d: (granule_of(d), d.id)):
        granules.setdefault(granule_of(device), []).append(device)
    if len(granules) % dcn:
        kind = "TPU slice(s)" if granule_of is _slice_index else "process(es)"
        raise ConfigError(
            f"{mesh_config.size_field(REPLICA_DCN_AXIS)} is {dcn}, but the run has {len(granules)} {kind}; each "
            f"replica across the data-center network is a group of whole {kind}, so the size must divide "
            f"{len(granules)} (for replicas within a process, use {mesh_config.size_field(REPLICA_AXIS)})"
        )
    per_group = len(granules) // dcn
    ordered = list(granules.values())
    return [[d for granule in ordered[i * per_group : (i + 1) * per_group] for d in granule] for i in range(dcn)]


def _granule_key(devices: list):
    """TPU slices on TPU (where multislice runs set ``slice_index``), processes elsewhere."""
    on_tpu = all(d.platform == "tpu" and getattr(d, "slice_index", None) is not None for d in devices)
    return _slice_index if on_tpu else _process_index


def _slice_index(device) -> int:
    return device.slice_index


def _process_index(device) -> int:
    return device.process_index


def _ici_mesh(shape: tuple[int, ...], devices: list) -> np.ndarray:
    """``devices`` (one DCN group) as an array of ``shape``: laid out by JAX for the hardware's
    topology where it knows it (TPU), else in the given order."""
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):  # a topology JAX cannot tile this shape on
        return np.asarray(devices).reshape(shape)


def data_axis_size(mesh: Mesh) -> int:
    """The data-parallel size: how many ways the batch is split (``replica_dcn x replica x data x expert``)."""
    return math.prod(mesh.shape[axis] for axis in (*DATA_PARALLEL_AXES, EXPERT_AXIS))
