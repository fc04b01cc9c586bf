"""Mistral 7B (Jiang et al., 2023): Llama with grouped-query attention over a sliding
window of ``sliding_window`` tokens in every layer."""

from __future__ import annotations

from pydantic import PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_model_llama.llama import LlamaConfig

# Hugging Face's MistralConfig default, for a config.json without the key (null turns it off)
_HF_SLIDING_WINDOW = 4096


class MistralConfig(LlamaConfig):
    """The ``model:`` section for ``type: mistral``. Defaults are Mistral 7B v0.1's."""

    type: str = "mistral"
    default_hf_checkpoint = "mistralai/Mistral-7B-v0.1"

    hf_architecture = "MistralForCausalLM"
    hf_model_type = "mistral"
    hf_keys = {
        **{k: v for k, v in LlamaConfig.hf_keys.items() if k != "use_bias"},
        "sliding_window": HfKey("sliding_window", _HF_SLIDING_WINDOW),
    }

    seq_len: PositiveInt = 4096
    intermediate_dim: PositiveInt = 14336
    num_kv_heads: PositiveInt = 8

    sliding_window: PositiveInt | None = _HF_SLIDING_WINDOW
    """Each token attends to itself and the ``sliding_window - 1`` tokens before it;
    ``None`` attends to the whole sequence."""

    @model_validator(mode="after")
    def _no_biases(self):
        if self.use_bias:
            raise ValueError(
                "use_bias: Mistral's attention has no biases (Hugging Face's MistralConfig cannot hold them)"
            )
        return self

    def attention_types(self):
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_layers

    def to_hf_config(self, vocab_size: int) -> dict:
        config = super().to_hf_config(vocab_size)
        del config["mlp_bias"]
        return config
