"""What the core expects of a language model, and the loss it trains with.

An architecture plugin provides two things:

* a config class, subclass of :class:`LmConfig`, registered under a ``type``
  name through the ``register_models`` hook;
* the model it builds, an Equinox module following :class:`LmHeadModel`.

The trainer only ever calls ``config.build(Vocab, key=...)``, ``model(...)``
(through :func:`next_token_loss`) and ``config.flops_per_token(...)``.

Training examples are :class:`LmExample` s: token ids, and for packed data
(chat, supervised) a loss mask and segment ids. A model that takes an
``attn_mask`` keyword (an :class:`~levanter_core.layers.attention.AttentionMask`)
in ``activations`` can train on packed data; attention then stays within each
example.
"""

from __future__ import annotations

import abc
from typing import Protocol, runtime_checkable

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from levanter_core.config.base import TypedConfig


class LmConfig(TypedConfig, abc.ABC):
    """Base class of every model config (the ``model:`` section)."""

    seq_len: int = 1024
    """Length of the training sequences (the ``position`` axis)."""

    cross_entropy_block_size: int | None = None
    """Compute the loss over the vocabulary in blocks of this many entries instead of
    materializing all logits at once. ``None`` computes it in one piece."""

    @property
    def Pos(self) -> Axis:
        return Axis("position", self.seq_len)

    @property
    def KeyPos(self) -> Axis:
        return self.Pos.alias("key_position")

    @property
    @abc.abstractmethod
    def Embed(self) -> Axis:
        """The model's hidden axis."""

    @abc.abstractmethod
    def build(self, Vocab: Axis, *, key) -> "LmHeadModel":
        """A freshly initialized model with this config and vocabulary."""

    def flops_per_token(self, vocab_size: int) -> float | None:
        """Training FLOPs per token (forward and backward), for MFU; None if unknown."""
        return None


@runtime_checkable
class LmHeadModel(Protocol):
    """A causal language model over named axes.

    ``input_ids`` has a ``position`` axis (``config.Pos``) and any batch axes;
    the result keeps them and adds ``Vocab``.
    """

    @property
    def Vocab(self) -> Axis: ...

    @property
    def config(self) -> LmConfig: ...

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask=None) -> NamedArray:
        """Final hidden states, axes ``(..., position, embed)``. ``attn_mask`` (an
        ``AttentionMask``; None: causal) is needed only for packed data."""
        ...

    def get_lm_head(self) -> NamedArray:
        """The output projection, axes ``(embed, vocab)``."""
        ...

    def __call__(self, input_ids: NamedArray, *, key=None) -> NamedArray:
        """Logits, axes ``(..., position, vocab)``."""
        ...


class AuxiliaryLoss(eqx.Module):
    """Extra training terms a model computes in its forward pass (a mixture of experts'
    load-balancing loss, say).

    ``loss`` is added to the cross-entropy; every entry of ``metrics`` (scalars, e.g.
    ``moe/load_balancing_loss``) is logged with the step's other metrics. A model
    provides them by implementing ``activations_with_aux(input_ids, *, key)``, which
    returns ``(hidden, AuxiliaryLoss)``, alongside ``activations``."""

    loss: jnp.ndarray
    metrics: dict[str, jnp.ndarray]


class LmExample(eqx.Module):
    """A batch of training examples: ``tokens`` ``(..., position)``; ``loss_mask`` (same
    axes, float: the weight of predicting the token after each position; None: every
    position but the last); ``segment_ids`` (same axes, int: examples packed into one
    sequence have different ids, and attention does not cross them; None: one stream)."""

    tokens: NamedArray
    loss_mask: NamedArray | None = None
    segment_ids: NamedArray | None = None

    def attn_mask(self):
        """The attention mask these examples need; None for plain causal attention."""
        if self.segment_ids is None:
            return None
        from levanter_core.layers.attention import AttentionMask

        return AttentionMask.causal_mask().with_segments(self.segment_ids)


def as_example(batch: "LmExample | NamedArray") -> LmExample:
    return batch if isinstance(batch, LmExample) else LmExample(batch)


def _attn_kwargs(example: LmExample) -> dict:
    mask = example.attn_mask()
    return {} if mask is None else {"attn_mask": mask}


def lm_loss_and_metrics(model: LmHeadModel, batch: "LmExample | NamedArray", *, key=None) -> tuple[jnp.ndarray, dict]:
    """The training objective of a batch and the model's own metrics: mean next-token
    cross-entropy over the positions ``loss_mask`` selects, plus the model's
    :class:`AuxiliaryLoss` if it has one."""
    example = as_example(batch)
    kwargs = _attn_kwargs(example)
    if hasattr(model, "activations_with_aux"):
        hidden, aux = model.activations_with_aux(example.tokens, key=key, **kwargs)
    else:
        hidden, aux = model.activations(example.tokens, key=key, **kwargs), None
    loss = next_token_loss(model, example.tokens, example.loss_mask, key=key, hidden=hidden)
    if aux is None:
        return loss, {}
    return loss + aux.loss, dict(aux.metrics)


