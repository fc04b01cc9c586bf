"""Generating text: key/value caches, sampling, and an engine that batches many requests
(``levanter sample``, ``levanter serve``, and samples logged during training)."""
