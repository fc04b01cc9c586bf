"""Gemma 1, 2 and 3 (text-only) for levanter-core."""
