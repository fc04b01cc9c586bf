"""Phi-3 (Abdin et al., 2024): Llama's decoder with two fused projections and LongRoPE.

What differs from the kit's common decoder:

* Hugging Face checkpoints keep the query, key and value projections in one tensor,
  ``self_attn.qkv_proj`` (queries, then keys, then values, along the output), and the gate
  and up projections in ``mlp.gate_up_proj`` (gate first). The modules keep them apart;
  ``hf_fused_qkv`` and ``GatedMlp``'s ``fused`` rewrite the tensors at the checkpoint's edge.
* ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only part of each head, and the
  128k-context models use LongRoPE (``rope: {type: longrope, ...}``), whose factors switch
  with the sequence length past ``original_max_position_embeddings``.
* An optional sliding window over every layer.
"""

from __future__ import annotations

import dataclasses

from pydantic import PositiveInt

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import AttentionConfig, GatedMlp
from levanter_core.models.decoder import DecoderConfig

_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attention_dropout")


class Phi3Config(DecoderConfig):
    """The ``model:`` section for ``type: phi3``. Defaults are Phi-3-mini-4k-instruct's."""

    type: str = "phi3"

    hf_architecture = "Phi3ForCausalLM"
    hf_model_type = "phi3"
    hf_keys = {
        **DecoderConfig.hf_keys,
        "head_dim": HfKey(
            "head_dim", None, read=DecoderConfig.hf_keys["head_dim"].read, written=False
        ),  # not a Phi3Config key; written by to_hf_config only when it is not implied
        "sliding_window": HfKey("sliding_window", None),
    }
    hf_partial_rotary = True
    # dropout only acts in training, and we train without it: refuse rather than ignore it
    hf_refused = dict.fromkeys(_DROPOUTS, (0, 0.0))

    seq_len: PositiveInt = 4096
    hidden_dim: PositiveInt = 3072
    intermediate_dim: PositiveInt = 8192

    sliding_window: PositiveInt | None = None
    """If set, every layer attends only to the ``sliding_window`` most recent tokens (itself
    included); ``None`` attends to the whole sequence."""

    def attention_types(self):
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_layers

    def attention_config(self) -> AttentionConfig:
        return dataclasses.replace(super().attention_config(), hf_fused_qkv="qkv_proj")

    def mlp_module(self, *, key) -> GatedMlp:
        c = self
        return GatedMlp.init(
            c.Embed, c.Mlp, c.activation_function, key=key, std=c.initializer_range, fused="gate_up_proj"
        )

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        # Phi3Config keeps these beside rope_parameters too
        if self.rope.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = self.rope.partial_rotary_factor
        original = getattr(self.rope, "original_max_position_embeddings", None)
        if original is not None:
            hf["original_max_position_embeddings"] = original
        if self.head_dim is not None:
            hf["head_dim"] = self.head_dim
        return hf
