"""The core's own plugin: built-in types are registered through the same hooks
as everybody else's, so nothing about them is special."""

from levanter_core.plugins.hookspecs import hookimpl


@hookimpl
def register_optimizers(register):
    from levanter_core.optim.adam import AdamConfig

    register("adam", AdamConfig)


@hookimpl
def register_trackers(register):
    from levanter_core.tracker.json_tracker import JsonTrackerConfig
    from levanter_core.tracker.base import NoopTrackerConfig

    register("json", JsonTrackerConfig)
    register("noop", NoopTrackerConfig)


@hookimpl
def register_checkpointers(register):
    from levanter_core.checkpoint.config import TensorStoreCheckpointerConfig

    register("tensorstore", TensorStoreCheckpointerConfig)


@hookimpl
def register_data_sources(register):
    from levanter_core.data.source import PythonStdlibSourceConfig, UrlSourceConfig

    register("url", UrlSourceConfig)
    register("python_stdlib", PythonStdlibSourceConfig)
