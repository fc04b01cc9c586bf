"""What a plugin's command shares with the core's (``register_commands``): the help of the
arguments every model command takes, so that ``levanter sample`` and a plugin's
``levanter serve`` describe a SOURCE the same way.

Imports nothing heavy: ``levanter --help`` builds every command's help without JAX.
"""

from __future__ import annotations

SOURCE_HELP = (
    "One of our checkpoints (a step-N directory or a run's checkpoint directory), an import "
    "(`levanter import-hf`), or a Hugging Face model directory or hub name."
)
"""The help of a command's SOURCE argument: a model to load, as
:func:`levanter_core.models.source.load_model_source` reads it."""

SOURCE_HELP_WITH_CONFIG = SOURCE_HELP + " May be left out with --config."
""":data:`SOURCE_HELP`, for a command whose ``--config`` may name the model instead."""

__all__ = ["SOURCE_HELP", "SOURCE_HELP_WITH_CONFIG"]
