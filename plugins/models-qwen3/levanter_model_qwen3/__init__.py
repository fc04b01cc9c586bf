"""Qwen 2 / 2.5 (``type: qwen``), Qwen 3 (``type: qwen3``) and Qwen3-MoE (``type: qwen3_moe``) for levanter-core."""
