"""OLMo 2 for levanter-core."""
