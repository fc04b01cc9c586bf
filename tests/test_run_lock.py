"""One trainer per run: a second trainer on a run that is being trained stops with exit status 2
naming the holder; the lock of a trainer that was killed is taken over; a lock in a bucket
works the same way, with heartbeats for holders on other hosts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time

import pytest
from test_resume import command

from conftest import REPO, code_docs, run_config, write_jsonl
from levanter_core import fileio
from levanter_core.checkpoint.lock import RunInUseError, RunLock


def lock_files(directory) -> list[str]:
    return sorted(name for name in fileio.list_names(str(directory)) if name.startswith("LOCK."))


def test_a_second_trainer_on_a_running_run_exits_2_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(200))], "cache_dir": str(tmp_path / "cache")}
    config = run_config(tmp_path, data, run_id="locked", steps=100000, steps_per_eval=100000)
    checkpoints = tmp_path / "ckpt" / "locked"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen(command(["train", config, "--no-progress"]), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        metrics, deadline = tmp_path / "logs" / "locked" / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text()):  # training
            assert first.poll() is None and time.monotonic() < deadline, "the first trainer never trained"
            time.sleep(0.2)

        second = subprocess.run(command(["train", config, "--no-progress", "--trainer.num_train_steps", "2"]),
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"process {first.pid} on host {socket.gethostname()}" in second.stderr
        assert "another trainer is running this run" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None  # the first one trains on
    finally:
        first.kill()
        first.wait()

    # killed with SIGKILL: its lock is left behind, and the same command takes it over at once
    assert len(lock_files(checkpoints)) == 1
    again = subprocess.run(command(["train", config, "--no-progress", "--trainer.num_train_steps", "2"]),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "taking over the run's lock" in again.stdout and f"process {first.pid} is no longer running" in again.stdout
    assert lock_files(checkpoints) == []  # released when the run ended


# -- the lock itself, in a bucket ---------------------------------------------------------------


def plant_lock(directory: str, generation: int, **record) -> str:
    path = f"{directory}/LOCK.{generation}"
    fileio.write_text(path, json.dumps({"started": "2026-11-27T10:00:00+00:00", "token": "elsewhere", **record}))
    return path


def test_a_lock_in_a_bucket_held_on_another_host_refuses_until_its_heartbeat_is_stale(bucket, capsys):
    directory = f"{bucket}/ckpt/run"
    plant_lock(directory, 3, host="node-7", pid=4242, heartbeat=time.time() - 20)

    with pytest.raises(RunInUseError) as refused:
        RunLock(directory, stale_seconds=300).acquire()
    message = str(refused.value)
    assert "process 4242 on host node-7" in message and f"{directory}/LOCK.3" in message
    assert re.search(r"last heartbeat 2\d s ago", message) and "taken over once its heartbeat is 300 s old" in message

    # the same lock, seen by a trainer that allows only 10 s of silence: stale, taken over
    with RunLock(directory, stale_seconds=10) as lock:
        assert lock_files(directory) == ["LOCK.4"] and lock.path == f"{directory}/LOCK.4"
        held = json.loads(fileio.read_bytes(lock.path))
        assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
        with pytest.raises(RunInUseError, match=f"process {os.getpid()} on host {socket.gethostname()}"):
            RunLock(directory).acquire()
    assert "taking over the run's lock" in capsys.readouterr().out
    assert lock_files(directory) == []


def test_a_lock_in_a_bucket_from_a_dead_process_on_this_host_is_taken_over_at_once(bucket):
    directory = f"{bucket}/ckpt/run"
    dead = subprocess.Popen(["true"])
    dead.wait()
    plant_lock(directory, 0, host=socket.gethostname(), pid=dead.pid, heartbeat=time.time())
    with RunLock(directory):
        assert lock_files(directory) == ["LOCK.1"]


def test_of_trainers_taking_a_stale_lock_at_once_exactly_one_wins(bucket):
    directory = f"{bucket}/ckpt/run"
    plant_lock(directory, 0, host="node-7", pid=1, heartbeat=time.time() - 3600)
    locks = [RunLock(directory, heartbeat_seconds=3600) for _ in range(4)]
    outcomes: list[str] = []
    start = threading.Barrier(len(locks))

    def take(lock: RunLock) -> None:
        start.wait()
        try:
            lock.acquire()
            outcomes.append("held")
        except RunInUseError:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["held", "refused", "refused", "refused"]
    assert lock_files(directory) == ["LOCK.1"]
    for lock in locks:
        lock.release()
    assert lock_files(directory) == []
