"""The device mesh, with four axes, outermost first:

* ``replica_dcn``: data-parallel replicas across process groups (TPU slices), over the
  data-center network (``trainer.replica_dcn_axis_size``);
* ``replica``: data-parallel replicas within a group (``trainer.replica_ici_axis_size``);
* ``data``: the batch and, with FSDP, the parameters (the devices left over);
* ``model``: tensor parallelism (``trainer.model_axis_size``).

The trainer config maps logical axes onto them (``TrainerConfig.compute_axis_mapping``,
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
from levanter_core.trainer.config import DATA_PARALLEL_AXES, MESH_AXES

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from levanter_core.trainer.config import TrainerConfig


def make_mesh(config: TrainerConfig, devices: list | None = None) -> Mesh:
    """The mesh of ``devices`` (default: all of the run's devices) with the axis sizes
    ``config`` asks for; a :class:`ConfigError` naming the field when they do not fit."""
    devices = list(jax.devices() if devices is None else devices)
    dcn, replica, model = config.replica_dcn_axis_size, config.replica_ici_axis_size, config.model_axis_size
    n = len(devices)
    if n % (dcn * replica * model):
        sizes = {"model_axis_size": model, "replica_ici_axis_size": replica, "replica_dcn_axis_size": dcn}
        named = [f"trainer.{name} ({size})" for name, size in sizes.items() if size > 1]
        what = f"{named[0]} does" if len(named) == 1 else f"{' x '.join(named)} = {dcn * replica * model} does"
        raise ConfigError(
            f"{what} not divide the {n} available device(s): the rest of the devices form the data axis; "
            f"choose sizes whose product divides {n}"
        )
    ici_shape = (1, replica, n // (dcn * replica * model), model)
    groups = _dcn_groups(devices, dcn)
    return Mesh(np.concatenate([_ici_mesh(ici_shape, group) for group in groups]), MESH_AXES)


def _dcn_groups(devices: list, dcn: int) -> list[list]:
    """``devices`` cut into ``dcn`` groups of whole granules (TPU slices, else processes), in
    granule order: the replicas across the data-center network."""
    granule_of = _granule_key(devices)
    granules: dict[int, list] = {}
    for device in sorted(devices, key=lambda d: (granule_of(d), d.id)):
        granules.setdefault(granule_of(device), []).append(device)
    if len(granules) % dcn:
        kind = "TPU slice(s)" if granule_of is _slice_index else "process(es)"
        raise ConfigError(
            f"trainer.replica_dcn_axis_size is {dcn}, but the run has {len(granules)} {kind}; each replica across "
            f"the data-center network is a group of whole {kind}, so the size must divide {len(granules)} "
            "(for replicas within a process, use trainer.replica_ici_axis_size)"
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
    """The data-parallel size: how many ways the batch is split (``replica_dcn x replica x data``)."""
    return math.prod(mesh.shape[axis] for axis in DATA_PARALLEL_AXES)
