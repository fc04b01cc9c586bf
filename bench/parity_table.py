"""The Hugging Face parity of every decoder family: for one tiny random ``transformers`` model of
each (with the features that family has switched on), the largest difference of our logits from
``transformers``' after import and after export, with stacked and with unstacked layers.

    .venv/bin/python bench/parity_table.py [--out FILE.json]

Each family's own tests (in its plugin's package) check many more variants at <= 1e-4; this
prints one line per family and layer layout, as Markdown.
"""

from __future__ import annotations

import argparse
import json
import tempfile

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def families() -> dict:
    import transformers as t

    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    return {
        "gpt2": lambda: t.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4),
        "llama (llama3 rope, bias)": lambda: t.LlamaConfig(
            **TINY,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral (window 8)": lambda: t.MistralConfig(**TINY, sliding_window=8),
        "phi3 (fused, partial rotary, longrope)": lambda: t.Phi3Config(
            **TINY,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0, 1.1, 1.2, 1.3],
                "long_factor": [2.0, 2.5, 3.0, 3.5],
                "original_max_position_embeddings": 16,
            },
        ),
        "qwen (window from layer 1)": lambda: t.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
        "qwen3 (head norms)": lambda: t.Qwen3Config(**TINY, head_dim=32),
        "qwen3_moe (dense layer 2)": lambda: t.Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[2],
            norm_topk_prob=True,
        ),
        "gemma (mqa)": lambda: t.GemmaConfig(**{**TINY, "num_key_value_heads": 1}, head_dim=24),
        "gemma2 (soft caps, windows)": lambda: t.Gemma2Config(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "gemma3 (local rope)": lambda: t.Gemma3TextConfig(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        "olmo2 (post norms)": lambda: t.Olmo2Config(**TINY),
        "olmo3 (windows, yarn full layers)": lambda: t.Olmo3Config(
            **TINY,
            eos_token_id=2,
            pad_token_id=1,
            sliding_window=8,
            rope_parameters={"full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        ),
        "mixtral (top 2 of 4)": lambda: t.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        "gpt_oss (sinks, clamped experts)": lambda: t.GptOssConfig(
            **{**TINY, "intermediate_size": 48},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={**yarn, "truncate": False},
        ),
        "deepseek_v3 (latent attention, groups)": lambda: t.DeepseekV3Config(
            **{**TINY, "num_key_value_heads": 4},
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            bos_token_id=0,
            eos_token_id=1,
            rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    }


def main(argv: list[str] | None = None) -> None:
    from levanter_core.hf.parity import check_hf_parity

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    print("| family (features on) | layers | import max abs diff | export max abs diff |")
    print("|---|---|---|---|")
    for name, config in families().items():
        for scan in (True, False):
            with tempfile.TemporaryDirectory() as workdir:
                report = check_hf_parity(config(), workdir, scan_layers=scan)
            layout = "stacked" if scan else "unstacked"
            rows.append({"family": name, "layers": layout, "import": report.import_max_abs_diff,
                         "export": report.export_max_abs_diff})  # fmt: skip
            print(
                f"| {name} | {layout} | {report.import_max_abs_diff:.1e} | {report.export_max_abs_diff:.1e} |",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
