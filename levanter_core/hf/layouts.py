"""Fused and split layouts of Hugging Face checkpoints.

Some families store several of our projections as one tensor: Phi-3 keeps the query, key
and value projections in ``self_attn.qkv_proj`` and the gate and up projections in
``mlp.gate_up_proj``, stacked along the output dimension; GPT-OSS interleaves gate and up
columns. Our modules keep the projections apart (they are sharded, initialized and
named on their own), and these two functions rewrite a state dict between the two
layouts at the module's boundary, so a module only declares which layout its family uses
(``AttentionConfig.hf_fused_qkv``, ``GatedMlp``'s ``fused``).

Both work on state dicts in Hugging Face's ``(..., out, in)`` layout (after
``flatten_for_export``), with any leading axes (a scanned model's ``layers``) passed
through; biases are ``(..., out)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from haliax.state_dict import StateDict, with_prefix


def _concat(arrays, axis: int):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=axis)
    return jnp.concatenate([jnp.asarray(a) for a in arrays], axis=axis)


def fuse(state: StateDict, prefix: str | None, parts: Sequence[str], fused: str) -> StateDict:
    """``state`` with ``{prefix}.{part}.weight`` (and ``.bias``) of each of ``parts`` replaced
    by one ``{prefix}.{fused}.weight`` (and ``.bias``), their concatenation along the output
    dimension in the order of ``parts``."""
    out = dict(state)
    for leaf, axis in (("weight", -2), ("bias", -1)):
        names = [with_prefix(prefix, f"{part}.{leaf}") for part in parts]
        present = [n in out for n in names]
        if not any(present):
            continue
        if not all(present):
            missing = [n for n, p in zip(names, present) if not p]
            raise ValueError(f"cannot fuse {fused}.{leaf}: {', '.join(missing)} missing (all parts or none need one)")
        out[with_prefix(prefix, f"{fused}.{leaf}")] = _concat([out.pop(n) for n in names], axis)
    return out


def unfuse(state: StateDict, prefix: str | None, parts: Sequence[tuple[str, int]], fused: str) -> StateDict:
    """The inverse of :func:`fuse`: ``{prefix}.{fused}.weight`` (and ``.bias``) split along the
    output dimension into ``{prefix}.{part}.weight`` of ``size`` rows each, for each ``(part,
    size)`` of ``parts`` in order. A state dict without the fused tensor is returned as is."""
    out = dict(state)
    for leaf, axis in (("weight", -2), ("bias", -1)):
        name = with_prefix(prefix, f"{fused}.{leaf}")
        if name not in out:
            continue
        tensor = out.pop(name)
        total = sum(size for _, size in parts)
        if tensor.shape[axis] != total:
            raise ValueError(
                f"{name} has {tensor.shape[axis]} output rows; expected {total} "
                f"({' + '.join(f'{p} {s}' for p, s in parts)})"
            )
        start = 0
        for part, size in parts:
            index = [slice(None)] * tensor.ndim
            index[axis] = slice(start, start + size)
            out[with_prefix(prefix, f"{part}.{leaf}")] = tensor[tuple(index)]
            start += size
    return out
