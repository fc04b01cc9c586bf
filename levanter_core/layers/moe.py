"""Mixture-of-experts feed-forward layers: one router and one expert implementation that
every mixture-of-experts family configures (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3).

A :class:`MoeBlock` scores the experts for each token (the router), keeps the ``top_k``
best, runs only those experts on the token, and sums their outputs weighted by the
router; optional *shared experts* (DeepSeek) run on every token and are added.

**Routing** (``MoeConfig.routing``), in float32, as Hugging Face computes it:

* ``softmax_topk`` (Mixtral, Qwen3-MoE): softmax over all experts, keep the top ``k``,
  renormalize the kept probabilities to sum to one when ``normalize_top_k``;
* ``topk_softmax`` (GPT-OSS): keep the ``k`` largest logits, softmax over those ``k``;
* ``sigmoid_topk`` (DeepSeek-V3): a sigmoid score per expert; the choice adds a
  correction bias (``e_score_correction_bias``, fixed, not trained by gradient) and is
  limited to the best ``top_groups`` of ``num_groups`` expert groups (a group scored by
  its two best experts); the weights are the chosen experts' uncorrected scores,
  renormalized when ``normalize_top_k``, times ``routed_scaling``.

**Dispatch** is dropless and exact: each (token, chosen expert) pair becomes one row, the
rows are sorted by expert, and :func:`jax.lax.ragged_dot` multiplies each contiguous
group of rows by its own expert's matrices (a grouped matrix multiply on TPU and GPU; a
masked dense product on CPU, slower but exact). No token is ever dropped.

**Training terms**: each block returns a :class:`RouterStats`; :func:`router_losses` turns
the statistics of all layers into the load-balancing loss of Switch Transformer (as
Hugging Face computes it: ``num_experts * sum_e f_e * P_e`` with ``f_e`` the share of the
top-k choices that went to expert ``e`` and ``P_e`` its mean softmax probability, pooled
over layers and tokens) and the router z-loss of ST-MoE (``mean(logsumexp(logits)^2)``).

**Checkpoints**: the experts' weights are stacked along an ``experts`` axis; their Hugging
Face layout is an :class:`ExpertLayout`: one tensor per expert and projection
(``experts.{e}.w1.weight``, Mixtral; ``experts.{e}.gate_proj.weight``, Qwen3-MoE and
DeepSeek), or stacked tensors with gate and up projections fused and interleaved
(``experts.gate_up_proj``, GPT-OSS).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict, with_prefix

from levanter_core.layers.auxiliary import AuxiliaryLoss
from levanter_core.layers.expert_parallel import dropped_fraction, expert_mesh_axis, expert_parallel_apply
from levanter_core.layers.mlp import ACTIVATIONS, GatedMlp

Routing = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a family's Hugging Face checkpoints store the experts of one layer.

    ``per_expert``: ``{e}.{gate}.weight`` ``(mlp, embed)``, ``{e}.{up}.weight`` and
    ``{e}.{down}.weight`` ``(embed, mlp)`` for each expert ``e``, with ``names = (gate, up,
    down)``. ``fused_interleaved``: ``gate_up_proj`` ``(experts, embed, 2 * mlp)`` whose
    even columns are the gate projection and odd ones the up projection, ``down_proj``
    ``(experts, mlp, embed)``, and their biases ``gate_up_proj_bias`` and ``down_proj_bias``."""

    kind: Literal["per_expert", "fused_interleaved"] = "per_expert"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


