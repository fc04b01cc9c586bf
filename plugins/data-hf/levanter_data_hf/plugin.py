"""Entry point of the Hugging Face datasets plugin (see ``pyproject.toml``): registers
``type: hf``, which a ``data:`` section with an ``id`` field selects without naming it.

The source is registered by import path and imports ``datasets`` only when a
dataset is loaded, so loading the plugin (which every ``levanter`` command does) stays cheap.
"""

from levanter_core.plugins import hookimpl


@hookimpl
def register_data_sources(register):
    register("hf", "levanter_data_hf.source:HfSourceConfig")
