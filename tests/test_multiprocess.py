"""Several processes on this machine training one model through ``jax.distributed`` (CPU
collectives), started as a user starts them on a cluster: the same ``levanter train``
command in each process, with its process id, or under SLURM with none at all."""

import json
import os
import signal
import sys
import time

import pytest
from multiproc import CLI, Processes, cpu_env, distributed_args, free_port, train_together

from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.checkpoint import discover_latest
from levanter_core.testing import logged

pytestmark = pytest.mark.slow

STEPS = 10


def _data(tmp_path) -> dict:
    return {
        "train_urls": [write_jsonl(tmp_path / f"train-{i}.jsonl", code_docs(50, offset=50 * i)) for i in range(4)],
        "validation_urls": [write_jsonl(tmp_path / "validation.jsonl", code_docs(16, offset=500))],
        "tokenizer": "byte",
        "cache_dir": str(tmp_path / "cache"),
        "shuffle": False,
    }


def _config(tmp_path, run_id: str, steps: int, ray: bool = False) -> str:
    """A tiny GPT-2 run of batch 8 with a constant learning rate (so a run extended to more
    steps trains its first steps exactly as a shorter one), a permanent checkpoint every 2 steps.
    ``ray``: a multi-process run tokenizes on a Ray cluster it starts (the default); else
    process 0 tokenizes with local processes, which is quicker to start."""
    path = run_config(
        tmp_path,
        _data(tmp_path),
        run_id=run_id,
        steps=steps,
        train_batch_size=8,
        checkpointer={"base_path": str(tmp_path / "ckpt"), "keep": [{"every": 2}]},
        ray={} if ray else {"auto_start_cluster": False},
    )
    text = open(path).read().replace("warmup: 0", "warmup: 0\n  lr_schedule: constant")
    with open(path, "w") as f:
        f.write(text)
    return path


def _losses(tmp_path, run_id: str, key: str = "train/loss") -> dict[int, float]:
    """Step -> value; a step trained again after a resume keeps its last value."""
    return logged(tmp_path / "logs" / run_id, key)


def _assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run in one process with one device: its directory, train and eval losses."""
    tmp_path = tmp_path_factory.mktemp("one-process")
    with Processes([[*CLI, "train", _config(tmp_path, "one", STEPS), "--no-progress"]], [cpu_env()], tmp_path) as one:
        assert one.wait(300) == [0], one.outputs_text()
    return tmp_path, _losses(tmp_path, "one"), _losses(tmp_path, "one", "eval/loss")


def _slurm_job(command: list[str], tmp_path) -> Processes:
    """``command`` in the two tasks of ``srun -n 2``: nothing tells them their process ids but
    SLURM's environment."""
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2"}
    envs = [
        # Each task sees its one CPU device as local device 0, as a GPU task sees the GPU it is given.
        cpu_env(**slurm, SLURM_PROCID=str(i), SLURM_LOCALID="0", JAX_COORDINATOR_PORT=str(port))
        for i in range(2)
    ]
    return Processes([command, command], envs, tmp_path)


def test_two_processes_train_like_one_and_resume_together(tmp_path, reference):
    """Started with their process ids, two processes train 6 steps as one process does; then,
    started again as a SLURM job (``srun -n 2``, where JAX finds the processes from SLURM's
    environment), both resume from the checkpoint they wrote together and train on as one
    process would, without a Ray cluster since nothing is left to tokenize. One resume shows
    both: each start of two processes costs two imports of the framework, two compilations and,
    with Ray, a cluster."""
    _, train_losses, eval_losses = reference
    config = _config(tmp_path, "two", STEPS, ray=True)
    with train_together(config, tmp_path, overrides=["--trainer.num_train_steps", "6"]) as first:
        assert first.wait(300) == [0, 0], first.outputs_text()
        assert "run directory:" in first.output(0) and "run directory:" not in first.output(1)
        # Process 0 started a Ray cluster over both processes and tokenized the 4 training files on it.
        assert "tokenized 4 shards on 2 Ray nodes" in first.output(0), first.output(0)

    # One process logs: one line per step, the run record says two processes.
    logged = metrics(tmp_path, "two")
    assert [m["step"] for m in logged if "train/loss" in m] == list(range(1, 7))
    assert json.load(open(tmp_path / "logs" / "two" / "run.json"))["processes"] == 2
    _assert_close(_losses(tmp_path, "two"), train_losses, range(1, 7))
    _assert_close(_losses(tmp_path, "two", "eval/loss"), eval_losses, [0, 3, 6])
    assert os.path.basename(discover_latest(str(tmp_path / "ckpt" / "two"))) == "step-6"
    os.remove(tmp_path / "logs" / "two" / "run.json")  # the SLURM job writes its own

    # The same command as a SLURM job. The cache is built, so it starts no Ray cluster (the
    # config still asks for one: trainer.ray.auto_start_cluster is on).
    command = [*CLI, "train", config, "--no-progress"]
    with _slurm_job(command, tmp_path) as second:
        assert second.wait(300) == [0, 0], second.outputs_text()
        assert "jax.distributed (slurm): process 1 of 2" in second.output(1)
        assert "every cache is built: no Ray cluster is started" in second.output(0), second.output(0)
        assert "tokenizing on the Ray cluster" not in second.output(0)
        for i in (0, 1):
            assert "at step 6" in second.output(i), second.output(i)
    assert json.load(open(tmp_path / "logs" / "two" / "run.json"))["processes"] == 2
    _assert_close(_losses(tmp_path, "two"), train_losses, range(1, STEPS + 1))
    _assert_close(_losses(tmp_path, "two", "eval/loss"), eval_losses, [0, 3, 6, 9, 10])


