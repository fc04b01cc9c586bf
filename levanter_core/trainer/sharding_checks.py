"""The checks, before anything is compiled, that the axis mappings of ``trainer`` fit the model:
each logical axis they name is one the model has, and each parameter axis they split divides
over its mesh axes. Each raises a :class:`~levanter_core.errors.ConfigError` naming the field."""

from __future__ import annotations

import difflib
import math
from typing import Any

from haliax import NamedArray
from jax.sharding import Mesh

from levanter_core.errors import ConfigError
from levanter_core.trainer.config import TrainerConfig

ACTIVATION_AXES = ("position", "key_position")
"""Logical axes of every language model's activations that no parameter has (``LmConfig.Pos``,
``KeyPos``): compute mappings may name them (sequence parallelism), parameter mappings not."""


def check_axis_names(config: TrainerConfig, parameter_axes: set[str]) -> None:
    """Every logical axis the config maps must be one the model has: a parameter axis for the
    parameter-only fields, and a parameter or activation axis for the others."""
    activation_axes = parameter_axes | {config.batch_axis, *ACTIVATION_AXES}
    fields: list[tuple[str, list[str], set[str]]] = [
        ("trainer.fsdp_axis", config.fsdp_axes, parameter_axes),
        ("trainer.parameter_axis_resources", list(config.parameter_axis_resources), parameter_axes),
        ("trainer.tensor_parallel_axes", list(config.tensor_parallel_axes or []), activation_axes),
        ("trainer.axis_resources", list(config.axis_resources), activation_axes),
        ("trainer.compute_axis_resources", list(config.compute_axis_resources), activation_axes),
    ]
    for field, names, known in fields:
        for name in names:
            if name == "heads" and field == "trainer.tensor_parallel_axes" and "kv_heads" in parameter_axes:
                continue  # Levanter's [mlp, heads]: here kv_heads (see TrainerConfig.tensor_parallel_axes)
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{field} names the axis {name!r}, which the model does not have. "
                    f"Its parameters have the axes {', '.join(sorted(parameter_axes))}"
                    + (
                        ""
                        if known is parameter_axes
                        else f"; its activations also {', '.join(sorted(known - parameter_axes))}"
                    )
                    + f".{hint}"
                )


_MESH_SIZE_SOURCE = {
    "replica_dcn": "trainer.replica_dcn_axis_size",
    "replica": "trainer.replica_ici_axis_size",
    "data": "the data axis size (devices / (model_axis_size x replica sizes))",
    "model": "trainer.model_axis_size",
}
"""Where each mesh axis's size comes from, for error messages."""


def check_divisible(config: TrainerConfig, mapping: dict[str, Any], mesh: Mesh, path: str, array: NamedArray) -> None:
    """Each axis of ``array`` (a parameter or optimizer state at ``path``) must be divisible by
    the mesh axes the parameter mapping splits it over, each mesh axis used once."""
    used: dict[str, str] = {}
    for axis in array.axes:
        physical = mapping.get(axis.name)
        if physical is None:
            continue
        mesh_axes = (physical,) if isinstance(physical, str) else tuple(physical)
        for mesh_axis in mesh_axes:
            if mesh_axis in used:
                raise ConfigError(
                    f"{config.parameter_axis_field(axis.name)} splits {axis.name!r} over mesh axis {mesh_axis!r}, "
                    f"which {config.parameter_axis_field(used[mesh_axis])} already uses for {used[mesh_axis]!r} "
                    f"of the same array ({path}); map one of them to another mesh axis"
                )
            used[mesh_axis] = axis.name
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        if axis.size % ways:
            sizes = " x ".join(f"{a} ({mesh.shape[a]})" for a in mesh_axes)
            raise ConfigError(
                f"{config.parameter_axis_field(axis.name)} splits the axis {axis.name!r} over mesh axis {sizes}, "
                f"but {axis.name!r} has size {axis.size} in {path}, which is not a multiple of {ways}: JAX cannot "
                f"store a parameter split unevenly. Choose {' and '.join(_MESH_SIZE_SOURCE[a] for a in mesh_axes)} "
                f"to divide {axis.size}, a model whose {axis.name!r} is a multiple of {ways}, or do not split it"
            )
