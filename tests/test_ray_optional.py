"""Ray is optional (the core's ``ray`` extra). A multi-process run on hosts without it trains
without Ray, and says so; a config that asks for a Ray cluster stops before training with a
message saying what to install. Never an import traceback."""

import pytest
from blocked_imports import env_without
from multiproc import CLI, Processes, cpu_env, distributed_args, free_port

from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.distributed.ray_cluster import ray_installed, require_ray
from levanter_core.trainer.config import RayConfig

pytestmark = pytest.mark.slow


def _config(tmp_path, run_id: str, **ray) -> str:
    data = {
        "train_urls": [write_jsonl(tmp_path / f"train-{i}.jsonl", code_docs(30, offset=30 * i)) for i in range(2)],
        "tokenizer": "byte",
        "cache_dir": str(tmp_path / "cache"),
    }
    return run_config(tmp_path, data, run_id=run_id, steps=2, train_batch_size=4, steps_per_eval=100, ray=ray)


def _two_processes_without_ray(tmp_path, config: str) -> Processes:
    port = free_port()
    commands = [[*CLI, "train", config, "--no-progress", *distributed_args(port, 2, i)] for i in range(2)]
    envs = [env_without(["ray"], tmp_path, base=cpu_env()) for _ in range(2)]
    return Processes(commands, envs, tmp_path)


def test_two_processes_without_ray_train_and_say_that_process_0_tokenizes(tmp_path):
    config = _config(tmp_path, "no-ray")  # trainer.ray as default: start a cluster over the hosts
    with _two_processes_without_ray(tmp_path, config) as run:
        assert run.wait(300) == [0, 0], run.outputs_text()
        for i in (0, 1):
            assert "Traceback" not in run.output(i) and "No module named 'ray'" not in run.output(i), run.output(i)
        assert "Ray is not installed (pip install 'levanter-core[ray]')" in run.output(0), run.output(0)
        assert "process 0 tokenizes with local processes" in run.output(0)
    assert [m["step"] for m in metrics(tmp_path, "no-ray") if "train/loss" in m] == [1, 2]


def test_a_ray_address_without_ray_stops_before_training_naming_the_field(tmp_path):
    config = _config(tmp_path, "asks-for-ray", address="10.0.0.1:6379")
    with _two_processes_without_ray(tmp_path, config) as run:
        assert run.wait(300) == [2, 2], run.outputs_text()
        for i in (0, 1):
            out = run.output(i)
            assert "Traceback" not in out, out
            assert "trainer.ray.address is '10.0.0.1:6379', but Ray is not installed" in out, out
            assert "pip install 'levanter-core[ray]'" in out
    assert not (tmp_path / "logs" / "asks-for-ray" / "metrics.jsonl").exists()


def test_where_ray_is_installed_an_address_is_accepted():
    pytest.importorskip("ray")
    assert ray_installed()
    require_ray(RayConfig(address="local"))  # no error
    require_ray(RayConfig())
