"""Llama and Mistral for levanter-core."""