MIXTRAL_EXPERTS = ExpertLayout("per_expert", ("w1", "w3", "w2"))
SPLIT_EXPERTS = ExpertLayout("per_expert", ("gate_proj", "up_proj", "down_proj"))
FUSED_INTERLEAVED_EXPERTS = ExpertLayout("fused_interleaved")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Everything :class:`MoeBlock` needs; a model config derives one from its own fields."""

    Embed: Axis
    num_experts: int
    top_k: int
    intermediate_dim: int
    """Width of each expert's hidden layer."""
    activation: str = "silu"
    routing: Routing = "softmax_topk"
    normalize_top_k: bool = True
    """Renormalize the chosen experts' weights to sum to one."""
    router_bias: bool = False
    expert_bias: bool = False
    """Biases on the experts' projections (GPT-OSS)."""
    correction_bias: bool = False
    """``sigmoid_topk``: a per-expert bias added to the scores for the choice only (DeepSeek-V3)."""
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3's ``routed_scaling_factor``)."""
    glu_limit: float | None = None
    """GPT-OSS's clamped SwiGLU: gate clamped above and up clamped to ``[-limit, limit]``, then
    ``(up + 1) * gate * sigmoid(glu_alpha * gate)``. None: ``act(gate) * up``."""
    glu_alpha: float = 1.702
    shared_intermediate_dim: int = 0
    """Width of the shared experts (one gated MLP every token goes through); 0: none."""
    layout: ExpertLayout = SPLIT_EXPERTS
    router_name: str = "gate"
    """The router's name in Hugging Face checkpoints (``gate``; GPT-OSS: ``router``)."""
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed the number of experts ({self.num_experts})")
        if self.num_experts % self.num_groups or self.top_groups > self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts cannot be split into {self.num_groups} groups of which "
                f"{self.top_groups} are chosen"
            )

    @property
    def Experts(self) -> Axis:
        return Axis("experts", self.num_experts)

    @property
    def TopExperts(self) -> Axis:
        return Axis("top_experts", self.top_k)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)


class RouterStats(eqx.Module):
    """What one layer's router did, for the training terms; stacked along ``layers`` by the
    scan over layers."""

    expert_fraction: NamedArray
    """``(experts,)``: share of the top-k choices that went to each expert (sums to k)."""
    mean_probability: NamedArray
    """``(experts,)``: each expert's softmax probability, averaged over the tokens."""
    z_loss: NamedArray
    """``()``: mean over the tokens of ``logsumexp(router_logits)^2``."""
    dropped_fraction: NamedArray | None = None
    """``()``: with the experts split over devices (expert parallelism), the share of the
    (token, expert) pairs dropped under ``trainer.expert_capacity_factor`` (0 when dropless);
    None on one device, where nothing is dropped."""


