"""Two processes (``jax.distributed`` over CPU collectives, started as a user starts them on a
cluster: the same command in each, with its process id): process 0 runs lm-eval and writes the
results, process 1 computes its half of every batch; the results are those of one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from levanter_core.cli import main

pytestmark = pytest.mark.slow  # two processes start JAX, compile and exchange every batch: ~1.5 min

LEVANTER = [sys.executable, "-c", "from levanter_core.cli import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _samples(out_dir, task: str) -> dict[int, dict]:
    (path,) = out_dir.glob(f"*/samples_{task}_*.jsonl")
    return {record["doc_id"]: record for record in map(json.loads, path.read_text().splitlines())}


def test_two_processes_give_the_results_of_one(model_dir, tasks_dir, tmp_path, capsys):
    # An import: a Hugging Face directory cannot be loaded straight onto several devices (see the README).
    imported = tmp_path / "imported"
    with pytest.raises(SystemExit) as done:
        main(["import-hf", model_dir, str(imported)])
    assert done.value.code == 0
    common = ["--tasks", "tiny_mc,tiny_gen", "--include-path", tasks_dir, "--limit", "4", "--log-samples",
              "--max-length", "64", "--bootstrap-iters", "0", "--batch-size", "4"]  # fmt: skip

    with pytest.raises(SystemExit) as done:
        main(["eval-harness", str(imported), *common, "--output-path", str(tmp_path / "one")])
    assert done.value.code == 0
    capsys.readouterr()

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # fmt: skip
    procs, logs = [], []
    for rank in range(2):
        log = open(tmp_path / f"process-{rank}.log", "w")
        logs.append(log)
        command = [*LEVANTER, "eval-harness", str(imported), *common, "--output-path", str(tmp_path / f"two-{rank}"),
                   "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(rank)]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    outputs = "\n".join((tmp_path / f"process-{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], outputs
    assert not (tmp_path / "two-1").exists()  # only process 0 writes

    one, two = tmp_path / "one", tmp_path / "two-0"
    for doc_id, sample in _samples(one, "tiny_mc").items():
        theirs = _samples(two, "tiny_mc")[doc_id]
        assert theirs["arguments"] == sample["arguments"]
        for (ll, greedy), (ll2, greedy2) in zip((r[0] for r in sample["resps"]), (r[0] for r in theirs["resps"])):
            assert abs(float(ll) - float(ll2)) <= 1e-5 and greedy == greedy2
    assert {d: s["resps"] for d, s in _samples(two, "tiny_gen").items()} == {
        d: s["resps"] for d, s in _samples(one, "tiny_gen").items()
    }
    results_one = json.loads(next(one.glob("*/results_*.json")).read_text())["results"]
    results_two = json.loads(next(two.glob("*/results_*.json")).read_text())["results"]
    assert results_two["tiny_mc"]["acc,none"] == results_one["tiny_mc"]["acc,none"]
    assert results_two["tiny_gen"] == results_one["tiny_gen"]
