"""``type: mini``: Adam-mini, Adam with one second-moment value per block of parameters.

Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More",
https://arxiv.org/abs/2406.16793) keeps Adam's first moment per parameter but replaces the
second moment by one running mean of ``mean(g**2)`` over each block, a group of parameters that
then share a learning rate. The blocks follow the structure of a transformer's Hessian; here they
are read off the axis names of Haliax's layers:

- query and key projections (an ``hnn.Linear`` whose output axes include ``heads``,
  ``kv_heads`` or ``q_heads_per_group``): one block per attention head;
- value projections (such a layer named ``v_proj``, ``wv`` or ``value``, or the values' third
  of a fused projection with a ``qkv`` output axis, as GPT-2's ``c_attn``): one per output
  neuron;
- every other linear layer (attention output, MLP, LM head, experts of an ``hnn.MoELinear``):
  one per output neuron, that is one per token for an LM head;
- embeddings (``hnn.Embedding``): one per token (per row);
- everything else (biases, norms, plain arrays, such as the core's mixture-of-experts
  ``Experts`` and router): one per parameter, as in Adam.

Axes a weight has beyond its layer's own (the ``layers`` axis of stacked blocks, ``experts``)
always separate blocks. The stored second moment has only the axes it varies along, so it takes
a fraction of Adam's memory.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu
from pydantic import Field, model_validator

from levanter_core.optim.config import OptimizerConfig

HEAD_AXES = frozenset({"heads", "kv_heads", "q_heads_per_group"})
"""Output axes that mark a linear layer as an attention projection with one block per head."""
VALUE_PROJECTIONS = frozenset({"v_proj", "wv", "value"})
"""Names of attention projections that produce values: one block per output neuron, not per head."""
FUSED_QKV_AXIS = "qkv"
"""Output axis of a fused projection: queries, keys, then values (GPT-2's ``c_attn``)."""


class MiniConfig(OptimizerConfig):
    """Adam-mini (Zhang et al. 2024) with Levanter's fields and defaults; see the module's
    docstring for the blocks.

    Deviations from Levanter, which picks blocks by parameter name and axis position, fitted to
    its scanned Llama: here blocks come from axis names, so they are the paper's for any model,
    stacked or not. (Levanter shares one value per group of query heads under grouped-query
    attention, gives Llama's ``embed_tokens`` and an unscanned model's MLP layers plain Adam,
    and in GPT-2's fused ``c_attn`` shares values across heads instead of within them.)
    ``max_grad_norm`` clips the global norm of all gradients (Levanter clips only the biases'
    and norms' gradients, by their own norm). ``nesterov`` takes effect (Levanter ignores it).
    """

    lr: float = Field(0.02, ge=0)
    """Accepted for Levanter's configs and, as there, without effect: the learning rate is
    ``learning_rate``."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (as in AdamW), scaled by the learning rate. 0 turns it off."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Decay rate of the running mean of gradients (Adam's first moment)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Decay rate of each block's running mean of squared gradients (the shared second moment)."""
    epsilon: float = Field(1e-8, ge=0)
    """Added to the root of the second moment before dividing, for numerical stability."""
    max_grad_norm: float | None = Field(1.0, ge=0)
    """Clip gradients so their global L2 norm is at most this. None or 0 turns clipping off."""
    nesterov: bool = False
    """Use Nesterov momentum (NAdam-style) for the first moment."""

    @model_validator(mode="after")
    def _warn_lr(self):
        if "lr" in self.model_fields_set:
            warnings.warn(
                "optimizer.lr has no effect for type mini (nor in Levanter); set learning_rate instead",
                UserWarning,
                stacklevel=2,
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Clip, scale by Adam-mini, add decayed weights, scale by the scheduled learning rate."""
        parts = []
        if self.max_grad_norm:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(scale_by_adam_mini(self.beta1, self.beta2, self.epsilon, nesterov=self.nesterov))
        parts += self.decayed_weights()
        parts.append(optax.scale_by_learning_rate(self.lr_scheduler(num_train_steps)))
        return optax.chain(*parts)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How one NamedArray's parameters share second-moment values."""

    keep: tuple[str, ...]
    """Axes the second moment varies along; it is averaged over all the others."""
    per_head_in_qk: tuple[str, ...] = ()
    """For a fused ``qkv`` projection: axes further averaged over in the query and key slices
    (within a head), not in the value slice."""


def _names(spec) -> tuple[str, ...]:
    if spec is None:
        return ()
    if isinstance(spec, (str, hax.Axis)):
        spec = (spec,)
    return tuple(hax.axis_name(axis) for axis in spec)


def _linear_blocks(layer, name: str | None) -> Blocks:
    axes = _names(layer.weight.axes)
    inputs, outputs = set(_names(layer.In)), _names(layer.Out)
    keep = tuple(a for a in axes if a not in inputs)
    if not HEAD_AXES.intersection(outputs) or name in VALUE_PROJECTIONS:
        return Blocks(keep)
    # within a head: what is neither a head axis nor the qkv split (head_size)
    within_head = tuple(a for a in outputs if a not in HEAD_AXES and a != FUSED_QKV_AXIS)
    if FUSED_QKV_AXIS in outputs:
        return Blocks(keep, per_head_in_qk=within_head)
    return Blocks(tuple(a for a in keep if a not in within_head))


def _is_block_layer(node) -> bool:
    return isinstance(node, (hnn.Linear, hnn.MoELinear, hnn.Embedding))


def second_moment_blocks(tree) -> dict[tuple, Blocks]:
    """The :class:`Blocks` of the weights of the linear layers and embeddings in ``tree``
    (parameters or gradients), by key path (as ``jax.tree_util.tree_flatten_with_path`` gives it
    with NamedArrays as leaves). Arrays not listed have one block per parameter."""
    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_block_layer(x) or hax.is_named_array(x))
    found = {}
    for path, node in nodes:
        if not _is_block_layer(node) or not hax.is_named_array(node.weight):
            continue
        if isinstance(node, hnn.Embedding):
            embed = set(_names(node.Embed))
            blocks = Blocks(tuple(a for a in _names(node.weight.axes) if a not in embed))
        else:
            last = path[-1] if path else None
            blocks = _linear_blocks(node, last.name if isinstance(last, jax.tree_util.GetAttrKey) else None)
        found[path + (jax.tree_util.GetAttrKey("weight"),)] = blocks
    return found


def block_mean(squares: Any, blocks: Blocks | None) -> Any:
    """The mean of ``squares`` (a NamedArray, or a plain array with ``blocks`` None) over each
    block: an array with only the axes the second moment varies along."""
    if blocks is None:
        return squares
    within = tuple(a for a in _names(squares.axes) if a not in blocks.keep)
    means = hax.mean(squares, axis=within) if within else squares
    if blocks.per_head_in_qk:
        Qkv = means.resolve_axis(FUSED_QKV_AXIS)
        per_head = hax.mean(means, axis=blocks.per_head_in_qk)
        # queries and keys (the first two of qkv) share one value per head
        means = hax.where(hax.arange(Qkv) < 2, per_head, means).rearrange(means.axes)
    return means


def _blockwise_squares(updates):
    found = second_moment_blocks(updates)
    return jax.tree_util.tree_map_with_path(
        lambda path, g: block_mean(g * g, found.get(path)), updates, is_leaf=hax.is_named_array
    )


class ScaleByAdamMiniState(NamedTuple):
    """State of :func:`scale_by_adam_mini`."""

    count: jax.Array
    """Steps taken (int32 scalar), for the bias correction."""
    mu: optax.Updates
    """Running mean of the gradients, per parameter."""
    nu: optax.Updates
    """Running mean of the blocks' mean squared gradients: one value per block, with the
    parameters' tree structure (each NamedArray keeps only the axes its blocks vary along)."""


def _divide(m, v, eps: float):
    if hax.is_named_array(m):
        # v broadcasts by axis name; the update must keep the parameter's axis order
        return (m / (hax.sqrt(v) + eps)).rearrange(m.axes)
    return m / (jnp.sqrt(v) + eps)


def scale_by_adam_mini(b1: float, b2: float, eps: float, *, nesterov: bool = False) -> optax.GradientTransformation:
    """Adam's scaling (with bias correction) where the second moment is shared within the
    blocks of :func:`second_moment_blocks`, found from the NamedArrays' axes and the layers
    holding them."""

    def init_fn(params):
        return ScaleByAdamMiniState(
            count=jnp.zeros([], jnp.int32),
            mu=otu.tree_zeros_like(params),
            nu=_blockwise_squares(otu.tree_zeros_like(params)),
        )

    def update_fn(updates, state, params=None):
        del params
        mu = otu.tree_update_moment(updates, state.mu, b1, 1)
        nu = jax.tree.map(lambda old, new: b2 * old + (1 - b2) * new, state.nu, _blockwise_squares(updates))
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: b1 * m + (1 - b1) * g,
                otu.tree_bias_correction(mu, b1, optax.safe_increment(count)),
                otu.tree_bias_correction(updates, b1, count),
            )
        else:
            mu_hat = otu.tree_bias_correction(mu, b1, count)
        nu_hat = otu.tree_bias_correction(nu, b2, count)
        scaled = jax.tree.map(lambda m, v: _divide(m, v, eps), mu_hat, nu_hat, is_leaf=hax.is_named_array)
        return scaled, ScaleByAdamMiniState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)
