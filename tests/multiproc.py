"""Start the processes of one multi-process run on this machine (CPU collectives), as a user
would on a cluster: the same command in every process, with its process id."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import REPO
from levanter_core.testing import simulated_devices

CLI = [sys.executable, "-c", "from levanter_core.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def distributed_args(port: int, num_processes: int, process_id: int, heartbeat: int = 10) -> list[str]:
    """The ``trainer.distributed`` overrides of one process."""
    return [
        "--trainer.distributed.coordinator_address",
        f"localhost:{port}",
        "--trainer.distributed.num_processes",
        str(num_processes),
        "--trainer.distributed.process_id",
        str(process_id),
        "--trainer.distributed.heartbeat_timeout_seconds",
        str(heartbeat),
    ]


def cpu_env(devices: int = 1, **extra: str) -> dict:
    """This environment with ``devices`` simulated CPU devices for JAX."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, **simulated_devices(devices), **extra}


class Processes:
    """Child processes started together; whatever is still running on exit is killed."""

    def __init__(self, commands: list[list[str]], envs: list[dict], logs_dir):
        self.logs = [os.path.join(logs_dir, f"process-{i}-{time.monotonic_ns()}.log") for i in range(len(commands))]
        self.procs = []
        for command, env, log in zip(commands, envs, self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the processes did not finish within {timeout:.0f}s:\n{self.outputs_text()}"
            ) from None

    def output(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return f.read()

    def outputs_text(self) -> str:
        return "\n".join(f"--- process {i}:\n{self.output(i)[-4000:]}" for i in range(len(self.procs)))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def train_together(config: str, logs_dir, *, num_processes: int = 2, overrides: list[str] = (), heartbeat: int = 10):
    """``levanter train CONFIG`` in ``num_processes`` processes of one run (one CPU device each)."""
    port = free_port()
    commands = [
        [*CLI, "train", config, "--no-progress", *overrides, *distributed_args(port, num_processes, i, heartbeat)]
        for i in range(num_processes)
    ]
    return Processes(commands, [cpu_env() for _ in range(num_processes)], logs_dir)
