"""What an architecture plugin provides to be importable from and exportable to Hugging
Face, and the state-dict conversion the core does with it.

A plugin's model config also subclasses :class:`HfConvertible` (config translation),
and its modules use Hugging Face's parameter names as their field names, so that
Haliax's state-dict serialization (``haliax.state_dict``: linear layers flattened to
``(out, in)``, scanned layers unstacked into ``layers.0``, ``layers.1``, ...) yields the
Hugging Face tensor names directly. A module whose layout differs (stacked experts,
say) overrides ``to_state_dict``/``from_state_dict`` as Haliax allows. A layer may be a
plain ``eqx.Module`` whether the layers are stacked (``hnn.Stacked``) or unrolled
(``hnn.BlockSeq``, ``scan_layers: false``): both read and write the same tensor names.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import logging
from typing import Any, ClassVar, Self

import equinox as eqx
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from haliax.state_dict import (
    ModuleWithStateDictSerialization,
    StateDict,
    flatten_modules_for_export,
    from_state_dict,
    to_state_dict,
    unflatten_modules_from_export,
    with_prefix,
)

from levanter_core.errors import CheckpointError
from levanter_core.hf.checkpoint import HfCheckpoint

logger = logging.getLogger(__name__)


class HfConvertible(abc.ABC):
    """Mixin for a model config (an :class:`~levanter_core.models.lm.LmConfig`) that maps
    to a Hugging Face architecture."""

    hf_architecture: ClassVar[str]
    """The ``transformers`` class name written into ``architectures`` (``LlamaForCausalLM``)."""

    @classmethod
    @abc.abstractmethod
    def from_hf_config(cls, hf_config: dict) -> Self:
        """Our config equivalent to a Hugging Face ``config.json`` (as a dict). ``seq_len``
        becomes ``max_position_embeddings``. Raise ``ValueError`` for settings we do not
        support, naming them."""

    @abc.abstractmethod
    def to_hf_config(self, vocab_size: int) -> dict:
        """The ``config.json`` contents for this config (``model_type`` included; the core
        adds ``architectures`` and ``torch_dtype``)."""

    def hf_ignored_tensors(self) -> frozenset[str]:
        """Tensor names a Hugging Face checkpoint may hold that this model does not use
        (e.g. ``lm_head.weight`` when the embeddings are tied)."""
        return frozenset()

    def hf_position_tensors(self) -> frozenset[str]:
        """Tensor names (Hugging Face's) with one row per position, such as learned position
        embeddings (GPT-2's ``transformer.wpe.weight``). A model whose ``seq_len`` is shorter
        than the checkpoint's positions loads their first ``seq_len`` rows, as Levanter does
        (training a base model on shorter sequences: ``max_train_length``); a longer one is an
        error naming ``seq_len`` and the checkpoint's positions."""
        return frozenset()


def hf_state_dict_shapes(config: Any, Vocab: Axis) -> dict[str, jax.ShapeDtypeStruct]:
    """The tensor names, shapes and dtypes of ``config``'s model as Hugging Face stores them,
    computed without allocating the model."""
    key = jax.random.PRNGKey(0)
    return eqx.filter_eval_shape(lambda: to_state_dict(flatten_modules_for_export(config.build(Vocab, key=key))))


def to_hf_state_dict(model: Any) -> dict[str, np.ndarray]:
    """The model's parameters under their Hugging Face names, as host NumPy arrays."""
    flat = to_state_dict(flatten_modules_for_export(model))
    return {name: np.asarray(jax.device_get(value)) for name, value in flat.items()}


def check_fits(expected: dict[str, jax.ShapeDtypeStruct], checkpoint: HfCheckpoint, *, ignored=frozenset()) -> None:
    """Raise one :class:`CheckpointError` listing every tensor of ``checkpoint`` that does not
    fit ``expected``: missing, unexpected, of another shape, of a non-float dtype where a
    float is expected, or unreadable (a truncated shard). Floating-point widths convert
    freely (a bfloat16 checkpoint loads into a float32 model)."""

    def show(shape, dtype) -> str:
        return f"{dtype}{list(shape)}"

    problems = []
    for name, want in sorted(expected.items()):
        found = checkpoint.tensors.get(name)
        wanted = show(want.shape, want.dtype)
        if name in checkpoint.damaged:
            problems.append(f"  {name}: expected {wanted}; {checkpoint.damaged[name]}")
        elif found is None:
            problems.append(f"  {name}: expected {wanted}, missing from the checkpoint")
        elif tuple(found.shape) != tuple(want.shape):
            problems.append(f"  {name}: expected {wanted}, found {show(found.shape, found.dtype)}")
        elif _is_float(want.dtype) != _is_float(found.dtype):
            problems.append(f"  {name}: expected {wanted}, found {show(found.shape, found.dtype)} (incompatible dtype)")
    for name in sorted(checkpoint.tensors.keys() - expected.keys() - set(ignored)):
        found = checkpoint.tensors[name]
        problems.append(f"  {name}: found {show(found.shape, found.dtype)}, which the model does not have")
    if problems:
        raise CheckpointError(
            f"the Hugging Face checkpoint {checkpoint.directory} does not fit the model "
            f"({len(problems)} tensor(s) differ):\n" + "\n".join(problems) + "\nNothing was loaded."
        )


def _is_float(dtype) -> bool:
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    return name.startswith(("float", "bfloat"))


def load_hf_weights(config: Any, Vocab: Axis, checkpoint: HfCheckpoint, *, dtype=np.float32) -> Any:
    """Build ``config``'s model with the checkpoint's weights (cast to ``dtype``), after
    checking that every tensor fits (:func:`check_fits`). A checkpoint of the family's base
    model, saved without the prefix of the model's names, loads too."""
    expected = hf_state_dict_shapes(config, Vocab)
    checkpoint = checkpoint.with_base_model_prefix(expected)
    ignored = config.hf_ignored_tensors() if isinstance(config, HfConvertible) else frozenset()
    checkpoint, rows = _positions_cut_to(config, expected, checkpoint)
    check_fits(expected, checkpoint, ignored=ignored)
    state_dict = {name: checkpoint.read(name)[: rows.get(name)].astype(dtype) for name in expected}
    key = jax.random.PRNGKey(0)
    template = eqx.filter_eval_shape(lambda: config.build(Vocab, key=key))
    return from_hf_state_dict(template, state_dict)


def _positions_cut_to(
    config: Any, expected: dict[str, jax.ShapeDtypeStruct], checkpoint: HfCheckpoint
) -> tuple[HfCheckpoint, dict[str, int]]:
    """``checkpoint`` seen with its position tensors (:meth:`HfConvertible.hf_position_tensors`)
    cut to the model's ``seq_len`` rows, and the rows to read of each one cut. Raises
    :class:`CheckpointError` naming ``seq_len`` when the model has more positions than the
    checkpoint."""
    names = config.hf_position_tensors() if isinstance(config, HfConvertible) else frozenset()
    rows, tensors = {}, dict(checkpoint.tensors)
    for name in sorted(names & expected.keys() & tensors.keys()):
        want, found = tuple(expected[name].shape), tensors[name].shape
        if len(want) != len(found) or want[1:] != tuple(found[1:]) or want[0] == found[0]:
            continue  # another architecture altogether: check_fits lists it
        if want[0] > found[0]:
            raise CheckpointError(
                f"model.seq_len is {want[0]} (max_train_length, when set, gives it), but the Hugging Face "
                f"checkpoint {checkpoint.directory} has learned position embeddings for {found[0]} positions only "
                f"({name}: {list(found)}): set model.seq_len (or max_train_length) to {found[0]} or less"
            )
        logger.info("using the first %d of the %d positions of %s (model.seq_len %d)", want[0], found[0], name, want[0])
        rows[name] = want[0]
        tensors[name] = dataclasses.replace(tensors[name], shape=want)
    if not rows:
        return checkpoint, rows
    view = copy.copy(checkpoint)
    view.tensors = tensors
    return view, rows


def from_hf_state_dict(template: Any, state_dict: dict[str, Any]) -> Any:
    """``template`` (a model, or its shapes from ``eqx.filter_eval_shape``) with the values of
    ``state_dict``, a dict in Hugging Face's names and layouts (the inverse of
    :func:`to_hf_state_dict`).

    Haliax's ``from_torch_compatible_state_dict``, except that the layers of an unrolled
    stack (``hnn.BlockSeq``) need not implement ``from_state_dict`` themselves: Haliax's
    ``BlockSeq`` calls that method on each layer, which a plain ``eqx.Module`` lacks."""
    model = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, template)
    if jax.device_count() > 1 and jax.sharding.get_abstract_mesh().empty:
        # Haliax shards host arrays over the current mesh when several devices exist, and
        # there is none outside training (levanter eval, serve, sample): place them whole.
        state_dict = {name: jnp.asarray(value) for name, value in state_dict.items()}
    flat = flatten_modules_for_export(model)
    loaded = from_state_dict(_loadable_stacks(flat), state_dict)
    return unflatten_modules_from_export(loaded, model)


def _loadable_stacks(tree: Any) -> Any:
    """``tree`` with each ``hnn.BlockSeq`` wrapped in an :class:`_UnrolledLayers`."""
    is_seq = lambda x: isinstance(x, hnn.BlockSeq)
    return jax.tree.map(lambda x: _UnrolledLayers(x) if is_seq(x) else x, tree, is_leaf=is_seq)


class _UnrolledLayers(ModuleWithStateDictSerialization):
    """Stands in for an ``hnn.BlockSeq`` while a state dict is read, and becomes the
    ``BlockSeq`` again: reads layer ``i`` from ``{prefix}.{i}.`` with Haliax's generic
    ``from_state_dict``, which handles any module."""

    layers: hnn.BlockSeq

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> hnn.BlockSeq:
        blocks = [
            from_state_dict(_loadable_stacks(block), state_dict, with_prefix(prefix, str(i)))
            for i, block in enumerate(self.layers.blocks)
        ]
        return eqx.tree_at(lambda seq: seq.blocks, self.layers, blocks)
