"""Stacks of layers: scanned (``hnn.Stacked``) or unrolled (``hnn.BlockSeq``), and groups of
stacks for models whose layers are not all alike (DeepSeek-V3's first dense layers before
its mixture-of-experts layers).

Every stack reads and writes Hugging Face's per-layer tensor names (``layers.0.``,
``layers.1.``, ...). A :class:`LayerGroups` keeps that numbering across its groups: its
second group's first layer is ``layers.{len(first group)}``.
"""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import haliax.nn as hnn
import jax
from haliax import Axis
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict, from_state_dict, to_state_dict, with_prefix


def stack_layers(
    Layers: Axis,
    layer_cls: type,
    *args: Any,
    key: jax.Array,
    scan: bool,
    gradient_checkpointing: bool | str = True,
    **kwargs: Any,
) -> hnn.Stacked | hnn.BlockSeq:
    """``Layers.size`` layers of ``layer_cls`` (built by ``layer_cls.init(*args, key=..., **kwargs)``,
    each with its own key), as an ``hnn.Stacked`` (``scan``) or an ``hnn.BlockSeq``.
    ``gradient_checkpointing``: a bool or the name of a Haliax checkpointing policy
    (``levanter_core.models.lm.GradientCheckpointing``)."""
    stack = hnn.Stacked if scan else hnn.BlockSeq
    return stack.init(Layers, layer_cls, gradient_checkpointing=gradient_checkpointing)(
        *args, key=jax.random.split(key, Layers.size), **kwargs
    )


class LayerGroups(ModuleWithStateDictSerialization):
    """Consecutive stacks of layers, each of one kind (``kinds[i]``), numbered as one sequence
    in checkpoints. ``starts[i]`` is the index of group ``i``'s first layer."""

    groups: tuple[hnn.Stacked | hnn.BlockSeq, ...]
    starts: tuple[int, ...] = eqx.field(static=True)
    kinds: tuple[str, ...] = eqx.field(static=True)

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        state = {}
        for group, start in zip(self.groups, self.starts):
            for name, value in to_state_dict(group, None).items():
                index, _, rest = name.partition(".")
                state[with_prefix(prefix, f"{int(index) + start}.{rest}")] = value
        return state

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> LayerGroups:
        pattern = re.compile(rf"^{re.escape(prefix + '.') if prefix else ''}(\d+)\.(.*)$")
        per_layer: dict[int, dict[str, object]] = {}
        for name, value in state_dict.items():
            match = pattern.match(name)
            if match:
                per_layer.setdefault(int(match.group(1)), {})[match.group(2)] = value
        loaded = []
        for group, start in zip(self.groups, self.starts):
            size = _group_size(group)
            local = {f"{i}.{rest}": v for i in range(size) for rest, v in per_layer.get(start + i, {}).items()}
            loaded.append(from_state_dict(group, local, None))
        updated: LayerGroups = eqx.tree_at(lambda m: m.groups, self, tuple(loaded))
        return updated


def _group_size(group: Any) -> int:
    if isinstance(group, hnn.BlockSeq):
        return len(group.blocks)
    inner = getattr(group, "layers", group)  # the loader wraps an unrolled group
    if isinstance(inner, hnn.BlockSeq):
        return len(inner.blocks)
    size: int = group.Block.size
    return size


def runs(kinds: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """``(start, length, kind)`` of each run of equal consecutive ``kinds``."""
    out: list[tuple[int, int, str]] = []
    for i, kind in enumerate(kinds):
        if out and out[-1][2] == kind:
            start, length, _ = out[-1]
            out[-1] = (start, length + 1, kind)
        else:
            out.append((i, 1, kind))
    return out
