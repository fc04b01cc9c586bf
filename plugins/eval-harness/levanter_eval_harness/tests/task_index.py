"""One lm-eval task index per include path for the tests of a process (test_cli, test_training).

``levanter_eval_harness.tasks.task_manager`` builds lm-eval's ``TaskManager``, which indexes
every task YAML lm-eval ships (about 14,700 tasks, groups and tags): some 15 CPU-seconds on each
call, and the command and the training evaluator call it once per run. The index depends on
nothing but the include paths and the files under them, and nothing changes it once built (a
training run's evaluator, too, keeps one manager for all its evaluations), so the tests here
build it once per include path and process: :func:`shared_index` puts a memoizing wrapper in
place of ``task_manager`` where the command and the evaluator look it up. The first call for a
path is the real one; a path that is no directory is refused by the real one each time (it is
never remembered)."""

from __future__ import annotations

import os

import pytest

_built: dict[tuple[str, ...], object] = {}


def shared_task_manager(include_path=None):
    """``task_manager(include_path)``, built once per include path in this process."""
    from levanter_eval_harness.tasks import task_manager

    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    key = tuple(os.path.realpath(p) for p in paths)
    if key not in _built or not all(os.path.isdir(p) for p in paths):
        _built[key] = task_manager(include_path)  # the real one: refuses a path that is no directory
    return _built[key]


@pytest.fixture
def shared_index(monkeypatch):
    """The command (``harness.task_manager``) and the training evaluator (``training.task_manager``)
    reuse this process's index for an include path (see the module's docstring)."""
    from levanter_eval_harness import harness, training

    monkeypatch.setattr(harness, "task_manager", shared_task_manager)
    monkeypatch.setattr(training, "task_manager", shared_task_manager)
