"""A Qwen 2 written the way docs/adding-an-architecture.md taught before the architecture kit."""
