"""Entry point of the W&B plugin (see ``pyproject.toml``): registers ``type: wandb``.

wandb itself is imported only when a run opens its tracker, so loading the plugin (which
every ``levanter`` command does) stays cheap.
"""

from levanter_core.plugins import hookimpl


@hookimpl
def register_trackers(register):
    register("wandb", "levanter_tracker_wandb.tracker:WandbConfig")