def test_a_process_that_dies_stops_the_others_and_the_run_resumes(tmp_path, reference):
    _, train_losses, _ = reference
    long_run = _config(tmp_path, "dies", 2000)
    # Time-based saves too (odd steps, temporary): process 0's clock decides for both processes.
    every_second = ["--trainer.checkpointer.save_interval", "1s"]
    with train_together(long_run, tmp_path, overrides=every_second, heartbeat=5) as run:
        log = tmp_path / "logs" / "dies" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (log.exists() and sum(1 for line in open(log) if '"train/loss"' in line) >= 12):
            assert run.procs[0].poll() is None and time.monotonic() < deadline, run.outputs_text()
            time.sleep(0.05)
        run.procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = run.procs[0].wait(timeout=90)
        waited = time.monotonic() - killed_at
        survivor = run.output(0)
    assert code != 0 and waited < 60, (code, waited)
    assert "another task died" in survivor or "stopped sending heartbeats" in survivor, survivor[-3000:]

    # What was saved before the failure is intact, and both processes resume from it.
    latest = discover_latest(str(tmp_path / "ckpt" / "dies"))
    step = int(os.path.basename(latest).split("-")[1])
    assert step >= 10
    with train_together(long_run, tmp_path, overrides=["--trainer.num_train_steps", str(step + 2)]) as again:
        assert again.wait(300) == [0, 0], again.outputs_text()
        assert f"at step {step}" in again.output(1)
    assert max(_losses(tmp_path, "dies")) == step + 2
    _assert_close(_losses(tmp_path, "dies"), train_losses, range(1, STEPS + 1))


def test_processes_started_with_different_configs_are_refused(tmp_path):
    config = _config(tmp_path, "differ", 4)
    port = free_port()
    commands = [
        [*CLI, "train", config, "--no-progress", *distributed_args(port, 2, 0, heartbeat=5)],
        [*CLI, "train", config, "--no-progress", "--optimizer.learning_rate", "0.5", *distributed_args(port, 2, 1, 5)],
    ]
    with Processes(commands, [cpu_env(), cpu_env()], tmp_path) as run:
        assert run.wait(120) == [2, 2], run.outputs_text()
        assert "process 1 was started with a config that differs from process 0's" in run.output(0)
        assert "process 1 was started with a config that differs from process 0's" in run.output(1)


@pytest.mark.parametrize("model_axis_size", [1, 2])
def test_each_process_loads_only_its_rows_of_the_batch(tmp_path, model_axis_size):
    """Two processes with two devices each: data-parallel over four devices, or over two
    with tensor parallelism inside each process."""
    port = free_port()
    script = os.path.join(os.path.dirname(__file__), "batch_share.py")
    commands = [[sys.executable, script, str(port), str(i), str(model_axis_size)] for i in range(2)]
    with Processes(commands, [cpu_env(devices=2), cpu_env(devices=2)], tmp_path) as run:
        assert run.wait(120) == [0, 0], run.outputs_text()
        # the JSON line, wherever gloo's own messages (on stderr, same log) fall around it
        shares = [
            json.loads([line for line in run.output(i).splitlines() if line.startswith("{")][-1]) for i in range(2)
        ]
    assert [s["rows"] for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(s["whole"] for s in shares)
