"""Qwen 2 / 2.5 (``type: qwen``) and Qwen 3 (``type: qwen3``) for levanter-core."""
