"""GPT-2 for levanter-core."""
