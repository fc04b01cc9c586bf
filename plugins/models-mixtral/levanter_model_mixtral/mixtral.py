"""Mixtral (Jiang et al., 2024) over Haliax named axes: Mistral's decoder with each MLP
replaced by a sparse mixture of SwiGLU experts.

Routing follows Hugging Face's ``MixtralForCausalLM`` exactly. A linear router (``gate``,
no bias) scores every expert; the scores go through a float32 softmax over *all* experts;
each token keeps the ``num_experts_per_tok`` most probable experts and renormalizes
their probabilities to sum to one; the layer's output is the weighted sum of those
experts' outputs.

The experts' weights are stacked along an ``experts`` axis, and only the chosen experts
run ("dropless" dispatch, no capacity limit, so the result is exact): each
(token, chosen expert) pair becomes one row, the rows are sorted by expert, and
:func:`jax.lax.ragged_dot` multiplies each contiguous group of rows by its own expert's
matrices. On TPU that is a grouped matrix multiply doing ``num_experts_per_tok /
num_local_experts`` of the work of running every expert on every token; a backend
without a grouped kernel (CPU) evaluates it as a masked dense product, which is slower
but still exact.

Training adds two router terms, reported by :meth:`MixtralLMHeadModel.activations_with_aux`
and logged unweighted as ``moe/load_balancing_loss`` and ``moe/router_z_loss``:

* the load-balancing loss of Switch Transformer as Hugging Face computes it (its
  ``aux_loss``): ``num_experts * sum_e f_e * P_e``, where ``f_e`` is the fraction of
  top-k choices that went to expert ``e`` and ``P_e`` its mean router probability, both
  pooled over all layers and tokens (1 per chosen expert, so ``num_experts_per_tok``,
  when routing is uniform); weighted by ``router_aux_loss_coef``;
* the router z-loss of ST-MoE (Zoph et al., 2022), which Hugging Face's Mixtral does not
  have: the mean over layers and tokens of ``logsumexp(router_logits)^2``, which keeps
  router logits small; weighted by ``router_z_loss_coef`` (0 turns it off).

Checkpoints use Hugging Face's on-disk names: ``block_sparse_moe.gate.weight`` for the
router and ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` per expert (w1 the gate
projection, w3 the up projection, w2 the down projection), written and read by
:class:`MixtralExperts`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict, with_prefix
from pydantic import Field, PositiveInt, model_validator

from levanter_core.hf import HfConvertible
from levanter_core.layers import (
    ACTIVATIONS,
    ActivationName,
    Attention,
    AttentionBackend,
    AttentionConfig,
    AttentionMask,
    DefaultRotaryConfig,
    RmsNorm,
    RotaryConfig,
    init_linear,
    rotary_from_hf,
)
from levanter_core.models.flops import lm_flops_per_token
from levanter_core.models.lm import AuxiliaryLoss, GradientCheckpointing, LmConfig


class MixtralConfig(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: mixtral``. Defaults are Mixtral 8x7B's."""

    type: str = "mixtral"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "mistralai/Mixtral-8x7B-v0.1"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "MixtralForCausalLM"

    seq_len: PositiveInt = 32768
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``)."""

    hidden_dim: PositiveInt = 4096
    """Width of the residual stream (``hidden_size``)."""

    intermediate_dim: PositiveInt = 14336
    """Width of each expert's hidden layer (``intermediate_size``)."""

    num_layers: PositiveInt = 32
    """Number of decoder layers."""

    num_heads: PositiveInt = 32
    """Number of query heads."""

    num_kv_heads: PositiveInt = 8
    """Number of key/value heads: ``num_heads`` for multi-head attention, 1 for multi-query,
    anything dividing ``num_heads`` for grouped-query attention."""

    head_dim: PositiveInt | None = None
    """Size of each head; ``None`` means ``hidden_dim // num_heads``."""

    num_local_experts: PositiveInt = 8
    """Number of experts in each layer (Hugging Face's name)."""

    num_experts_per_tok: PositiveInt = 2
    """Number of experts each token is routed to, the ``k`` of top-k routing."""

    router_aux_loss_coef: float = Field(0.02, ge=0.0)
    """Weight of the load-balancing loss in the training objective (Hugging Face's name;
    its default is 0.001, Levanter's 0.02)."""

    router_z_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the router z-loss, ``mean(logsumexp(router_logits)^2)`` (ST-MoE), in the
    training objective. Hugging Face's Mixtral has no such term; it is not exported."""

    activation_function: ActivationName = "silu"
    """Nonlinearity of the experts' gated MLPs (``hidden_act``)."""

    initializer_range: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initialization of every weight matrix and embedding."""

    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm (``rms_norm_eps``)."""

    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection."""

    rope: RotaryConfig = DefaultRotaryConfig(theta=1e6)
    """Rotary embedding and its scaling: ``{type: default|linear|llama3|yarn, theta: ...}``."""

    sliding_window: PositiveInt | None = None
    """If set, every layer attends only to the ``sliding_window`` most recent tokens (itself
    included), as in Mistral; ``None`` attends to the whole sequence."""

    attn_backend: AttentionBackend = "auto"
    """Attention implementation: ``reference`` (plain einsums), ``jax``
    (``jax.nn.dot_product_attention``, cuDNN flash attention on GPU), or ``auto``
    (``jax`` on GPU, ``reference`` elsewhere)."""

    gradient_checkpointing: GradientCheckpointing = True
    """Recompute each layer's activations in the backward pass instead of storing them (``true``),
    store them all (``false``), or one of Levanter's policies: ``offload``, ``recompute``,
    ``save_all``, ``nested`` (see ``levanter_core.models.lm.GradientCheckpointing``)."""

    scan_layers: bool = True
    """Run the layers as one ``jax.lax.scan`` (fast compilation) rather than unrolled."""

    @model_validator(mode="after")
    def _check(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must be divisible by num_heads ({self.num_heads}) unless head_dim is set"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed "
                f"num_local_experts ({self.num_local_experts})"
            )
        return self

    # -- axes -----------------------------------------------------------------------------
    @property
    def actual_head_dim(self) -> int:
        return self.head_dim or self.hidden_dim // self.num_heads

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    @property
    def Experts(self) -> Axis:
        return Axis("experts", self.num_local_experts)

    @property
    def TopExperts(self) -> Axis:
        return Axis("top_experts", self.num_experts_per_tok)

    def attention_config(self) -> AttentionConfig:
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            rope=self.rope,
            sliding_window=self.sliding_window,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            initializer_range=self.initializer_range,
        )

    # -- the core's interface -----------------------------------------------------------------
    def build(self, Vocab: Axis, *, key) -> "MixtralLMHeadModel":
        return MixtralLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.actual_head_dim,
            seq_len=self.seq_len,
            vocab_size=vocab_size,
            experts_per_token=self.num_experts_per_tok,
            num_experts=self.num_local_experts,
        )

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict) -> "MixtralConfig":
        if hf.get("router_jitter_noise"):
            raise ValueError(
                f"router_jitter_noise ({hf['router_jitter_noise']}) is not supported; set it to 0.0 in config.json"
            )
        num_heads = hf["num_attention_heads"]
        return cls(
            seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            # kept as written: null and an explicit hidden_size // heads mean the same, and
            # exporting what was imported keeps config.json unchanged
            head_dim=hf.get("head_dim"),
            num_local_experts=hf.get("num_local_experts", 8),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
            activation_function=hf.get("hidden_act", "silu"),
            initializer_range=hf.get("initializer_range", 0.02),
            layer_norm_epsilon=hf.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope=rotary_from_hf(
                hf.get("rope_parameters") or hf.get("rope_scaling"), default_theta=hf.get("rope_theta", 1e6), hf_config=hf
            ),
            sliding_window=hf.get("sliding_window"),
        )

    def to_hf_config(self, vocab_size: int) -> dict:
        return {
            "model_type": "mixtral",
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "hidden_act": self.activation_function,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope.to_hf(),
            "sliding_window": self.sliding_window,
        }

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()


class RouterStats(eqx.Module):
    """What one layer's router did, for the training terms (see the module docstring).

    Per layer; stacked along ``layers`` by the scan over layers."""

    expert_fraction: NamedArray
    """``(experts,)``: share of the top-k choices that went to each expert (sums to k)."""
    mean_probability: NamedArray
    """``(experts,)``: each expert's router probability, averaged over the tokens."""
    z_loss: NamedArray
    """``()``: mean over the tokens of ``logsumexp(router_logits)^2``."""


