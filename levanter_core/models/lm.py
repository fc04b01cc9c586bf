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
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from pydantic import PositiveInt, model_validator

from levanter_core.config.base import TypedConfig
from levanter_core.layers.attention import AttentionMask
from levanter_core.layers.auxiliary import AuxiliaryLoss as AuxiliaryLoss  # re-exported: the model interface returns it
from levanter_core.models.cross_entropy import (
    RowShards,
    cross_entropy_and_z_sum,
    cross_entropy_sum,
    sample_tokens,
    token_losses,
)

# soft_cap is also for models (Gemma soft-caps its logits with it), imported from here
from levanter_core.models.cross_entropy import soft_cap as soft_cap

if TYPE_CHECKING:
    from levanter_core.layers.attention import AttentionMask

DEFAULT_BLOCK_LOGITS = {"cpu": 2**22, "gpu": 2**28, "tpu": 2**28}
"""Logits per block of the loss when ``cross_entropy_block_size`` is not set, by JAX backend: on
CPU a block's logits (16 MiB in float32) stay in the processor's cache (blocks of 256 to 512
tokens ran the reference model's loss 25% faster than larger ones); accelerators get large
blocks, which keep their matmuls big."""


GradientCheckpointing = bool | Literal["offload", "recompute", "full", "save_all", "nested"]
"""What a model's layers keep for the backward pass (``gradient_checkpointing``), as in Levanter:
``true`` recomputes each layer's internals from its saved input; ``false`` saves everything;
``offload`` keeps the layers' inputs in host memory; ``recompute`` (or ``full``) saves nothing
and recomputes; ``save_all`` saves everything through the checkpointing machinery; ``nested``
saves the inputs of every sqrt(layers)-th layer only and recomputes the rest in two levels.
(Haliax's ``ScanCheckpointPolicy`` carries it out.)"""


