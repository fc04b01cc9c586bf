"""Mixtral for levanter-core."""
