"""The nano GPT-2 config (``make train``'s) trains, and logs its golden loss curve
(:mod:`levanter_core.testing.golden`)."""

from __future__ import annotations

from levanter_core.testing.model_family import NanoTrainingTests


class TestGpt2Nano(NanoTrainingTests):
    package = "levanter_model_gpt2"
    nano_configs = ("gpt2_nano.yaml",)
    golden_losses = "assets/losses"