class LmConfig(TypedConfig, abc.ABC):
    """Base class of every model config (the ``model:`` section)."""

    objective: ClassVar[str] = "lm"
    """The training objective this model trains with (a name of the ``register_objectives``
    hook, see :mod:`levanter_core.objective`): next-token prediction for language models."""

    run_settings: ClassVar[tuple[str, ...]] = (
        "seq_len",
        "scan_layers",
        "unroll_layers",
        "gradient_checkpointing",
        "attn_backend",
        "flash_attention_block_size",
        "cross_entropy_block_size",
        "upcast_attn",
        "reference_checkpoint",
    )
    """Fields that say how to run an architecture, not what it is: under ``use_hf_model_config``
    they are still taken from the ``model`` section (``seq_len`` always, the others where written).
    A family with run settings of its own extends the tuple."""

    seq_len: int = 1024
    """The model's context: the longest sequence it takes (the ``position`` axis), and what it
    trains on unless the run's ``train_seq_len`` is shorter. Levanter's current schema calls it
    ``max_seq_len``, which is read as this field."""

    @model_validator(mode="before")
    @classmethod
    def _levanter_max_seq_len(cls, raw: Any) -> Any:
        """Levanter's current schema names the context ``max_seq_len`` (its older one, and this
        framework, ``seq_len``): the same field under either name, not both."""
        if not isinstance(raw, dict) or "max_seq_len" not in raw:
            return raw
        raw = dict(raw)
        value = raw.pop("max_seq_len")
        if "seq_len" in raw and raw["seq_len"] != value:
            raise ValueError(
                f"max_seq_len ({value}) and seq_len ({raw['seq_len']}) name the same field, the model's "
                "context: keep one"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_seq_len: expected a positive number of tokens, got {value!r}")
        raw["seq_len"] = value
        return raw

    cross_entropy_block_size: PositiveInt | None = None
    """How many tokens' logits the loss computes together. The loss is fused with the output
    projection: block by block, the logits are computed, turned into the loss and its gradients,
    and dropped, so only one block's logits ever exist. None: automatic, about 4M logits per
    block on CPU (512 tokens of an 8,192-entry vocabulary) and 256M on GPU and TPU."""

    unroll_layers: bool = False
    """Unroll the loop over the layers into straight-line code instead of running one compiled
    layer in a ``jax.lax.scan``. Compilation takes longer the more layers there are; the step can
    be faster, because XLA no longer slices each layer's weights out of the stack and stacks
    the activations the backward pass needs (the reference GPT-2, 4 layers on 2 CPU cores: 15%
    faster). Parameters stay stacked either way, so checkpoints and exports do not change. With
    gradient checkpointing, XLA may merge a layer's recomputation back into the forward pass and
    keep its activations after all."""

    flash_attention_block_size: PositiveInt | None = None
    """Queries per block of blockwise (flash-style) causal attention, where the model's attention
    runs in blocks, and keys per block of context-parallel attention. None: the backend's default
    (128 queries on CPU; 512 keys)."""

    reference_checkpoint: str | None = None
    """The Hugging Face checkpoint this architecture corresponds to (a hub name or a local
    directory): what ``initialize_from_hf: true`` loads. None: the family's default
    (``default_hf_checkpoint``), if it has one."""

    pipeline_parallel: ClassVar[bool] = False
    """Whether the family runs its stack of layers through
    :func:`levanter_core.layers.fold_layers`, which runs it as a pipeline when
    ``trainer.mesh.axes.stage`` splits the layers into stages (pipeline parallelism). A run that
    asks for stages with a family that does not is refused before it starts. The decoder kit's
    families have it."""

    default_hf_checkpoint: ClassVar[str | None] = None
    """The checkpoint ``initialize_from_hf: true`` loads when ``reference_checkpoint`` is unset
    (a plugin sets it on its config class; Levanter's defaults, e.g. ``gpt2``)."""

    @property
    def hf_checkpoint(self) -> str | None:
        """``reference_checkpoint``, else the family's ``default_hf_checkpoint``."""
        return self.reference_checkpoint or self.default_hf_checkpoint

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
    def build(self, Vocab: Axis, *, key: jax.Array) -> LmHeadModel:
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

    def activations(
        self, input_ids: NamedArray, *, key: jax.Array | None = None, attn_mask: AttentionMask | None = None
    ) -> NamedArray:
        """Final hidden states, axes ``(..., position, embed)``. ``attn_mask`` (an
        ``AttentionMask``; None: causal) is needed only for packed data."""
        ...

    def get_lm_head(self) -> NamedArray:
        """The output projection, axes ``(embed, vocab)``."""
        ...

    def __call__(self, input_ids: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Logits, axes ``(..., position, vocab)``."""
        ...


class LmExample(eqx.Module):
    """A batch of training examples: ``tokens`` ``(..., position)``; ``loss_mask`` (same
    axes, float: the weight of predicting the token after each position; None: every
    position but the last); ``segment_ids`` (same axes, int: examples packed into one
    sequence have different ids, and attention does not cross them; None: one stream)."""

    tokens: NamedArray
    loss_mask: NamedArray | None = None
    segment_ids: NamedArray | None = None

    def attn_mask(self) -> AttentionMask | None:
        """The attention mask these examples need; None for plain causal attention."""
        if self.segment_ids is None:
            return None
        return AttentionMask.causal_mask().with_segments(self.segment_ids)


def as_example(batch: LmExample | NamedArray) -> LmExample:
    return batch if isinstance(batch, LmExample) else LmExample(batch)


def _attn_kwargs(example: LmExample) -> dict[str, AttentionMask]:
    mask = example.attn_mask()
    return {} if mask is None else {"attn_mask": mask}


def lm_loss_and_metrics(
    model: LmHeadModel, batch: LmExample | NamedArray, *, key: jax.Array | None = None, z_loss_weight: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective of a batch and the model's own metrics: mean next-token
    cross-entropy over the positions ``loss_mask`` selects, plus ``z_loss_weight`` times the
    mean squared log-normalizer of the logits (logged as ``train/z_loss``), plus the model's
    :class:`AuxiliaryLoss` if it has one."""
    example = as_example(batch)
    kwargs = _attn_kwargs(example)
    if hasattr(model, "activations_with_aux"):
        hidden, aux = model.activations_with_aux(example.tokens, key=key, **kwargs)
    else:
        hidden, aux = model.activations(example.tokens, key=key, **kwargs), None
    metrics: dict[str, jax.Array] = {}
    if z_loss_weight:
        targets, mask = _targets_and_mask(example.tokens, example.loss_mask)
        h, head, (t, w), block, cap = _loss_inputs(model, hidden, targets, mask)
        shards = _row_shards(model, hidden)
        total, z_sum = cross_entropy_and_z_sum(
            h, head, t, w, z_weight=z_loss_weight, block=block, cap=cap, shards=shards
        )
        count = jnp.maximum(hax.sum(mask).scalar(), 1.0)
        loss = total / count
        metrics["train/z_loss"] = z_sum / count
    else:
        loss = next_token_loss(model, example.tokens, example.loss_mask, key=key, hidden=hidden)
    if aux is None:
        return loss, metrics
    return loss + aux.loss, {**metrics, **aux.metrics}


def lm_sampled_loss(model: LmHeadModel, batch: LmExample | NamedArray, *, key: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over the positions the loss counts, against tokens drawn
    from the model's own predictions (``key`` draws them) rather than the batch's: the loss
    whose gradient Sophia-G squares for its Gauss-Newton estimate of the Hessian's diagonal.
    Auxiliary losses are left out; the draw carries no gradient."""
    example = as_example(batch)
    hidden = model.activations(example.tokens, key=None, **_attn_kwargs(example))
    _, mask = _targets_and_mask(example.tokens, example.loss_mask)
    h, head, (weights,), block, cap = _loss_inputs(model, hidden, mask)
    drawn = sample_tokens(h, head, key, block=block, cap=cap)
    total = cross_entropy_sum(h, head, drawn, weights, block=block, cap=cap, shards=_row_shards(model, hidden))
    return total / jnp.maximum(jnp.sum(weights), 1.0)


def lm_eval_entropy(model: LmHeadModel, batch: LmExample | NamedArray, *, key: jax.Array | None = None) -> jax.Array:
    """The mean entropy (nats) of the model's next-token distribution over the positions the
    loss counts (``log_entropy``)."""
    example = as_example(batch)
    hidden = model.activations(example.tokens, key=key, **_attn_kwargs(example))
    _, mask = _targets_and_mask(example.tokens, example.loss_mask)
    logits = hax.dot(hidden, model.get_lm_head(), axis="embed").astype(jnp.float32)
    logits = soft_cap(logits, getattr(model.config, "final_logit_soft_cap", None))
    log_p = hax.nn.log_softmax(logits, axis=model.Vocab)
    entropy = -hax.sum(hax.exp(log_p) * log_p, axis=model.Vocab)
    mean: jax.Array = hax.sum(entropy * mask).scalar() / jnp.maximum(hax.sum(mask).scalar(), 1.0)
    return mean


def lm_eval_loss(model: LmHeadModel, batch: LmExample | NamedArray, *, key: jax.Array | None = None) -> jax.Array:
    """The evaluation loss: next-token cross-entropy only (no auxiliary terms)."""
    example = as_example(batch)
    hidden = model.activations(example.tokens, key=key, **_attn_kwargs(example))
    return next_token_loss(model, example.tokens, example.loss_mask, key=key, hidden=hidden)


def lm_eval_totals(
    model: LmHeadModel, batch: LmExample | NamedArray, byte_lengths: jax.Array, *, key: jax.Array | None = None
) -> jax.Array:
    """``[nats, tokens, bytes]`` of a batch, float32: the summed next-token cross-entropy over the
    positions the loss counts, how many they are, and how many bytes of text their target tokens
    stand for (``byte_lengths[token]``, see :mod:`levanter_core.data.token_bytes`). Summed over
    batches, ``nats / tokens`` is the loss and ``nats / (ln 2 * bytes)`` the bits per byte."""
    example = as_example(batch)
    hidden = model.activations(example.tokens, key=key, **_attn_kwargs(example))
    targets, mask = _targets_and_mask(example.tokens, example.loss_mask)
    nats = _fused_cross_entropy(model, hidden, targets, mask)
    target_bytes = hax.named(jnp.take(byte_lengths, targets.array, mode="clip"), targets.axes)
    return jnp.stack([nats, hax.sum(mask).scalar(), hax.sum(mask * target_bytes.astype(jnp.float32)).scalar()]).astype(
        jnp.float32
    )


def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    loss_mask: NamedArray | None = None,
    *,
    key: jax.Array | None = None,
    reduction: str = "mean",
    hidden: NamedArray | None = None,
) -> jax.Array:
    """Mean cross-entropy of predicting token ``t+1`` from tokens ``<= t``.

    The last position has no target and is excluded. ``loss_mask`` (same axes as
    ``input_ids``, 1 where a position's *next* token counts) narrows it further.
    The loss is computed in float32 whatever the compute precision. ``hidden``, if
    given, are the model's final hidden states for ``input_ids`` (already computed).
    """
    if hidden is None:
        hidden = model.activations(input_ids, key=key)
    targets, mask = _targets_and_mask(input_ids, loss_mask)
    total = _fused_cross_entropy(model, hidden, targets, mask)
    if reduction == "sum":
        return total
    return total / jnp.maximum(hax.sum(mask).scalar(), 1.0)


def _targets_and_mask(input_ids: NamedArray, loss_mask: NamedArray | None) -> tuple[NamedArray, NamedArray]:
    """The token each position predicts, and the float weight of each position's prediction
    (0 at the last position, which predicts nothing, and where ``loss_mask`` is 0)."""
    Pos = input_ids.resolve_axis("position")
    targets = hax.roll(input_ids, -1, Pos)
    mask = hax.broadcast_to((hax.arange(Pos) < Pos.size - 1).astype(jnp.float32), input_ids.axes)
    if loss_mask is not None:
        mask = mask * loss_mask.astype(jnp.float32)
    return targets, mask


def _loss_inputs(
    model: LmHeadModel, hidden: NamedArray, *per_position: NamedArray
) -> tuple[jax.Array, jax.Array, list[jax.Array], int, float | None]:
    """Plain arrays for :mod:`~levanter_core.models.cross_entropy`: hidden ``[rows, position,
    embed]``, the head ``[embed, vocab]``, and each of ``per_position`` ``[rows, position]`` in the
    same row order (every axis but position and embed flattened into rows); then the positions per
    block and the soft cap."""
    h = hidden.rearrange((..., "position", "embed"))
    Rows = h.axes[:-1]
    h_arr = h.array.reshape(-1, *h.array.shape[-2:])
    arrays = [x.rearrange(Rows).array.reshape(h_arr.shape[:2]) for x in per_position]
    head = model.get_lm_head().rearrange(("embed", model.Vocab.name)).array
    cap: float | None = getattr(model.config, "final_logit_soft_cap", None)
    return h_arr, head, arrays, _block_positions(model.config, h_arr.shape[0], model.Vocab.size), cap


def _row_shards(model: LmHeadModel, hidden: NamedArray) -> RowShards | None:
    """How the rows of :func:`_loss_inputs`' arrays are split over the devices, for the loss to
    sum the head's gradient per shard (:class:`RowShards`): where the first of ``hidden``'s row
    axes (all but position and embed) is split over mesh axes by the current mapping and the
    others are not (so that each shard's rows are consecutive). None otherwise: no mesh, one
    shard, or positions split too (context parallelism)."""
    rows = [ax for ax in hidden.axes if ax.name not in ("position", "embed")]
    try:
        sizes = [hax.partitioning.physical_axis_size(ax) or 1 for ax in rows]
        positions_split = (hax.partitioning.physical_axis_size("position") or 1) > 1
    except ValueError:  # an axis mapping but no mesh: nothing is split
        return None
    if not rows or sizes[0] <= 1 or any(n > 1 for n in sizes[1:]) or rows[0].size % sizes[0] or positions_split:
        return None
    Shard, Embed = Axis(rows[0].name, sizes[0]), hidden.resolve_axis("embed")

    def place(x: jax.Array) -> jax.Array:
        placed: NamedArray = hax.shard(hax.named(x, (Shard, Embed, model.Vocab)))
        array: jax.Array = placed.array
        return array

    return RowShards(sizes[0], place)


def _block_positions(config: LmConfig, rows: int, vocab: int) -> int:
    """Positions per block of the loss: ``cross_entropy_block_size`` tokens, or by default
    about ``DEFAULT_BLOCK_LOGITS[backend]`` logits."""
    tokens: int | None = getattr(config, "cross_entropy_block_size", None)
    if tokens is None:
        logits = DEFAULT_BLOCK_LOGITS.get(jax.default_backend(), DEFAULT_BLOCK_LOGITS["gpu"])
        tokens = max(1, logits // vocab)
    return max(1, tokens // rows)


def _fused_cross_entropy(model: LmHeadModel, hidden: NamedArray, targets: NamedArray, weights: NamedArray) -> jax.Array:
    """The weighted sum of the next-token losses, fused with the output projection."""
    h, head, (t, w), block, cap = _loss_inputs(model, hidden, targets, weights)
    return cross_entropy_sum(h, head, t, w, block=block, cap=cap, shards=_row_shards(model, hidden))


def per_token_cross_entropy(model: LmHeadModel, hidden: NamedArray, targets: NamedArray) -> NamedArray:
    """The loss of each position (float32) with the axes of ``targets``, computed block by
    block as the training loss is (no gradient)."""
    h, head, (t,), block, cap = _loss_inputs(model, hidden, targets)
    Rows = hidden.rearrange((..., "position", "embed")).axes[:-1]
    losses = token_losses(h, head, t, block=block, cap=cap)
    return hax.named(losses.reshape(tuple(ax.size for ax in Rows)), Rows).rearrange(targets.axes)


loss_inputs = _loss_inputs
"""The model's hidden states, output head and per-position arrays as the plain arrays the
blockwise cross-entropy of :mod:`~levanter_core.models.cross_entropy` takes (public: objectives
in plugins, such as levanter-preference's DPO, score tokens the same way)."""
