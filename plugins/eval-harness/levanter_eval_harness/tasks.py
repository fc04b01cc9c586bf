"""Finding lm-eval's tasks: by name in its registry (and in ``--include-path`` directories of
task YAML), by YAML file, or as a Levanter ``task_spec`` entry (a dict with ``task`` and
overrides such as ``num_fewshot``; a ``task_alias`` renames the task, so that one task can run
twice with different settings, e.g. ``hellaswag`` 0-shot and 10-shot)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from typing import Any

from lm_eval.api.group import Group
from lm_eval.tasks import TaskManager

from levanter_core.errors import UserError

TaskSpec = str | dict[str, Any]


def task_manager(include_path: str | Sequence[str] | None = None):
    """lm-eval's ``TaskManager`` over its own tasks and those of ``include_path``."""
    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for path in paths:
        if not os.path.isdir(path):
            raise UserError(f"--include-path {path}: no such directory (it should hold task YAML files)")
    return TaskManager(include_path=paths or None)


def check_task_names(specs: Sequence[TaskSpec], manager) -> None:
    """Raise :class:`UserError` naming every task of ``specs`` that lm-eval does not know."""
    unknown = []
    for spec in specs:
        name = spec if isinstance(spec, str) else spec.get("task")
        if not isinstance(name, str) or not name:
            raise UserError(f"a task spec needs a task name ('task'), found {spec!r}")
        if name in manager.all_tasks or os.path.isfile(name) or manager.match_tasks([name]):
            continue
        if isinstance(spec, dict) and _inline(spec):
            continue  # a whole task definition, not a reference to a registered one
        unknown.append(name)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        raise UserError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: not in lm-eval's registry "
            f"({len(manager.all_tasks)} tasks, groups and tags; `lm-eval ls tasks` lists them), nor a task YAML "
            "file; for tasks of your own, give the directory of their YAML with --include-path"
        )


def _inline(spec: dict) -> bool:
    return bool({"dataset_path", "output_type", "doc_to_text"} & set(spec))


def load_tasks(specs: Sequence[TaskSpec], manager) -> list:
    """lm-eval ``Task`` and ``Group`` objects for ``specs`` (checked with
    :func:`check_task_names` first); a dict's ``task_alias`` renames its task (and, for a
    group, the group and its tasks) as Levanter does."""
    check_task_names(specs, manager)
    built = []
    seen: dict[str, TaskSpec] = {}
    for spec in specs:
        name = spec if isinstance(spec, str) else spec["task"]
        inline = isinstance(spec, dict) and _inline(spec)
        try:
            loaded = manager.load([spec if inline else name])
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"task {name!r} could not be loaded: {_why(e)}") from None
        if isinstance(spec, dict):
            _override(loaded["tasks"].values(), spec, inline)
        top = [g for g in loaded["groups"].values() if not _is_child(g, loaded["groups"].values())]
        items = top or list(loaded["tasks"].values())
        alias = spec.get("task_alias") if isinstance(spec, dict) else None
        if alias:
            for item in items:
                _rename(item, name, str(alias).replace(" ", "_"))
        for item in items:
            key = getattr(item, "task_name", None) or item.name
            if key in seen:
                raise UserError(
                    f"task {key!r} is asked for twice ({seen[key]!r} and {spec!r}); give one of them a "
                    "task_alias to run it with other settings"
                )
            seen[key] = spec
            built.append(item)
    return built


_NOT_TASK_SETTINGS = ("task", "task_alias", "additional_stop_strings")


def _override(tasks, spec: dict, inline: bool) -> None:
    """Apply a task spec's settings to the registered tasks it names (an inline definition has
    them already), and its ``additional_stop_strings`` to their generation settings."""
    for task in tasks:
        if not inline:
            for key, value in spec.items():
                if key not in _NOT_TASK_SETTINGS:
                    task.set_config(key=key, value=value)
        extra = spec.get("additional_stop_strings")
        if extra and task.get_config("output_type") == "generate_until":
            until = (task.get_config("generation_kwargs") or {}).get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            task.set_config(
                key="generation_kwargs", value={"until": until + [s for s in extra if s not in until]}, update=True
            )


def _is_child(group, groups) -> bool:
    return any(group in other.get_all_groups() for other in groups if other is not group)


def _rename(item, lm_eval_name: str, our_name: str) -> None:
    """Levanter's renaming: ``hellaswag`` with alias ``hellaswag_10shot`` becomes
    ``hellaswag_10shot``; a group's tasks keep their names with the alias's suffix
    (``mmlu`` aliased ``mmlu_1shot``: ``mmlu_anatomy_1shot``)."""
    if isinstance(item, Group):
        item.name = _renamed(item.name, lm_eval_name, our_name)
        config = getattr(item, "_config", None)  # a configured group reports the name it was given
        if config is not None:
            config.group = item.name
        for key in list(item.child_names):  # children are held under their names: re-add them
            child = item.pop(key)
            _rename(child, lm_eval_name, our_name)
            item.add(child)
    else:
        item.config.task = _renamed(item.config.task, lm_eval_name, our_name)


def _renamed(name: str, lm_eval_name: str, our_name: str) -> str:
    if name == lm_eval_name:
        return our_name
    if our_name.startswith(lm_eval_name):
        suffix = our_name[len(lm_eval_name) :]
        return name + suffix
    return f"{our_name}_{name}"


def _why(e: Exception) -> str:
    text = str(e) or type(e).__name__
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    if offline or any(w in text for w in ("Couldn't reach", "offline", "ConnectionError", "resolve")):
        return (
            f"{text}. Tasks by name read their data from the Hugging Face hub, or offline from the datasets "
            "cache (HF_DATASETS_CACHE, HF_HUB_CACHE): run once with network access to fill it, or point the "
            "task's YAML at local files (dataset_path: json, dataset_kwargs: {data_files: ...})"
        )
    return text
