"""Entry point of the Hugging Face datasets plugin (see ``pyproject.toml``): registers
``type: hf``, which a ``data:`` section with an ``id`` field selects without naming it.

The source module is imported inside the hook; it imports ``datasets`` only when a
dataset is loaded, so loading the plugin (which every ``levanter`` command does) stays cheap.
"""

from levanter_core.plugins import hookimpl


@hookimpl
def register_data_sources(register):
    from levanter_data_hf.source import HfSourceConfig

    register("hf", HfSourceConfig)
