"""The hooks a levanter plugin can implement.

A plugin is any module (usually named by an entry point in the ``levanter``
group) that defines functions decorated with :data:`hookimpl` whose names match
the specs below. An implementation may accept a subset of a spec's arguments.

The registration hooks all work the same way: they receive a ``register``
callback and call it once per type name they provide::

    from levanter_core.plugins import hookimpl

    @hookimpl
    def register_trackers(register):
        register("csv", CsvTrackerConfig)

``register(name, config_cls)`` takes the type name users write as ``type:`` in
their YAML and a pydantic config class (a subclass of the kind's base class,
e.g. :class:`levanter_core.tracker.TrackerConfig`), or the class's import path as a
string, ``"package.module:Class"``. The config class both validates the section and
builds the object (``build``/``init``/``create``, see each base class).

Prefer the string: it is imported only when a config names the type, so that
``levanter plugins`` and ``levanter --help`` stay fast however many plugins are
installed (a class object makes every command import its module, and JAX with it)::

    @hookimpl
    def register_models(register):
        register("qwen3", "levanter_model_qwen3.qwen3:Qwen3Config")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "levanter"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, type | str], None]
"""The ``register`` callback of the registration hooks: a type name and its config class (or the
class's ``"package.module:Class"`` import path)."""


@hookspec
def register_models(register: Register) -> None:
    """Register model types. ``register(name, cls)`` with ``cls`` a subclass of
    :class:`levanter_core.models.LmConfig`; ``type: name`` under ``model:`` selects it."""


@hookspec
def register_data_sources(register: Register) -> None:
    """Register data sources. ``cls`` subclasses
    :class:`levanter_core.data.DataSourceConfig`; selected by ``data.type``."""


@hookspec
def register_data_formats(register: Register) -> None:
    """Register data formats: how a source's records become documents of token ids (and
    arrays of the format's own, such as audio samples), and how documents become batch rows.
    ``cls`` subclasses :class:`levanter_core.data.formats.FormatConfig`; selected by each
    source's ``format.type`` (``text``, ``chat`` and ``supervised`` are built in)."""


@hookspec
def register_optimizers(register: Register) -> None:
    """Register optimizers. ``cls`` subclasses
    :class:`levanter_core.optim.OptimizerConfig`; selected by ``optimizer.type``."""


@hookspec
def register_trackers(register: Register) -> None:
    """Register trackers. ``cls`` subclasses
    :class:`levanter_core.tracker.TrackerConfig`; selected by ``trainer.tracker.type``
    (or each item's ``type`` when ``trainer.tracker`` is a list)."""


@hookspec
def register_checkpointers(register: Register) -> None:
    """Register checkpointers. ``cls`` subclasses
    :class:`levanter_core.checkpoint.CheckpointerConfig`; selected by
    ``trainer.checkpointer.type``."""


@hookspec
def register_evaluators(register: Register) -> None:
    """Register evaluations to run during training. ``cls`` subclasses
    :class:`levanter_core.trainer.evaluators.EvaluatorConfig`; selected by the ``type`` of each
    item of ``evaluators`` (``eval_harness`` is the one Levanter's ``eval_harness`` section uses)."""


@hookspec
def register_objectives(register: Register) -> None:
    """Register training objectives. ``cls`` subclasses :class:`levanter_core.objective.Objective`
    (what a batch holds, the loss, what evaluation sums); a model config selects one by name
    with its ``objective`` class attribute (``lm``, built in, for every language model)."""


@hookspec
def register_commands(app: Any) -> None:
    """Add sub-commands to the ``levanter`` CLI. ``app`` is the root
    :class:`typer.Typer`; use ``@app.command()`` on your functions."""


@hookspec(firstresult=True)
def model_type_for_hf_config(hf_config: dict[str, Any]) -> str | None:
    """Map a Hugging Face ``config.json`` (as a dict, with ``model_type`` and
    ``architectures``) to one of our registered model type names, or return
    ``None`` if this plugin does not handle it. A name this plugin registers means its own
    type; a qualified name (``DISTRIBUTION:NAME``) is accepted too. Every plugin is asked
    (:meth:`levanter_core.plugins.PluginManager.model_type_for_hf_config`): when two answer with
    different types, the import stops naming both, unless ``LEVANTER_PLUGINS_PREFER`` chooses."""


@hookspec
def step_callbacks(config: Any, context: Any) -> list[Any] | None:
    """Side work for every training run: return a list of
    :class:`levanter_core.trainer.callbacks.StepCallback` (each says when it is due and what it
    does between steps), or None. ``config`` is the run's validated config (a
    :class:`~levanter_core.config.train.TrainConfig`); ``context`` is an
    :class:`~levanter_core.trainer.evaluators.EvaluatorContext` (tokenizer, trainer, run
    directory, sequence length). Called once per run, before the first step; the callbacks run
    after the run's own evaluations and before its exports and checkpoints."""
