"""Mixtral (Jiang et al., 2024): Mistral's decoder with each MLP replaced by a sparse mixture
of SwiGLU experts, the core's :mod:`levanter_core.layers.moe`.

Routing follows Hugging Face's ``MixtralForCausalLM``: a linear router (``gate``, no bias)
scores every expert; a float32 softmax over all experts; each token keeps the
``num_experts_per_tok`` most probable experts and renormalizes their probabilities; the
output is the weighted sum of those experts' outputs, computed dropless.

Training adds two router terms (logged unweighted as ``moe/load_balancing_loss`` and
``moe/router_z_loss``): Switch Transformer's load-balancing loss as Hugging Face computes it
(``aux_loss``), weighted by ``router_aux_loss_coef``, and ST-MoE's router z-loss, which
Hugging Face's Mixtral does not have, weighted by ``router_z_loss_coef``.

Checkpoints use Hugging Face's names: ``block_sparse_moe.gate.weight`` for the router and
``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` per expert (w1 the gate projection, w3 the
up projection, w2 the down projection). In our own checkpoints the block is ``mlp``, as in
every family of the kit (checkpoints written before the kit named it ``block_sparse_moe``).
"""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from levanter_core.hf.mapping import HfKey
from levanter_core.layers import MIXTRAL_EXPERTS, DefaultRotaryConfig, MoeConfig, RotaryConfig
from levanter_core.models.decoder import DecoderConfig, DecoderLM, LayerType


class MixtralConfig(DecoderConfig):
    """The ``model:`` section for ``type: mixtral``. Defaults are Mixtral 8x7B's."""

    type: str = "mixtral"
    default_hf_checkpoint = "mistralai/Mixtral-8x7B-v0.1"

    hf_architecture = "MixtralForCausalLM"
    hf_model_type = "mixtral"
    hf_layer_names = {"mlp": "block_sparse_moe"}
    hf_keys = {
        **DecoderConfig.hf_keys,
        # kept as written: null and an explicit hidden_size // heads mean the same, and
        # exporting what was imported keeps config.json unchanged
        "head_dim": HfKey("head_dim", None),
        "layer_norm_epsilon": HfKey("rms_norm_eps", 1e-5),
        "num_local_experts": HfKey("num_local_experts", 8),
        "num_experts_per_tok": HfKey("num_experts_per_tok", 2),
        "router_aux_loss_coef": HfKey("router_aux_loss_coef", 0.001),
        "sliding_window": HfKey("sliding_window", None),
    }
    hf_refused = {"router_jitter_noise": (0, 0.0, None)}
    hf_rope_theta = 1e6

    seq_len: PositiveInt = 32768
    intermediate_dim: PositiveInt = 14336
    num_kv_heads: PositiveInt = 8
    rope: RotaryConfig = DefaultRotaryConfig(theta=1e6)

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

    sliding_window: PositiveInt | None = None
    """If set, every layer attends only to the ``sliding_window`` most recent tokens (itself
    included), as in Mistral; ``None`` attends to the whole sequence."""

    @model_validator(mode="after")
    def _check_experts(self):
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed "
                f"num_local_experts ({self.num_local_experts})"
            )
        return self

    @property
    def Experts(self):
        return self.moe_config().Experts

    def attention_types(self) -> tuple[LayerType, ...]:
        kind: LayerType = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_layers

    def moe_config(self) -> MoeConfig:
        return MoeConfig(
            Embed=self.Embed,
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_dim=self.intermediate_dim,
            activation=self.activation_function,
            layout=MIXTRAL_EXPERTS,
            initializer_range=self.initializer_range,
        )

    def router_loss_weights(self) -> tuple[float, float]:
        return self.router_aux_loss_coef, self.router_z_loss_coef


MixtralLMHeadModel = DecoderLM
"""A Mixtral model is the kit's :class:`~levanter_core.models.decoder.DecoderLM` (the name is kept)."""
