"""The core's own plugin: built-in types are registered through the same hooks
as everybody else's, so nothing about them is special."""

from levanter_core.plugins.hookspecs import Register, hookimpl


@hookimpl
def register_optimizers(register: Register) -> None:
    register("adam", "levanter_core.optim.adam:AdamConfig")
    register("lion", "levanter_core.optim.lion:LionConfig")
    register("adopt", "levanter_core.optim.adopt:AdoptConfig")
    register("rmsprop", "levanter_core.optim.rmsprop:RMSPropConfig")
    register("cautious", "levanter_core.optim.cautious:CautiousConfig")
    register("schedule_free_adamw", "levanter_core.optim.schedule_free:ScheduleFreeAdamWConfig")


@hookimpl
def register_trackers(register: Register) -> None:
    register("json", "levanter_core.tracker.json_tracker:JsonTrackerConfig")
    register("noop", "levanter_core.tracker.base:NoopTrackerConfig")


@hookimpl
def register_objectives(register: Register) -> None:
    register("lm", "levanter_core.objective:LmObjective")


@hookimpl
def register_checkpointers(register: Register) -> None:
    register("tensorstore", "levanter_core.checkpoint.config:TensorStoreCheckpointerConfig")


@hookimpl
def register_data_sources(register: Register) -> None:
    register("url", "levanter_core.data.source:UrlSourceConfig")
    register("python_stdlib", "levanter_core.data.source:PythonStdlibSourceConfig")


@hookimpl
def register_data_formats(register: Register) -> None:
    register("text", "levanter_core.data.formats:TextFormat")
    register("chat", "levanter_core.data.formats:ChatFormat")
    register("supervised", "levanter_core.data.formats:SupervisedFormat")
