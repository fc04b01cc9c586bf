"""Kill and resume: a run killed with SIGKILL at random moments, some of them in the middle
of a checkpoint write, and started again with the same command until it finishes, trains
exactly as the uninterrupted run does; and a run resumes on another number of devices.

Both tests compare with one uninterrupted run (a module fixture), so it is trained once."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorstore as ts

from conftest import REPO
from levanter_core.checkpoint import COMMIT_MARKER, METADATA_FILE
from levanter_core.testing import logged, simulated_devices

CONFIG = os.path.join(REPO, "config", "gpt2_nano.yaml")
STEPS = 40
KILL_SEED = 4
STAGING = re.compile(r"^step-(\d+)\.tmp-")
COMMITTED = re.compile(r"^step-(\d+)$")
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)$")


def train_args(workdir, run_id: str, *, steps: int = STEPS, keep_every: int = 4) -> list[str]:
    """``levanter train`` on a small GPT-2 (about 0.8M parameters, batches of 4 x 64 tokens)
    with frequent checkpoints: permanent every ``keep_every`` steps, temporary every second.
    The data and compilation caches are shared by every run under ``workdir``, so restarts
    are quick."""
    return [
        "train", CONFIG, "--no-progress",
        "--model.seq_len", "64",
        "--trainer.id", run_id,
        "--trainer.train_batch_size", "4",
        "--trainer.num_train_steps", str(steps),
        "--trainer.steps_per_eval", "1000",
        "--trainer.max_eval_batches", "1",
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "ckpt"),
        "--trainer.checkpointer.keep", f"[{{every: {keep_every}}}]",
        "--trainer.checkpointer.save_interval", "1s",
        "--trainer.jax_compilation_cache_dir", os.path.join(workdir, "jax-cache"),
        "--data.cache_dir", os.path.join(workdir, "data-cache"),
        "--data.max_files", "20",
    ]  # fmt: skip


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "from levanter_core.cli import main; main()", *args]


def cpu_env(devices: int) -> dict:
    return {**os.environ, **simulated_devices(devices)}


def train(args: list[str], *, devices: int = 1) -> subprocess.CompletedProcess:
    """Run ``levanter train`` to the end; fail the test if it does not exit 0."""
    result = subprocess.run(command(args), cwd=REPO, env=cpu_env(devices), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def logged_losses(workdir, run_id: str) -> dict[int, float]:
    """``step -> train/loss`` from the run's metrics.jsonl as it is now (a last line cut
    short by a kill is ignored; a step logged twice fails)."""
    return logged(os.path.join(workdir, "logs", run_id), once=True, missing_ok=True)


def final_arrays(checkpoint: str) -> dict[str, np.ndarray]:
    """Every array a checkpoint holds, by name, read straight from its zarr files."""
    with open(os.path.join(checkpoint, METADATA_FILE)) as f:
        names = [leaf["name"] for leaf in json.load(f)["leaves"]]
    arrays = {}
    for name in names:
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(checkpoint, name)}}
        arrays[name] = ts.open(spec).result().read().result()
    return arrays


# -- one attempt at the run, killed or not ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kill:
    """When to SIGKILL an attempt. ``after_start``: that many seconds after it starts (mostly
    while it imports, loads and compiles). ``on_write``: the moment it begins writing a
    checkpoint of step ``target`` or later. ``after_commit``: ``delay`` seconds after it
    completes a checkpoint of step ``target`` or later."""

    kind: str
    target: int = 0
    delay: float = 0.0

    def __str__(self) -> str:
        if self.kind == "after_start":
            return f"{self.delay:.2f}s after start"
        if self.kind == "on_write":
            return f"when writing step >= {self.target}"
        return f"{self.delay * 1000:.0f}ms after committing step >= {self.target}"


def kill_plan(rng: random.Random) -> list[Kill]:
    """Five kills in random order: three inside checkpoint writes, one shortly after a
    checkpoint completes, one at a random time from start. Target steps grow from kill to
    kill and stay well before the end, so every kill lands before the run can finish."""
    targets = sorted(rng.sample(range(2, 29), 4))
    kinds = ["on_write"] * 3 + ["after_commit"]
    rng.shuffle(kinds)
    plan = [
        Kill(kind, target, rng.uniform(0.0, 0.15) if kind == "after_commit" else 0.0)
        for kind, target in zip(kinds, targets)
    ]
    plan.insert(rng.randrange(len(plan) + 1), Kill("after_start", delay=rng.uniform(0.2, 3.0)))
    return plan


@dataclasses.dataclass
class Attempt:
    kill: Kill | None
    returncode: int
    stdout: str
    stderr: str
    resumed: list[tuple[str, int, bool]]
    """Each ``resumed from PATH at step N`` printed, with whether PATH's marker existed then."""
    killed_inside_write: bool
    losses: dict[int, float]
    """What metrics.jsonl held once the attempt had ended (before the next one rewrites it)."""


def _watch_stdout(stream, lines: list[str], resumed: list) -> None:
    for line in stream:
        lines.append(line)
        match = RESUMED.match(line.strip())
        if match:
            path, step = match.group(1), int(match.group(2))
            resumed.append((path, step, os.path.isfile(os.path.join(path, COMMIT_MARKER))))


