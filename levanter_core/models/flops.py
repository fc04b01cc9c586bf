"""Model FLOPs per token, for throughput and MFU figures."""

from __future__ import annotations


def lm_flops_per_token(
    *,
    hidden_dim: int,
    intermediate_dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    vocab_size: int,
    glu: bool = True,
    experts_per_token: int = 1,
    num_experts: int = 0,
) -> float:
    """Training FLOPs per token (forward plus a backward costing twice as much) of a decoder
    with grouped-query attention and a (gated) MLP.

    Counts 2 FLOPs per multiply-add over the projections (q, k, v, o), the MLP (three
    matrices when gated, two otherwise; ``experts_per_token`` of them in a mixture of
    experts, plus the router), the LM head, and the attention scores and weighted sums
    over the full ``seq_len x seq_len`` map (as Megatron-LM and Levanter count it).
    Norms, softmax and embedding lookups are negligible and left out."""
    h, m = hidden_dim, intermediate_dim
    attn_proj = 2 * h * num_heads * head_dim + 2 * h * num_kv_heads * head_dim
    mlp = (3 if glu else 2) * h * m * experts_per_token + h * num_experts
    attention = 2 * seq_len * num_heads * head_dim  # q.k and weights.v, per token
    forward = 2 * (num_layers * (attn_proj + mlp + attention) + h * vocab_size)
    return 3.0 * forward
