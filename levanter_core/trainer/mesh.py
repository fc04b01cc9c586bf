"""The device mesh: a ``data`` axis (data parallelism and FSDP) and a ``model`` axis
(tensor parallelism), with logical axes mapped onto them by the trainer config."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from levanter_core.errors import ConfigError
from levanter_core.trainer.config import TrainerConfig


def make_mesh(config: TrainerConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    n, m = len(devices), config.model_axis_size
    if n % m:
        raise ConfigError(
            f"trainer.model_axis_size is {m}, which does not divide the {n} available device(s); "
            f"choose a divisor of {n}"
        )
    return Mesh(np.array(devices).reshape(n // m, m), ("data", "model"))


def data_axis_size(mesh: Mesh) -> int:
    return mesh.shape["data"]
