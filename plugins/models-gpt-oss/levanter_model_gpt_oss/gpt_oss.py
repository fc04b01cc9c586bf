"""gpt-oss (OpenAI, 2025): a pre-norm decoder whose every layer is a mixture of experts, with
three things of its own:

* **attention sinks**: a learned logit per head joins each softmax as an extra key without
  a value, so a head can attend to nothing (``self_attn.sinks``);
* **alternating attention**: sliding-window layers (a window of 128) and full layers in
  turn (``layer_types``), with biases on all four projections;
* **its experts**: a router with a bias that keeps the ``num_experts_per_tok`` largest
  logits and softmaxes over those, and experts with biases whose SwiGLU is clamped
  (``gate <= limit``, ``|up| <= limit``, ``(up + 1) * gate * sigmoid(1.702 gate)``), stored
  in checkpoints as stacked tensors with gate and up columns interleaved
  (``mlp.experts.gate_up_proj``), the router as ``mlp.router``.

Everything else (the rotary embedding is YaRN-extended) is the kit's; the experts are the
core's :mod:`levanter_core.layers.moe`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import FUSED_INTERLEAVED_EXPERTS, AttentionConfig, MoeConfig, RotaryConfig, YarnRotaryConfig
from levanter_core.layers.rotary import rotary_from_hf
from levanter_core.models.decoder import DecoderConfig, LayerType

_HF_THETA = 150000.0
# what transformers' GptOssConfig fills in when a config.json has no rope_parameters (nor rope_scaling)
_HF_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _layer_types_in(value, hf):
    return tuple(value) if value is not None else None


class GptOssConfig(DecoderConfig):
    """The ``model:`` section for ``type: gpt_oss``. Defaults are gpt-oss-20b's."""

    type: str = "gpt_oss"
    default_hf_checkpoint = "openai/gpt-oss-20b"

    hf_architecture = "GptOssForCausalLM"
    hf_model_type = "gpt_oss"
    hf_keys: ClassVar = {
        **DecoderConfig.hf_keys,
        # absent: transformers' 64, not hidden_size / num_attention_heads
        "head_dim": HfKey("head_dim", 64, write=lambda v, c: c.actual_head_dim),
        "layer_norm_epsilon": HfKey("rms_norm_eps", 1e-5),
        "use_bias": HfKey("attention_bias", True),
        "num_local_experts": HfKey("num_local_experts", 128),
        "num_experts_per_tok": HfKey("num_experts_per_tok", 4),
        "swiglu_alpha": HfKey("swiglu_alpha", 1.702),
        "swiglu_limit": HfKey("swiglu_limit", 7.0),
        "router_aux_loss_coef": HfKey("router_aux_loss_coef", 0.001),
        "sliding_window": HfKey("sliding_window", 128),
        "layer_types": HfKey("layer_types", None, read=_layer_types_in, write=lambda v, c: list(c.attention_types())),
    }
    hf_refused: ClassVar = {"attention_dropout": (0, 0.0)}
    hf_rope_theta = _HF_THETA

    seq_len: PositiveInt = 131072
    hidden_dim: PositiveInt = 2880
    intermediate_dim: PositiveInt = 2880
    num_layers: PositiveInt = 24
    num_heads: PositiveInt = 64
    num_kv_heads: PositiveInt = 8
    head_dim: PositiveInt | None = 64
    rope: RotaryConfig = rotary_from_hf(_HF_ROPE_PARAMETERS, default_theta=_HF_THETA)

    use_bias: bool = True
    """Biases on the query, key, value and output projections (``attention_bias``)."""

    sliding_window: PositiveInt | None = 128
    """Sliding layers let each token attend to itself and the ``sliding_window - 1`` tokens before it."""

    layer_types: tuple[LayerType, ...] | None = None
    """Each layer's attention, ``sliding_attention`` or ``full_attention`` (one entry per layer);
    None: sliding and full in turn, starting with sliding."""

    num_local_experts: PositiveInt = 32
    """Number of experts in each layer."""

    num_experts_per_tok: PositiveInt = 4
    """Number of experts each token is routed to."""

    swiglu_alpha: PositiveFloat = 1.702
    """The experts' gate is ``gate * sigmoid(swiglu_alpha * gate)``."""

    swiglu_limit: PositiveFloat = 7.0
    """The experts' gate is clamped to at most ``swiglu_limit``, their up projection to
    ``[-swiglu_limit, swiglu_limit]``."""

    router_aux_loss_coef: float = Field(0.9, ge=0.0)
    """Weight of the load-balancing loss in the training objective (logged unweighted as
    ``moe/load_balancing_loss``); 0.9 in gpt-oss-20b's ``config.json`` (transformers' own
    default, for a file without the key, is 0.001)."""

    router_z_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the router z-loss (ST-MoE) in the training objective; ours, not exported."""

    @model_validator(mode="after")
    def _check(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}; "
                "give one per layer"
            )
        if self.attn_backend == "jax":
            raise ValueError("attn_backend 'jax' cannot add attention sinks; use 'auto' or 'reference'")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed num_local_experts "
                f"({self.num_local_experts})"
            )
        return self

    def attention_types(self) -> tuple[LayerType, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_layers))

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(
            super().attention_config(),
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            sinks=True,
        )

    def moe_config(self) -> MoeConfig:
        return MoeConfig(
            Embed=self.Embed,
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_dim=self.intermediate_dim,
            routing="topk_softmax",
            router_bias=True,
            expert_bias=True,
            glu_limit=self.swiglu_limit,
            glu_alpha=self.swiglu_alpha,
            layout=FUSED_INTERLEAVED_EXPERTS,
            router_name="router",
            initializer_range=self.initializer_range,
        )

    def router_loss_weights(self) -> tuple[float, float]:
        return self.router_aux_loss_coef, self.router_z_loss_coef

    # -- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def rope_from_hf(cls, hf: dict):
        if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_parameters": _HF_ROPE_PARAMETERS}  # YaRN, as transformers assumes
        return super().rope_from_hf(hf)

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        quantization = hf.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(
                f"quantization_config: the experts are stored quantized ({method}), as in OpenAI's published "
                "gpt-oss checkpoints; only unquantized ones can be imported. Dequantize first: load it in "
                "transformers with quantization_config=Mxfp4Config(dequantize=True) and save_pretrained."
            )
        return super().hf_fields(hf)

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        if isinstance(self.rope, YarnRotaryConfig):  # gpt-oss's configs spell out YaRN's betas
            hf["rope_parameters"].update(beta_fast=self.rope.beta_fast, beta_slow=self.rope.beta_slow)
        return hf
