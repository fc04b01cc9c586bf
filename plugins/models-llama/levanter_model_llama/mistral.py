"""Mistral 7B (Jiang et al., 2023): Llama with grouped-query attention over a sliding
window of ``sliding_window`` tokens in every layer."""

from __future__ import annotations

from typing import ClassVar

from pydantic import PositiveInt, model_validator

from levanter_core.layers import AttentionConfig
from levanter_model_llama.llama import LlamaConfig


class MistralConfig(LlamaConfig):
    """The ``model:`` section for ``type: mistral``. Defaults are Mistral 7B v0.1's."""

    type: str = "mistral"
    """The registered type name."""
    default_hf_checkpoint: ClassVar[str | None] = "mistralai/Mistral-7B-v0.1"
    """What ``initialize_from_hf: true`` loads without ``reference_checkpoint`` (Levanter's default)."""

    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    hf_model_type: ClassVar[str] = "mistral"

    seq_len: PositiveInt = 4096
    """Length of the training sequences (Hugging Face's ``max_position_embeddings``)."""

    intermediate_dim: PositiveInt = 14336
    """Width of the MLP's hidden layer (``intermediate_size``)."""

    num_kv_heads: PositiveInt = 8
    """Number of key/value heads (grouped-query attention)."""

    sliding_window: PositiveInt | None = 4096
    """Each token attends to itself and the ``sliding_window - 1`` tokens before it;
    ``None`` attends to the whole sequence."""

    @model_validator(mode="after")
    def _no_biases(self):
        if self.use_bias:
            raise ValueError("use_bias: Mistral's attention has no biases (Hugging Face's MistralConfig cannot hold them)")
        return self

    def attention_config(self) -> AttentionConfig:
        import dataclasses

        return dataclasses.replace(super().attention_config(), sliding_window=self.sliding_window)

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        # a file without the key gets transformers' MistralConfig default, 4096 (null turns it off)
        return {**super().hf_fields(hf), "sliding_window": hf.get("sliding_window", 4096)}

    def to_hf_config(self, vocab_size: int) -> dict:
        config = {**super().to_hf_config(vocab_size), "sliding_window": self.sliding_window}
        for llama_only in ("attention_bias", "mlp_bias"):
            del config[llama_only]
        return config