class Experts(ModuleWithStateDictSerialization):
    """The routed experts of one layer, ``down(act(gate x) * up x)`` each, with weights
    stacked along ``experts``. Serialized in the config's :class:`ExpertLayout` (a scanned
    model's leading ``layers`` axis passes through and is split by ``hnn.Stacked``)."""

    weight_decay_fields: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj", "down_proj")
    """The matrices the optimizer's default weight-decay mask decays (as it does hnn.Linear's)."""

    config: MoeConfig = eqx.field(static=True)
    gate_proj: NamedArray  # (experts, embed, mlp)
    up_proj: NamedArray  # (experts, embed, mlp)
    down_proj: NamedArray  # (experts, mlp, embed)
    gate_bias: NamedArray | None = None  # (experts, mlp)
    up_bias: NamedArray | None = None
    down_bias: NamedArray | None = None  # (experts, embed)

    @staticmethod
    def init(config: MoeConfig, *, key: jax.Array) -> Experts:
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        E, Embed, Mlp = c.Experts, c.Embed, c.Mlp
        std = c.initializer_range
        biases = (hax.zeros((E, Mlp)), hax.zeros((E, Mlp)), hax.zeros((E, Embed))) if c.expert_bias else (None,) * 3
        return Experts(
            c,
            hax.random.normal(k1, (E, Embed, Mlp)) * std,
            hax.random.normal(k2, (E, Embed, Mlp)) * std,
            hax.random.normal(k3, (E, Mlp, Embed)) * std,
            *biases,
        )

    def _hidden(self, gate: NamedArray, up: NamedArray) -> NamedArray:
        c = self.config
        if c.glu_limit is None:
            return ACTIVATIONS[c.activation](gate) * up
        gate = hax.minimum(gate, c.glu_limit)
        up = hax.clip(up, -c.glu_limit, c.glu_limit)
        return (up + 1) * gate * hnn.sigmoid(gate * c.glu_alpha)

    def _arrays(self) -> dict[str, NamedArray]:
        """The weights as :meth:`_rows` reads them: projections ``(experts, in, out)``, the
        gate and up biases ``(experts, mlp)``."""
        c = self.config
        out = {
            "gate_proj": self.gate_proj.rearrange(("experts", c.Embed, c.Mlp)),
            "up_proj": self.up_proj.rearrange(("experts", c.Embed, c.Mlp)),
            "down_proj": self.down_proj.rearrange(("experts", c.Mlp, c.Embed)),
        }
        if self.gate_bias is not None and self.up_bias is not None:
            out["gate_bias"] = self.gate_bias.rearrange(("experts", c.Mlp))
            out["up_bias"] = self.up_bias.rearrange(("experts", c.Mlp))
        return out

    def _rows(self, rows: jax.Array, group_sizes: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        """The experts on ``rows`` ``(R, embed)`` sorted by expert, ``group_sizes[e]`` of them for
        expert ``e`` of the weights ``w`` (as :meth:`_arrays` lays them out; a device's share under
        expert parallelism). Rows past the groups' sum are left out of every expert. Without the
        down projection's bias."""
        experts = w["gate_proj"].shape[0]
        expert_of_row = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=rows.shape[0])
        Slot, Mlp = Axis("slot", rows.shape[0]), Axis("mlp", w["gate_proj"].shape[-1])

        def grouped(inputs: jax.Array, name: str, bias: str) -> NamedArray:
            out = jax.lax.ragged_dot(inputs, w[name], group_sizes)
            if bias in w:
                out = out + w[bias][expert_of_row]
            return hax.named(out, (Slot, Mlp))

        hidden = self._hidden(grouped(rows, "gate_proj", "gate_bias"), grouped(rows, "up_proj", "up_bias"))
        return jax.lax.ragged_dot(hidden.array, w["down_proj"], group_sizes)

    def __call__(self, x: NamedArray, chosen: NamedArray, weights: NamedArray) -> NamedArray:
        """``x`` ``(..., embed)``; ``chosen`` (expert indices) and ``weights`` ``(..., top_experts)``
        with the same leading axes. Returns ``sum_j weights[j] * expert[chosen[j]](x)``, with
        ``x``'s axes. Where the compute mapping splits ``experts`` over a mesh axis, the experts
        run where their weights are (:mod:`levanter_core.layers.expert_parallel`)."""
        c = self.config
        mesh_axis = expert_mesh_axis(c.Experts)
        if mesh_axis is not None:
            return expert_parallel_apply(
                x, chosen, weights, self._arrays(), Experts=c.Experts, TopExperts=c.TopExperts, Embed=c.Embed,
                Mlp=c.Mlp, mesh_axis=mesh_axis, expert_fn=self._rows, down_bias=self.down_bias,
            )  # fmt: skip
        token_axes = tuple(ax for ax in x.axes if ax.name != c.Embed.name)
        flat = x.flatten_axes(token_axes, "token") if len(token_axes) != 1 else x
        Token = flat.resolve_axis(token_axes[0].name if len(token_axes) == 1 else "token")
        chosen = chosen.flatten_axes(token_axes, Token.name) if len(token_axes) != 1 else chosen
        weights = weights.flatten_axes(token_axes, Token.name) if len(token_axes) != 1 else weights
        TopExperts = c.TopExperts
        k = TopExperts.size
        # one row per (token, chosen expert) pair, token-major, then grouped by expert
        expert_of_slot = chosen.rearrange((Token, TopExperts)).array.reshape(-1)
        order = jnp.argsort(expert_of_slot, stable=True)
        group_sizes = jnp.bincount(expert_of_slot, length=c.num_experts).astype(jnp.int32)
        rows = flat.rearrange((Token, c.Embed)).array[order // k]
        w = {name: a.array for name, a in self._arrays().items()}
        out = self._rows(rows, group_sizes, w)
        if self.down_bias is not None:
            out = out + self.down_bias.rearrange(("experts", c.Embed)).array[expert_of_slot[order]]
        # back to token-major order, then the weighted sum over each token's k experts
        per_choice = out[jnp.argsort(order)].reshape(Token.size, k, c.Embed.size)
        per_choice = hax.named(per_choice, (Token, TopExperts, c.Embed))
        summed = hax.dot(per_choice, weights.rearrange((Token, TopExperts)).astype(per_choice.dtype), axis=TopExperts)
        summed = summed.astype(x.dtype)
        return summed.unflatten_axis(Token, token_axes) if len(token_axes) != 1 else summed

    # -- Hugging Face layouts -----------------------------------------------------------------
    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        layout = self.config.layout
        if layout.kind == "fused_interleaved":
            gate_up = _interleave(
                self.gate_proj.rearrange((..., "experts", "embed", "mlp")).array,
                self.up_proj.rearrange((..., "experts", "embed", "mlp")).array,
            )
            state = {
                with_prefix(prefix, "gate_up_proj"): gate_up,
                with_prefix(prefix, "down_proj"): self.down_proj.rearrange((..., "experts", "mlp", "embed")).array,
            }
            if self.gate_bias is not None:  # the three biases, or none
                assert self.up_bias is not None and self.down_bias is not None
                state[with_prefix(prefix, "gate_up_proj_bias")] = _interleave(
                    self.gate_bias.rearrange((..., "experts", "mlp")).array,
                    self.up_bias.rearrange((..., "experts", "mlp")).array,
                )
                state[with_prefix(prefix, "down_proj_bias")] = self.down_bias.rearrange((..., "experts", "embed")).array
            return state
        state = {}
        gate, up, down = layout.names
        for name, weight, (out, inp) in (
            (gate, self.gate_proj, ("mlp", "embed")),
            (up, self.up_proj, ("mlp", "embed")),
            (down, self.down_proj, ("embed", "mlp")),
        ):
            for e in range(self.config.num_experts):
                state[with_prefix(prefix, f"{e}.{name}.weight")] = weight["experts", e].rearrange((..., out, inp)).array
        return state

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> Experts:
        layout = self.config.layout
        if layout.kind == "fused_interleaved":
            gate, up = _deinterleave(jnp.asarray(state_dict[with_prefix(prefix, "gate_up_proj")]))
            loaded = {
                "gate_proj": _named_like(gate, self.gate_proj, ("experts", "embed", "mlp")),
                "up_proj": _named_like(up, self.up_proj, ("experts", "embed", "mlp")),
                "down_proj": _named_like(
                    jnp.asarray(state_dict[with_prefix(prefix, "down_proj")]),
                    self.down_proj,
                    ("experts", "mlp", "embed"),
                ),
            }
            if self.gate_bias is not None:
                gate_b, up_b = _deinterleave(jnp.asarray(state_dict[with_prefix(prefix, "gate_up_proj_bias")]))
                loaded["gate_bias"] = _named_like(gate_b, self.gate_bias, ("experts", "mlp"))
                loaded["up_bias"] = _named_like(up_b, self.up_bias, ("experts", "mlp"))
                loaded["down_bias"] = _named_like(
                    jnp.asarray(state_dict[with_prefix(prefix, "down_proj_bias")]), self.down_bias, ("experts", "embed")
                )
            return dataclasses.replace(self, **loaded)
        loaded = {}
        for field, name, (out, inp) in zip(
            ("gate_proj", "up_proj", "down_proj"), layout.names, (("mlp", "embed"), ("mlp", "embed"), ("embed", "mlp"))
        ):
            template = getattr(self, field)
            names = [with_prefix(prefix, f"{e}.{name}.weight") for e in range(self.config.num_experts)]
            per_expert = [jnp.asarray(state_dict[n]) for n in names]
            # stacked on a new leading axis: (experts, [layers,] out, in)
            loaded[field] = _named_like(jnp.stack(per_expert), template, ("experts", out, inp), experts_first=True)
        return dataclasses.replace(self, **loaded)


def _interleave(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``[..., 2 * mlp]`` with gate in the even and up in the odd columns."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _deinterleave(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gate_up[..., ::2], gate_up[..., 1::2]


def _named_like(
    array: jax.Array, template: NamedArray, core: tuple[str, ...], *, experts_first: bool = False
) -> NamedArray:
    """``array`` (the ``core`` axes last, any leading axes of ``template`` such as ``layers``
    before them, or, with ``experts_first``, after a leading ``experts``) named as ``template``."""
    leading = tuple(ax for ax in template.axes if ax.name not in core)
    core_axes = tuple(template.resolve_axis(n) for n in core)
    if experts_first:
        axes = (core_axes[0], *leading, *core_axes[1:])
    else:
        axes = (*leading, *core_axes)
    return hax.named(array, axes).rearrange(template.axes)


class Router(eqx.Module):
    """The router's linear scores, and DeepSeek's correction bias."""

    weight_decay_fields: ClassVar[tuple[str, ...]] = ("weight",)

    weight: NamedArray  # (experts, embed)
    bias: NamedArray | None = None
    e_score_correction_bias: NamedArray | None = None

    def logits(self, x: NamedArray) -> NamedArray:
        """Router logits in float32 (inputs and weights upcast first, as Hugging Face does for
        DeepSeek; for the others it makes no difference in float32 and keeps bfloat16 routing stable)."""
        out = hax.dot(x.astype(jnp.float32), self.weight.astype(jnp.float32), axis="embed")
        return out if self.bias is None else out + self.bias.astype(jnp.float32)


class MoeBlock(eqx.Module):
    """The router, the routed experts and the optional shared experts of one layer."""

    config: MoeConfig = eqx.field(static=True)
    router: Router
    experts: Experts
    shared_experts: GatedMlp | None = None

    @staticmethod
    def init(config: MoeConfig, *, key: jax.Array) -> MoeBlock:
        c = config
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        router = Router(
            hax.random.normal(k_router, (c.Experts, c.Embed)) * c.initializer_range,
            hax.zeros(c.Experts) if c.router_bias else None,
            hax.zeros(c.Experts) if c.correction_bias else None,
        )
        shared = None
        if c.shared_intermediate_dim:
            Shared = Axis("mlp", c.shared_intermediate_dim)
            shared = GatedMlp.init(c.Embed, Shared, c.activation, key=k_shared, std=c.initializer_range)
        return MoeBlock(c, router, Experts.init(c, key=k_experts), shared)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"router": self.config.router_name}

    def route(self, logits: NamedArray, Token: Axis) -> tuple[NamedArray, NamedArray]:
        """The chosen experts and their weights, each ``(token, top_experts)``."""
        c = self.config
        Experts, TopExperts = c.Experts, c.TopExperts
        if c.routing == "softmax_topk":
            probs = hnn.softmax(logits, axis=Experts)
            weights, chosen = hax.top_k(probs, Experts, c.top_k, TopExperts)
            if c.normalize_top_k:
                weights = weights / hax.sum(weights, TopExperts)
        elif c.routing == "topk_softmax":
            top, chosen = hax.top_k(logits, Experts, c.top_k, TopExperts)
            weights = hnn.softmax(top, axis=TopExperts)
        else:
            scores = hnn.sigmoid(logits)
            choice = scores
            if self.router.e_score_correction_bias is not None:
                choice = scores + jax.lax.stop_gradient(self.router.e_score_correction_bias.astype(jnp.float32))
            if c.num_groups > 1:
                choice = _limit_to_top_groups(choice, Token, c)
            _, chosen = hax.top_k(choice, Experts, c.top_k, TopExperts)
            weights = hax.named(
                jnp.take_along_axis(
                    scores.rearrange((Token, Experts)).array, chosen.rearrange((Token, TopExperts)).array, axis=-1
                ),
                (Token, TopExperts),
            )
            if c.normalize_top_k:
                weights = weights / (hax.sum(weights, TopExperts) + 1e-20)
            weights = weights * c.routed_scaling
        return chosen.rearrange((Token, TopExperts)), weights.rearrange((Token, TopExperts))

    def __call__(self, x: NamedArray) -> tuple[NamedArray, RouterStats]:
        """``x`` ``(..., embed)``: the block's output with the same axes, and the router's statistics."""
        c = self.config
        token_axes = tuple(ax for ax in x.axes if ax.name != "embed")
        tokens = x.flatten_axes(token_axes, "token")
        Token = tokens.resolve_axis("token")
        logits = self.router.logits(tokens)
        chosen, weights = self.route(logits, Token)
        mesh_axis = expert_mesh_axis(c.Experts)
        dropped = None
        if mesh_axis is None:
            out = self.experts(tokens, chosen, weights)
        else:  # the experts' devices get each device's tokens as they are split, (batch, position)
            split = (chosen.unflatten_axis("token", token_axes), weights.unflatten_axis("token", token_axes))
            out = self.experts(x, *split).flatten_axes(token_axes, "token")
            dropped = dropped_fraction(split[0], Experts=c.Experts, TopExperts=c.TopExperts, mesh_axis=mesh_axis)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        stats = RouterStats(
            expert_fraction=hax.sum(hnn.one_hot(chosen, c.Experts, dtype=jnp.float32), (Token, c.TopExperts))
            / Token.size,
            mean_probability=hax.mean(hnn.softmax(logits, axis=c.Experts), Token),
            z_loss=hax.mean(hax.square(hnn.logsumexp(logits, c.Experts)), Token),
            dropped_fraction=dropped,
        )
        return out.unflatten_axis("token", token_axes), stats


def _limit_to_top_groups(choice: NamedArray, Token: Axis, c: MoeConfig) -> NamedArray:
    """``choice`` with every expert outside the ``top_groups`` best groups set to -inf; a
    group's score is the sum of its two best experts' (DeepSeek-V3's group-limited routing)."""
    per_group = c.num_experts // c.num_groups
    grouped = choice.rearrange((Token, c.Experts)).array.reshape(Token.size, c.num_groups, per_group)
    best_two = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)
    _, top_groups = jax.lax.top_k(best_two, c.top_groups)
    keep = jnp.zeros((Token.size, c.num_groups), bool).at[jnp.arange(Token.size)[:, None], top_groups].set(True)
    masked = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(Token.size, c.num_experts)
    return hax.named(masked, (Token, c.Experts))


