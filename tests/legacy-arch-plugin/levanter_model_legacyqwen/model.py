"""Qwen 2 composed from the core's layers by hand, as a third party following the guide of
levanter-core 0.1 would write it: its own config (``LmConfig`` + ``HfConvertible``), decoder
layer, stack, model and head, and a norm that serializes itself under another name through
Haliax's ``ModuleWithStateDictSerialization``. Nothing here uses the architecture kit."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import Axis, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization
from pydantic import PositiveInt

from levanter_core.hf import HfConvertible
from levanter_core.layers import (
    Attention,
    AttentionBackend,
    AttentionConfig,
    AttentionMask,
    DefaultRotaryConfig,
    GatedMlp,
    RmsNorm,
    RotaryConfig,
    init_linear,
    rotary_from_hf,
)
from levanter_core.models import LmConfig
from levanter_core.models.flops import lm_flops_per_token
from levanter_core.models.lm import GradientCheckpointing


class LegacyQwenConfig(LmConfig, HfConvertible):
    """The ``model:`` section for ``type: legacy_qwen``."""

    type: str = "legacy_qwen"
    """The registered type name."""
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"

    seq_len: PositiveInt = 256
    """Sequence length."""
    hidden_dim: PositiveInt = 64
    """Residual width."""
    intermediate_dim: PositiveInt = 128
    """MLP width."""
    num_layers: PositiveInt = 2
    """Layers."""
    num_heads: PositiveInt = 4
    """Query heads."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads."""
    layer_norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    rope: RotaryConfig = DefaultRotaryConfig(theta=1e6)
    """Rotary embedding."""
    attn_backend: AttentionBackend = "auto"
    """Attention implementation."""
    gradient_checkpointing: GradientCheckpointing = True
    """Recompute activations in the backward pass."""

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    def attention_config(self) -> AttentionConfig:
        return AttentionConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_dim // self.num_heads,
            rope=self.rope,
            qkv_bias=True,
            backend=self.attn_backend,
        )

    def build(self, Vocab: Axis, *, key) -> LegacyQwenLMHeadModel:
        return LegacyQwenLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_dim // self.num_heads,
            seq_len=self.seq_len,
            vocab_size=vocab_size,
        )

    @classmethod
    def from_hf_config(cls, hf: dict) -> LegacyQwenConfig:
        return cls(
            seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"],
            layer_norm_epsilon=hf["rms_norm_eps"],
            rope=rotary_from_hf(hf.get("rope_parameters"), default_theta=1e6, hf_config=hf),
        )

    def to_hf_config(self, vocab_size: int) -> dict:
        return {
            "model_type": "qwen2",
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "rms_norm_eps": self.layer_norm_epsilon,
            "tie_word_embeddings": False,
            "rope_parameters": self.rope.to_hf(),
        }


class PreMlpNorm(ModuleWithStateDictSerialization):
    """An RMSNorm kept as ``norm`` here and written as Hugging Face's ``post_attention_layernorm``
    by the layer's key map: a module with its own serialization, as the guide showed."""

    norm: RmsNorm

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.norm(x)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"norm": None}


class LegacyQwenLayer(ModuleWithStateDictSerialization):
    self_attn: Attention
    mlp: GatedMlp
    input_layernorm: RmsNorm
    pre_mlp: PreMlpNorm

    @staticmethod
    def init(config: LegacyQwenConfig, *, key) -> LegacyQwenLayer:
        k_attn, k_mlp = jax.random.split(key)
        return LegacyQwenLayer(
            Attention.init(config.attention_config(), key=k_attn),
            GatedMlp.init(config.Embed, config.Mlp, "silu", key=k_mlp),
            RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
            PreMlpNorm(RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon)),
        )

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"pre_mlp": "post_attention_layernorm"}

    def __call__(self, x: NamedArray, mask: AttentionMask) -> NamedArray:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.pre_mlp(x))


class LegacyQwenModel(eqx.Module):
    config: LegacyQwenConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    layers: hnn.Stacked
    norm: RmsNorm

    @staticmethod
    def init(Vocab: Axis, config: LegacyQwenConfig, *, key) -> LegacyQwenModel:
        k_embed, k_layers = jax.random.split(key)
        embed = hax.random.normal(k_embed, (Vocab, config.Embed)) * 0.02
        layers = hnn.Stacked.init(config.Layers, LegacyQwenLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        return LegacyQwenModel(
            config, hnn.Embedding(embed, Vocab=Vocab, Embed=config.Embed), layers, RmsNorm.init(config.Embed)
        )

    def __call__(self, input_ids: NamedArray, mask: AttentionMask) -> NamedArray:
        x = self.layers.fold(self.embed_tokens.embed(input_ids), mask)
        return self.norm(x)


class LegacyQwenLMHeadModel(eqx.Module):
    model: LegacyQwenModel
    lm_head: hnn.Linear

    @staticmethod
    def init(Vocab: Axis, config: LegacyQwenConfig, *, key) -> LegacyQwenLMHeadModel:
        k_model, k_head = jax.random.split(key)
        head = init_linear(config.Embed, Vocab, key=k_head, std=0.02)
        return LegacyQwenLMHeadModel(LegacyQwenModel.init(Vocab, config, key=k_model), head)

    @property
    def config(self) -> LegacyQwenConfig:
        return self.model.config

    @property
    def Vocab(self) -> Axis:
        return self.model.embed_tokens.Vocab

    def activations(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        return self.model(input_ids, attn_mask if attn_mask is not None else AttentionMask.causal_mask())

    def get_lm_head(self) -> NamedArray:
        return self.lm_head.weight.rearrange((self.config.Embed.name, self.Vocab.name))

    def __call__(self, input_ids: NamedArray, *, key=None, attn_mask: AttentionMask | None = None) -> NamedArray:
        hidden = self.activations(input_ids, key=key, attn_mask=attn_mask)
        return hax.dot(hidden, self.get_lm_head(), axis=self.config.Embed.name)