# Hugging Face's (out, in) layout of each expert's matrices: w1 gate, w3 up, w2 down.
_HF_LAYOUT = {"w1": ("mlp", "embed"), "w2": ("embed", "mlp"), "w3": ("mlp", "embed")}


class MixtralExperts(ModuleWithStateDictSerialization):
    """The experts of one layer: ``w2(act(w1 x) * w3 x)`` each, weights stacked along ``experts``.

    Serializes to Hugging Face's per-expert tensors ``{e}.w1.weight`` etc. (a scanned
    model's leading ``layers`` axis passes through and is split by ``hnn.Stacked``)."""

    w1: NamedArray  # (experts, embed, mlp)
    w2: NamedArray  # (experts, mlp, embed)
    w3: NamedArray  # (experts, embed, mlp)
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(Experts: Axis, Embed: Axis, Mlp: Axis, activation: str, *, key, std: float) -> "MixtralExperts":
        k1, k2, k3 = jax.random.split(key, 3)
        return MixtralExperts(
            hax.random.normal(k1, (Experts, Embed, Mlp)) * std,
            hax.random.normal(k2, (Experts, Mlp, Embed)) * std,
            hax.random.normal(k3, (Experts, Embed, Mlp)) * std,
            activation,
        )

    def __call__(self, x: NamedArray, chosen: NamedArray, weights: NamedArray) -> NamedArray:
        """``x`` ``(token, embed)``; ``chosen`` (expert indices) and ``weights`` ``(token,
        top_experts)``. Returns ``sum_j weights[j] * expert[chosen[j]](x)``, ``(token, embed)``."""
        Token, TopExperts = chosen.axes
        Embed, Mlp = self.w1.resolve_axis("embed"), self.w1.resolve_axis("mlp")
        k = TopExperts.size
        # one row per (token, chosen expert) pair, token-major, then grouped by expert
        Slot = Axis("slot", Token.size * k)
        expert_of_slot = chosen.array.reshape(-1)
        order = jnp.argsort(expert_of_slot, stable=True)
        group_sizes = jnp.bincount(expert_of_slot, length=self.w1.resolve_axis("experts").size).astype(jnp.int32)
        rows = hax.named(x.rearrange((Token, Embed)).array[order // k], (Slot, Embed))

        def grouped(inputs: NamedArray, w: NamedArray, In: Axis, Out: Axis) -> NamedArray:
            out = jax.lax.ragged_dot(inputs.array, w.rearrange(("experts", In, Out)).array, group_sizes)
            return hax.named(out, (Slot, Out))

        hidden = ACTIVATIONS[self.activation](grouped(rows, self.w1, Embed, Mlp)) * grouped(rows, self.w3, Embed, Mlp)
        out = grouped(hidden, self.w2, Mlp, Embed)
        # back to token-major order, then the weighted sum over each token's k experts
        per_choice = out.array[jnp.argsort(order)].reshape(Token.size, k, Embed.size)
        per_choice = hax.named(per_choice, (Token, TopExperts, Embed))
        return hax.dot(per_choice, weights, axis=TopExperts).astype(x.dtype)

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        state = {}
        for name, (out, inp) in _HF_LAYOUT.items():
            weight = getattr(self, name)
            for e in range(weight.resolve_axis("experts").size):
                state[with_prefix(prefix, f"{e}.{name}.weight")] = weight["experts", e].rearrange((..., out, inp)).array
        return state

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> "MixtralExperts":
        loaded = {}
        for name, (out, inp) in _HF_LAYOUT.items():
            template = getattr(self, name)
            Experts = template.resolve_axis("experts")
            leading = tuple(ax for ax in template.axes if ax.name not in ("experts", out, inp))
            per_expert = (*leading, template.resolve_axis(out), template.resolve_axis(inp))
            stacked = jnp.stack(
                [jnp.asarray(state_dict[with_prefix(prefix, f"{e}.{name}.weight")]) for e in range(Experts.size)]
            )
            loaded[name] = hax.named(stacked, (Experts, *per_expert)).rearrange(template.axes)
        return dataclasses.replace(self, **loaded)


class MixtralSparseMoeBlock(eqx.Module):
    """The router (``gate``) and the experts it dispatches each token to."""

    gate: hnn.Linear  # embed -> experts
    experts: MixtralExperts
    top_k: int = eqx.field(static=True)

    @staticmethod
    def init(config: MixtralConfig, *, key) -> "MixtralSparseMoeBlock":
        k_gate, k_experts = jax.random.split(key, 2)
        std = config.initializer_range
        return MixtralSparseMoeBlock(
            init_linear(config.Embed, config.Experts, key=k_gate, std=std),
            MixtralExperts.init(
                config.Experts, config.Embed, config.Mlp, config.activation_function, key=k_experts, std=std
            ),
            config.num_experts_per_tok,
        )

    def __call__(self, x: NamedArray) -> tuple[NamedArray, RouterStats]:
        Experts = self.gate.Out
        TopExperts = Axis("top_experts", self.top_k)
        token_axes = tuple(ax for ax in x.axes if ax.name != "embed")
        tokens = x.flatten_axes(token_axes, "token")
        Token = tokens.resolve_axis("token")

        logits = self.gate(tokens).astype(jnp.float32)  # computed in the model's dtype, as Hugging Face does
        probs = hnn.softmax(logits, axis=Experts)
        top_probs, chosen = hax.top_k(probs, Experts, self.top_k, TopExperts)
        weights = top_probs / hax.sum(top_probs, TopExperts)
        out = self.experts(tokens, chosen.rearrange((Token, TopExperts)), weights)

        stats = RouterStats(
            expert_fraction=hax.sum(hnn.one_hot(chosen, Experts, dtype=jnp.float32), (Token, TopExperts)) / Token.size,
            mean_probability=hax.mean(probs, Token),
            z_loss=hax.mean(hax.square(hnn.logsumexp(logits, Experts)), Token),
        )
        return out.unflatten_axis("token", token_axes), stats


class MixtralDecoderLayer(eqx.Module):
    """``x + attn(norm(x))``, then ``x + moe(norm(x))``; also returns the router's statistics."""

    self_attn: Attention
    block_sparse_moe: MixtralSparseMoeBlock
    input_layernorm: RmsNorm
    post_attention_layernorm: RmsNorm

    @staticmethod
    def init(config: MixtralConfig, *, key) -> "MixtralDecoderLayer":
        k_attn, k_moe = jax.random.split(key, 2)
        return MixtralDecoderLayer(
            Attention.init(config.attention_config(), key=k_attn),
            MixtralSparseMoeBlock.init(config, key=k_moe),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask) -> tuple[NamedArray, RouterStats]:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        moe_out, stats = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + moe_out, stats


class MixtralModel(eqx.Module):
    """Token embeddings, the decoder layers, and the final norm (Hugging Face's ``model.``)."""

    config: MixtralConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked  # of MixtralDecoderLayer (hnn.BlockSeq when scan_layers is false)
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: MixtralConfig, *, key) -> "MixtralModel":
        k_embed, k_layers = jax.random.split(key, 2)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * config.initializer_range
        stack = hnn.Stacked if config.scan_layers else hnn.BlockSeq
        layers = stack.init(config.Layers, MixtralDecoderLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return MixtralModel(
            config,
            hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed),
            layers,
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )

    def __call__(self, input_ids: NamedArray, mask: AttentionMask) -> tuple[NamedArray, RouterStats]:
        """Final hidden states, and every layer's router statistics stacked along ``layers``."""
        x = self.embed_tokens.embed(input_ids)
        x, stats = self.layers.scan(x, mask, unroll=self.config.unroll_layers)
        return self.norm(x), stats


def router_losses(stats: RouterStats, config: MixtralConfig) -> AuxiliaryLoss:
    """The load-balancing loss and the router z-loss from all layers' statistics, weighted
    into one training term; the unweighted values are the metrics."""
    # pooled over layers before the product, as Hugging Face's load_balancing_loss_func does
    fraction = hax.mean(stats.expert_fraction, config.Layers)
    probability = hax.mean(stats.mean_probability, config.Layers)
    balance = config.num_local_experts * hax.sum(fraction * probability).scalar()
    z_loss = hax.mean(stats.z_loss, config.Layers).scalar()
    return AuxiliaryLoss(
        config.router_aux_loss_coef * balance + config.router_z_loss_coef * z_loss,
        {"moe/load_balancing_loss": balance, "moe/router_z_loss": z_loss},
    )


class MixtralLMHeadModel(eqx.Module):
    """Mixtral with its output projection (``lm_head``, absent when tied to the embeddings).

    Follows :class:`levanter_core.models.lm.LmHeadModel`, with ``activations_with_aux``
    for the router's training terms."""

    model: MixtralModel
    lm_head: hnn.Linear | None

    @staticmethod
    def init(Vocab: Axis, config: MixtralConfig, *, key) -> "MixtralLMHeadModel":
        k_model, k_head = jax.random.split(key, 2)
        head = None
        if not config.tie_word_embeddings:
            head = init_linear(config.Embed, Vocab, key=k_head, std=config.initializer_range)
        return MixtralLMHeadModel(MixtralModel.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> MixtralConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        return self.model(input_ids, attn_mask or AttentionMask.causal_mask())[0]

    def activations_with_aux(
        self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None
    ) -> tuple[NamedArray, AuxiliaryLoss]:
        """Final hidden states and the router terms (load balancing, z-loss) of this batch."""
        hidden, stats = self.model(input_ids, attn_mask or AttentionMask.causal_mask())
        return hidden, router_losses(stats, self.config)

    def get_lm_head(self) -> NamedArray:
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return head.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
