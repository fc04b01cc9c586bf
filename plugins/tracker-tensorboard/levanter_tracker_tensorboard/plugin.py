"""Entry point of the TensorBoard plugin (see ``pyproject.toml``): registers ``type: tensorboard``.

The tracker module imports tensorboardX only when a run creates its writer, so loading
the plugin (which every ``levanter`` command does) stays cheap.
"""

from levanter_core.plugins import hookimpl


@hookimpl
def register_trackers(register):
    register("tensorboard", "levanter_tracker_tensorboard.tracker:TensorboardConfig")