def router_losses(stats: RouterStats, num_experts: int, *, balance_weight: float, z_weight: float) -> AuxiliaryLoss:
    """The load-balancing loss and the router z-loss from the statistics of all layers (stacked
    along ``layers``),
    weighted into one training term; the unweighted values are the metrics
    (``moe/load_balancing_loss``, ``moe/router_z_loss``, and ``moe/dropped_pairs`` where the
    experts are split over devices). Returns an
    :class:`~levanter_core.layers.auxiliary.AuxiliaryLoss`."""

    Layers = stats.z_loss.resolve_axis("layers")
    # pooled over layers before the product, as Hugging Face's load_balancing_loss_func does
    fraction = hax.mean(stats.expert_fraction, Layers)
    probability = hax.mean(stats.mean_probability, Layers)
    balance = num_experts * hax.sum(fraction * probability).scalar()
    z_loss = hax.mean(stats.z_loss, Layers).scalar()
    metrics = {"moe/load_balancing_loss": balance, "moe/router_z_loss": z_loss}
    if stats.dropped_fraction is not None:
        metrics["moe/dropped_pairs"] = hax.mean(stats.dropped_fraction, Layers).scalar()
    return AuxiliaryLoss(balance_weight * balance + z_weight * z_loss, metrics)


__all__ = [
    "FUSED_INTERLEAVED_EXPERTS",
    "MIXTRAL_EXPERTS",
    "SPLIT_EXPERTS",
    "ExpertLayout",
    "Experts",
    "MoeBlock",
    "MoeConfig",
    "Router",
    "RouterStats",
    "router_losses",
]
