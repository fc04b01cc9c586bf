"""Qwen3-MoE (Qwen team, 2025): Qwen 3's attention with a mixture of experts in place of the
MLP, in every layer but those ``mlp_only_layers`` names (and, with ``decoder_sparse_step``
above 1, all but every ``step``-th).

The experts are the core's (:mod:`levanter_core.layers.moe`): a softmax router over
``num_experts`` experts, the top ``num_experts_per_tok`` kept (renormalized when
``norm_topk_prob``), dropless dispatch; checkpoints keep one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``) and the router as ``mlp.gate.weight``. Training adds
the load-balancing loss (``router_aux_loss_coef``) and, ours only, the router z-loss.
A sliding window, when ``use_sliding_window``, applies to every layer.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, NonNegativeInt, PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import SPLIT_EXPERTS, MoeConfig
from levanter_core.models.decoder import LayerKind, LayerType
from levanter_model_qwen3.qwen3 import Qwen3Config


class Qwen3MoeConfig(Qwen3Config):
    """The ``model:`` section for ``type: qwen3_moe``. Defaults are Qwen3-30B-A3B's."""

    type: str = "qwen3_moe"
    default_hf_checkpoint = "Qwen/Qwen3-30B-A3B"

    hf_architecture = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    hf_keys: ClassVar = {
        **{k: v for k, v in Qwen3Config.hf_keys.items() if k != "max_window_layers"},
        # unlike Qwen3Config, Qwen3MoeConfig has no head_dim of its own: a file without one
        # splits hidden_size evenly among the heads
        "head_dim": HfKey("head_dim", None, read=lambda v, hf: v or hf["hidden_size"] // hf["num_attention_heads"]),
        # transformers 5 writes num_local_experts (num_experts is its alias); older files num_experts
        "num_experts": HfKey("num_local_experts", 128, read=lambda v, hf: hf.get("num_experts", v)),
        "num_experts_per_tok": HfKey("num_experts_per_tok", 8),
        "moe_intermediate_dim": HfKey("moe_intermediate_size", 768),
        "norm_topk_prob": HfKey("norm_topk_prob", False),
        "decoder_sparse_step": HfKey("decoder_sparse_step", 1),
        "mlp_only_layers": HfKey(
            "mlp_only_layers", None, read=lambda v, hf: tuple(v or ()), write=lambda v, c: list(v)
        ),
        "router_aux_loss_coef": HfKey("router_aux_loss_coef", 0.001),
    }

    seq_len: PositiveInt = 40960
    hidden_dim: PositiveInt = 2048
    intermediate_dim: PositiveInt = 6144
    num_layers: PositiveInt = 48
    num_kv_heads: PositiveInt = 4

    max_window_layers: NonNegativeInt = 48
    """Not used by Qwen3-MoE, whose window (with ``use_sliding_window``) covers every layer; kept
    from Qwen 2, with the value Qwen3-30B-A3B's config.json carries."""

    num_experts: PositiveInt = 128
    """Number of experts in each mixture-of-experts layer."""

    num_experts_per_tok: PositiveInt = 8
    """Number of experts each token is routed to, the ``k`` of top-k routing."""

    moe_intermediate_dim: PositiveInt = 768
    """Width of each expert's hidden layer (``moe_intermediate_size``); the dense layers use
    ``intermediate_dim``."""

    norm_topk_prob: bool = True
    """Renormalize the chosen experts' probabilities to sum to one."""

    decoder_sparse_step: PositiveInt = 1
    """Every ``decoder_sparse_step``-th layer (counting from 1) is a mixture of experts, the
    others dense."""

    mlp_only_layers: tuple[NonNegativeInt, ...] = ()
    """Indices of layers that are dense whatever ``decoder_sparse_step`` says."""

    router_aux_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the load-balancing loss in the training objective (logged unweighted as
    ``moe/load_balancing_loss``)."""

    router_z_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the router z-loss, ``mean(logsumexp(router_logits)^2)`` (ST-MoE), in the training
    objective (logged as ``moe/router_z_loss``). Hugging Face's Qwen3-MoE has none; not exported."""

    def attention_types(self) -> tuple[LayerType, ...]:
        kind: LayerType = "sliding_attention" if self.use_sliding_window else "full_attention"
        return (kind,) * self.num_layers

    def moe_config(self) -> MoeConfig:
        return MoeConfig(
            Embed=self.Embed,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            intermediate_dim=self.moe_intermediate_dim,
            activation=self.activation_function,
            routing="softmax_topk",
            normalize_top_k=self.norm_topk_prob,
            layout=SPLIT_EXPERTS,
            initializer_range=self.initializer_range,
        )

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        def kind(i: int) -> LayerKind:
            sparse = i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            return "moe" if sparse else "dense"

        return tuple(kind(i) for i in range(self.num_layers))

    def router_loss_weights(self) -> tuple[float, float]:
        return self.router_aux_loss_coef, self.router_z_loss_coef

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        del hf["layer_types"]  # not a Qwen3MoeConfig key: the window is all layers' or none
        return hf
