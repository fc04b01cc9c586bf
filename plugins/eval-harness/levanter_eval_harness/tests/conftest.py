"""The tiny model and tasks of ``tiny.py``, shared by the tests of a session, and a session
without network: the Hugging Face hub and datasets libraries are told they are offline, so a
test that reached for the network would fail rather than download."""

from __future__ import annotations

import pytest

from levanter_eval_harness.tests.tiny import make_tasks, make_tiny_model


@pytest.fixture(scope="session", autouse=True)
def offline():
    import datasets
    import huggingface_hub

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory) -> str:
    return make_tasks(str(tmp_path_factory.mktemp("tiny-tasks")))


@pytest.fixture(scope="session")
def loaded(model_dir):
    from levanter_core.models.source import load_model_source

    return load_model_source(model_dir)


@pytest.fixture(scope="session")
def manager(tasks_dir):
    """lm-eval's task manager over its tasks and ours: this process's one index for
    ``tasks_dir`` (``task_index.py``), which the command and the training evaluator reuse in
    tests that ask for ``shared_index`` (indexing takes 15 CPU-seconds)."""
    from levanter_eval_harness.tests.task_index import shared_task_manager

    return shared_task_manager(tasks_dir)