def attempt(args: list[str], workdir, run_id: str, kill: Kill | None, *, devices: int = 1) -> Attempt:
    """Start the run on ``devices`` simulated devices, SIGKILL it as ``kill`` says (None: let it
    finish), and report."""
    checkpoints = os.path.join(workdir, "ckpt", run_id)

    def listing() -> set[str]:
        return set(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else set()

    before = listing()
    stderr_path = os.path.join(workdir, f"stderr-{time.monotonic_ns()}.txt")
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            command(args), cwd=REPO, env=cpu_env(devices), stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    lines: list[str] = []
    resumed: list = []
    reader = threading.Thread(target=_watch_stdout, args=(proc.stdout, lines, resumed))
    reader.start()
    started = time.monotonic()
    kill_at = started + kill.delay if kill is not None and kill.kind == "after_start" else None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            assert now - started < 300, f"attempt ({kill}) still running after 300 s"
            if kill_at is None and kill is not None:
                new = listing() - before
                pattern = STAGING if kill.kind == "on_write" else COMMITTED
                if any((m := pattern.match(name)) and int(m.group(1)) >= kill.target for name in new):
                    kill_at = now + (kill.delay if kill.kind == "after_commit" else 0.0)
            if kill_at is not None and now >= kill_at:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A staging directory this attempt created and never renamed: it died inside that write.
    inside_write = any(STAGING.match(name) for name in listing() - before)
    reader.join()
    with open(stderr_path) as f:
        stderr_text = f.read()
    losses = logged_losses(workdir, run_id)
    return Attempt(kill, proc.returncode, "".join(lines), stderr_text, resumed, inside_write, losses)


def print_summary(killed: list[Attempt], resumed_steps: list[int]) -> None:
    """What the kills did, for ``pytest -s`` (the numbers the issue's closing note quotes)."""
    inside = sum(a.killed_inside_write for a in killed)
    print(f"\n{len(killed)} kills ({inside} inside checkpoint writes), resumed at steps {resumed_steps}")
    for a in killed:
        where = "inside a checkpoint write" if a.killed_inside_write else "outside writes"
        resumed = f"resumed at step {a.resumed[0][1]}" if a.resumed else "before any 'resumed from'"
        print(f"  killed {a.kill}, {where}, {resumed}; metrics.jsonl then ended at step {max(a.losses, default=0)}")


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """The run of ``train_args`` trained to the end without a kill, on one device: its working
    directory (the tests' runs share its data and compilation caches) and its losses."""
    workdir = str(tmp_path_factory.mktemp("resume"))
    train(train_args(workdir, "uninterrupted"))
    reference = logged_losses(workdir, "uninterrupted")
    assert sorted(reference) == list(range(1, STEPS + 1))
    return workdir, reference


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_the_uninterrupted_run_bit_for_bit(uninterrupted):
    workdir, reference = uninterrupted
    args = train_args(workdir, "killed")
    attempts = [attempt(args, workdir, "killed", kill) for kill in kill_plan(random.Random(KILL_SEED))]
    attempts.append(attempt(args, workdir, "killed", None))  # the same command once more, left to finish
    killed, final = attempts[:-1], attempts[-1]
    resumed_steps = [step for a in attempts for _, step, _ in a.resumed]
    print_summary(killed, resumed_steps)

    for a in killed:
        assert a.returncode == -signal.SIGKILL, f"attempt ({a.kill}) exited {a.returncode} first:\n{a.stderr[-4000:]}"
    for a in attempts:
        assert "Traceback" not in a.stderr, a.stderr[-4000:]
        assert "damaged" not in a.stdout, a.stdout
    assert final.returncode == 0 and f"done: step {STEPS}" in final.stdout, final.stderr[-4000:]
    assert sum(a.killed_inside_write for a in killed) >= 2
    assert sum(step > 0 for step in resumed_steps) >= 2

    # Every checkpoint resumed from was complete when it was loaded.
    for a in attempts:
        for path, step, marked in a.resumed:
            assert marked, f"resumed from {path}, which had no {COMMIT_MARKER} marker"
            assert path == os.path.join(workdir, "ckpt", "killed", f"step-{step}"), path

    # Every loss any attempt logged is the uninterrupted run's, to the last bit.
    for a in attempts:
        for step, loss in a.losses.items():
            assert loss == reference[step], f"step {step}: {loss!r} after resuming, {reference[step]!r} uninterrupted"
    assert sorted(final.losses) == list(range(1, STEPS + 1))

    expected = final_arrays(os.path.join(workdir, "ckpt", "uninterrupted", f"step-{STEPS}"))
    found = final_arrays(os.path.join(workdir, "ckpt", "killed", f"step-{STEPS}"))
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].dtype == array.dtype and found[name].shape == array.shape, name
        assert found[name].tobytes() == array.tobytes(), f"{name} differs from the uninterrupted run's"


@pytest.mark.slow
def test_resume_on_a_different_number_of_devices(uninterrupted):
    """A checkpoint written on one device (the uninterrupted run's permanent one of step 36)
    resumes on four and trains to the end, with the losses of the one-device run up to
    rounding. The last four steps show it as well as more would: a wrong sharding of the
    restored weights or optimizer state changes the very first loss."""
    workdir, reference = uninterrupted
    resume_at = STEPS - 4

    # The four-device run starts where the one-device run was after that step, as if it had
    # been stopped there and moved.
    moved = os.path.join(workdir, "ckpt", "four-devices")
    os.makedirs(moved)
    shutil.copytree(
        os.path.join(workdir, "ckpt", "uninterrupted", f"step-{resume_at}"), os.path.join(moved, f"step-{resume_at}")
    )
    result = train(train_args(workdir, "four-devices"), devices=4)

    assert f"resumed from {moved}/step-{resume_at} at step {resume_at}" in result.stdout
    assert f"done: step {STEPS}" in result.stdout
    losses = logged_losses(workdir, "four-devices")
    assert sorted(losses) == list(range(resume_at + 1, STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step
