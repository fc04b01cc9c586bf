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
    parameter mapping, and a parameter or activation axis for the others. Entries the config
    did not write (Levanter's ``mlp``/``heads`` defaults) are not checked: a model without
    those axes simply has nothing to split there."""
    mesh_config = config.resolved_mesh
    activation_axes = parameter_axes | {mesh_config.batch_axis_name, *ACTIVATION_AXES}
    resolved = {"param": mesh_config.parameter_axis_mapping(), "compute": mesh_config.compute_axis_mapping()}
    for which, name, field in mesh_config.written_entries():
        known = parameter_axes if which == "param" else activation_axes
        if name in known:
            continue
        mapping = resolved["compute" if which == "compute" else "param"]
        if name == "heads" and "kv_heads" in parameter_axes and mapping.get("kv_heads") == mapping.get(name):
            continue  # Levanter's [mlp, heads]: here kv_heads, which goes where heads goes
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{field.removesuffix('.' + name)} names the axis {name!r}, which the model does not have. "
            f"Its parameters have the axes {', '.join(sorted(parameter_axes))}"
            + ("" if known is parameter_axes else f"; its activations also {', '.join(sorted(known - parameter_axes))}")
            + f".{hint}"
        )


def check_divisible(config: TrainerConfig, mapping: dict[str, Any], mesh: Mesh, path: str, array: NamedArray) -> None:
    """Each axis of ``array`` (a parameter or optimizer state at ``path``) must be divisible by
    the mesh axes the parameter mapping splits it over, each mesh axis used once."""
    mesh_config = config.resolved_mesh
    used: dict[str, str] = {}
    for axis in array.axes:
        physical = mapping.get(axis.name)
        if physical is None:
            continue
        mesh_axes = (physical,) if isinstance(physical, str) else tuple(physical)
        for mesh_axis in mesh_axes:
            if mesh_axis in used:
                raise ConfigError(
                    f"{mesh_config.field_of(axis.name)} splits {axis.name!r} over mesh axis {mesh_axis!r}, "
                    f"which {mesh_config.field_of(used[mesh_axis])} already uses for {used[mesh_axis]!r} "
                    f"of the same array ({path}); map one of them to another mesh axis"
                )
            used[mesh_axis] = axis.name
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        if axis.size % ways:
            sizes = " x ".join(f"{a} ({mesh.shape[a]})" for a in mesh_axes)
            raise ConfigError(
                f"{mesh_config.field_of(axis.name)} splits the axis {axis.name!r} over mesh axis {sizes}, "
                f"but {axis.name!r} has size {axis.size} in {path}, which is not a multiple of {ways}: JAX cannot "
                f"store a parameter split unevenly. Choose {' and '.join(mesh_config.size_field(a) for a in mesh_axes)} "
                f"to divide {axis.size}, a model whose {axis.name!r} is a multiple of {ways}, or do not split it"
            )