def lm_eval_loss(model: LmHeadModel, batch: "LmExample | NamedArray", *, key=None) -> jnp.ndarray:
    """The evaluation loss: next-token cross-entropy only (no auxiliary terms)."""
    example = as_example(batch)
    hidden = model.activations(example.tokens, key=key, **_attn_kwargs(example))
    return next_token_loss(model, example.tokens, example.loss_mask, key=key, hidden=hidden)


def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    loss_mask: NamedArray | None = None,
    *,
    key=None,
    reduction: str = "mean",
    hidden: NamedArray | None = None,
) -> jnp.ndarray:
    """Mean cross-entropy of predicting token ``t+1`` from tokens ``<= t``.

    The last position has no target and is excluded. ``loss_mask`` (same axes as
    ``input_ids``, 1 where a position's *next* token counts) narrows it further.
    The loss is computed in float32 whatever the compute precision. ``hidden``, if
    given, are the model's final hidden states for ``input_ids`` (already computed).
    """
    Pos = input_ids.resolve_axis("position")
    if hidden is None:
        hidden = model.activations(input_ids, key=key)
    head = model.get_lm_head()
    targets = hax.roll(input_ids, -1, Pos)
    mask = hax.broadcast_to((hax.arange(Pos) < Pos.size - 1).astype(jnp.float32), input_ids.axes)
    if loss_mask is not None:
        mask = mask * loss_mask.astype(jnp.float32)
    block = getattr(model.config, "cross_entropy_block_size", None)
    soft_cap = getattr(model.config, "final_logit_soft_cap", None)
    per_token = _cross_entropy(hidden, head, targets, model.Vocab, block, soft_cap)
    total = hax.sum(per_token * mask).scalar()
    if reduction == "sum":
        return total
    return total / jnp.maximum(hax.sum(mask).scalar(), 1.0)


def soft_cap(logits, cap: float | None):
    """``cap * tanh(logits / cap)`` (Gemma 2's logit soft-capping); ``logits`` if ``cap`` is None."""
    if cap is None:
        return logits
    tanh = hax.tanh if isinstance(logits, NamedArray) else jnp.tanh
    return tanh(logits / cap) * cap


def _cross_entropy(
    hidden: NamedArray, head: NamedArray, targets: NamedArray, Vocab: Axis, block: int | None, cap: float | None = None
):
    """Per-position cross-entropy in float32; blockwise over the vocabulary if ``block`` is set.

    A model config with ``final_logit_soft_cap`` has its logits soft-capped first."""
    if block is None or block >= Vocab.size:
        logits = soft_cap(hax.dot(hidden, head, axis="embed").astype(jnp.float32), cap)
        log_z = hax.nn.logsumexp(logits, axis=Vocab)
        target_logit = hax.take(logits, Vocab, targets)
        return log_z - target_logit
    return _blockwise_cross_entropy(hidden, head, targets, Vocab, block, cap)


def _blockwise_cross_entropy(hidden, head, targets, Vocab: Axis, block: int, cap: float | None):
    """Streaming log-sum-exp over vocabulary blocks: never holds more than one block of logits."""
    num_blocks = -(-Vocab.size // block)
    padded = num_blocks * block
    head_arr = head.rearrange(("embed", Vocab.name)).array
    if padded != Vocab.size:
        head_arr = jnp.pad(head_arr, ((0, 0), (0, padded - Vocab.size)))
    head_blocks = head_arr.reshape(head_arr.shape[0], num_blocks, block).transpose(1, 0, 2)
    h = hidden.rearrange((..., "embed"))
    h_arr = h.array
    tgt = targets.rearrange(h.axes[:-1]).array

    def body(carry, xs):
        running_max, running_sum, target_logit = carry
        i, w = xs
        logits = soft_cap(jnp.einsum("...e,ev->...v", h_arr, w).astype(jnp.float32), cap)
        ids = i * block + jnp.arange(block)
        logits = jnp.where(ids < Vocab.size, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(logits - new_max[..., None]), -1)
        in_block = (tgt >= i * block) & (tgt < (i + 1) * block)
        picked = jnp.take_along_axis(logits, jnp.clip(tgt - i * block, 0, block - 1)[..., None], -1)[..., 0]
        target_logit = jnp.where(in_block, picked, target_logit)
        return (new_max, running_sum, target_logit), None

    init_shape = tgt.shape
    init = (
        jnp.full(init_shape, -jnp.inf, jnp.float32),
        jnp.zeros(init_shape, jnp.float32),
        jnp.zeros(init_shape, jnp.float32),
    )
    # Rematerialized: the backward pass recomputes each block's logits instead of keeping
    # every block's, which would add up to the full logits after all.
    (m, s, t), _ = jax.lax.scan(jax.checkpoint(body), init, (jnp.arange(num_blocks), head_blocks))
    return hax.named(m + jnp.log(s) - t, h.axes[:-1])

