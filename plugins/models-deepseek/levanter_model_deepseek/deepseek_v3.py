"""DeepSeek-V3 (DeepSeek-AI, 2024): the kit's pre-norm decoder with multi-head latent
attention and, after ``first_k_dense_replace`` dense layers, a mixture of experts in
every layer.

* **Attention** is the core's multi-head latent attention
  (:mod:`levanter_core.layers.mla`): keys and values come from a ``kv_lora_rank``-wide
  latent, queries optionally from a ``q_lora_rank``-wide one, and only
  ``qk_rope_head_dim`` dimensions of each head rotate (interleaved in the checkpoints).
* **Routing** (:mod:`levanter_core.layers.moe`, ``sigmoid_topk``): a sigmoid score per
  expert; the choice adds a fixed correction bias (``e_score_correction_bias``) and is
  limited to the best ``topk_group`` of ``n_group`` groups; the chosen experts' scores,
  renormalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``, weight them.
  ``n_shared_experts`` shared experts run on every token.
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from levanter_core.hf.mapping import DECODER_HF_KEYS, HfKey
from levanter_core.layers import SPLIT_EXPERTS, MoeConfig, RotaryConfig, YarnRotaryConfig
from levanter_core.layers.mla import MlaConfig, MultiHeadLatentAttention
from levanter_core.models.decoder import DecoderConfig, LayerKind


class DeepseekV3Config(DecoderConfig):
    """The ``model:`` section for ``type: deepseek_v3``. Defaults are DeepSeek-V3's (671B)."""

    type: str = "deepseek_v3"
    default_hf_checkpoint = "deepseek-ai/DeepSeek-V3"

    hf_architecture = "DeepseekV3ForCausalLM"
    hf_model_type = "deepseek_v3"
    hf_keys = {
        # head_dim is transformers' own name for qk_rope_head_dim here: not ours to write
        **{k: v for k, v in DECODER_HF_KEYS.items() if k != "head_dim"},
        "use_bias": HfKey("attention_bias", False),
        "moe_intermediate_dim": HfKey("moe_intermediate_size", 2048),
        "n_routed_experts": HfKey("n_routed_experts", 256),
        "n_shared_experts": HfKey("n_shared_experts", 1),
        "num_experts_per_tok": HfKey("num_experts_per_tok", 8),
        "n_group": HfKey("n_group", 8),
        "topk_group": HfKey("topk_group", 4),
        "norm_topk_prob": HfKey("norm_topk_prob", True),
        "routed_scaling_factor": HfKey("routed_scaling_factor", 2.5),
        "first_k_dense_replace": HfKey("first_k_dense_replace", 3),
        "kv_lora_rank": HfKey("kv_lora_rank", 512),
        "q_lora_rank": HfKey("q_lora_rank", 1536),
        "qk_rope_head_dim": HfKey("qk_rope_head_dim", 64),
        "qk_nope_head_dim": HfKey("qk_nope_head_dim", 128),
        "v_head_dim": HfKey("v_head_dim", 128),
        "rope_interleave": HfKey("rope_interleave", True),
    }

    seq_len: PositiveInt = 163840
    hidden_dim: PositiveInt = 7168
    intermediate_dim: PositiveInt = 18432
    num_layers: PositiveInt = 61
    num_heads: PositiveInt = 128
    num_kv_heads: PositiveInt = 128
    layer_norm_epsilon: float = Field(1e-6, gt=0.0)
    rope: RotaryConfig = YarnRotaryConfig(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )

    use_bias: bool = False
    """Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``)."""

    kv_lora_rank: PositiveInt = 512
    """Width of the latent that keys and values are projected from."""

    q_lora_rank: PositiveInt | None = 1536
    """Width of the latent queries are projected from; None: queries straight from the hidden state."""

    qk_nope_head_dim: PositiveInt = 128
    """Dimensions of each query and key head that do not rotate."""

    qk_rope_head_dim: PositiveInt = 64
    """Dimensions of each query and key head that rotate (the key's shared by all heads)."""

    v_head_dim: PositiveInt = 128
    """Size of each value head."""

    rope_interleave: bool = True
    """The rotated dimensions come in interleaved pairs in the checkpoints (DeepSeek-V3's layout)."""

    moe_intermediate_dim: PositiveInt = 2048
    """Width of each routed expert's hidden layer (``moe_intermediate_size``); the dense layers use
    ``intermediate_dim``, the shared experts ``moe_intermediate_dim * n_shared_experts``."""

    n_routed_experts: PositiveInt = 256
    """Number of routed experts in each mixture-of-experts layer."""

    n_shared_experts: int = Field(1, ge=0)
    """Number of shared experts (one gated MLP of their combined width) every token goes through."""

    num_experts_per_tok: PositiveInt = 8
    """Number of routed experts each token is sent to."""

    n_group: PositiveInt = 8
    """Groups the routed experts are divided into for the choice."""

    topk_group: PositiveInt = 4
    """Groups a token's experts may come from."""

    norm_topk_prob: bool = True
    """Renormalize the chosen experts' scores to sum to one."""

    routed_scaling_factor: PositiveFloat = 2.5
    """Multiplies the routed experts' weights."""

    first_k_dense_replace: int = Field(3, ge=0)
    """The first layers, dense (a gated MLP of ``intermediate_dim``) rather than mixtures of experts."""

    router_aux_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the load-balancing loss (DeepSeek-V3 balances with the correction bias instead;
    0 by default). Logged unweighted as ``moe/load_balancing_loss``; not exported."""

    router_z_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the router z-loss; not exported."""

    def attention_module(self, *, key) -> MultiHeadLatentAttention:
        config = MlaConfig(
            Embed=self.Embed,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            rope=self.rope,
            rope_interleave=self.rope_interleave,
            bias=self.use_bias,
            backend=self.attn_backend,
            query_block=self.flash_attention_block_size,
            initializer_range=self.initializer_range,
        )
        return MultiHeadLatentAttention.init(config, key=key)

    def moe_config(self) -> MoeConfig:
        return MoeConfig(
            Embed=self.Embed,
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_dim=self.moe_intermediate_dim,
            activation=self.activation_function,
            routing="sigmoid_topk",
            normalize_top_k=self.norm_topk_prob,
            correction_bias=True,
            num_groups=self.n_group,
            top_groups=self.topk_group,
            routed_scaling=self.routed_scaling_factor,
            shared_intermediate_dim=self.moe_intermediate_dim * self.n_shared_experts,
            layout=SPLIT_EXPERTS,
            initializer_range=self.initializer_range,
        )

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple("dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_layers))

    def router_loss_weights(self) -> tuple[float, float]:
        return self.router_aux_loss_coef, self.router_z_loss_coef

    def to_hf_config(self, vocab_size: int) -> dict:
        hf = super().to_hf_config(vocab_size)
        if isinstance(self.rope, YarnRotaryConfig):  # DeepSeek's configs spell out YaRN's betas
            hf["rope_parameters"].update(beta_fast=self.rope.beta_fast, beta_slow=self.rope.beta_slow)
        return hf
