"""Two processes (``jax.distributed`` over CPU collectives, started as a user starts them on a
cluster: the same command in each, with its process id): process 0 runs lm-eval and writes the
results, process 1 computes its half of every batch; the results are those of one process.

The one-process runs that the two-process ones are compared with run in this process, and reuse
its lm-eval task index (``task_index.py``: 15 CPU-seconds a build, which the command and the
training evaluator would otherwise each pay); each two-process run's process 0 builds its own,
as a user's would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from levanter_core.cli import main
from levanter_core.testing import simulated_devices
from levanter_eval_harness.tests.task_index import shared_index  # noqa: F401 (a fixture)

# two processes start JAX, compile and exchange every batch: ~1.5 min
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_index")]

LEVANTER = [sys.executable, "-c", "from levanter_core.cli import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _samples(out_dir, task: str) -> dict[int, dict]:
    (path,) = out_dir.glob(f"*/samples_{task}_*.jsonl")
    return {record["doc_id"]: record for record in map(json.loads, path.read_text().splitlines())}


def _run_together(tmp_path, commands: list[list[str]], timeout: float = 400) -> None:
    """Run one command per process (each given its process id already) until all exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(simulated_devices(1), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    procs, logs = [], []
    for rank, command in enumerate(commands):
        log = open(tmp_path / f"process-{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([*LEVANTER, *command], env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    outputs = "\n".join((tmp_path / f"process-{r}.log").read_text()[-3000:] for r in range(len(commands)))
    assert codes == [0] * len(commands), outputs


def test_two_processes_give_the_results_of_one(model_dir, tasks_dir, tmp_path, capsys):
    common = ["--tasks", "tiny_mc,tiny_gen", "--include-path", tasks_dir, "--limit", "4", "--log-samples",
              "--max-length", "64", "--bootstrap-iters", "0", "--batch-size", "4"]  # fmt: skip

    with pytest.raises(SystemExit) as done:
        main(["eval-harness", model_dir, *common, "--output-path", str(tmp_path / "one")])
    assert done.value.code == 0
    capsys.readouterr()

    port = _free_port()
    _run_together(tmp_path, [
        ["eval-harness", model_dir, *common, "--output-path", str(tmp_path / f"two-{rank}"),
         "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(rank)]
        for rank in range(2)
    ])  # fmt: skip
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


TRAIN = """
data:
  train_urls: [{data}]
  tokenizer: {model_dir}
  cache_dir: {cache}
model: {{type: llama, seq_len: 64, hidden_dim: 64, intermediate_dim: 128, num_layers: 2, num_heads: 4, num_kv_heads: 2}}
trainer:
  mp: p=f32
  train_batch_size: 4
  num_train_steps: 2
  steps_per_eval: 1000
  log_dir: {logs}
  tracker: {{type: json}}
  checkpointer: {{base_path: {ckpt}}}
  ray: {{auto_start_cluster: false}}
optimizer: {{learning_rate: 0.01}}
eval_harness:
  task_spec: [tiny_mc, tiny_ppl, tiny_gen]
  max_examples: 3
  include_path: {tasks_dir}
  generation_kwargs: {{max_gen_toks: 8}}
eval_harness_steps: 2
"""


def test_a_two_process_training_run_logs_the_harness_metrics_of_a_one_process_run(
    model_dir, tasks_dir, tmp_path, capsys
):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"the quick brown fox jumps over the lazy dog {i}"}) + "\n" for i in range(64))
    )
    config = tmp_path / "run.yaml"
    config.write_text(TRAIN.format(data=data, model_dir=model_dir, cache=tmp_path / "cache", logs=tmp_path / "logs",
                                   ckpt=tmp_path / "ckpt", tasks_dir=tasks_dir))  # fmt: skip
    with pytest.raises(SystemExit) as done:
        main(
            [
                "train",
                str(config),
                "--no-progress",
                "--trainer.id",
                "one",
                "--trainer.checkpointer.base_path",
                str(tmp_path / "ckpt1"),
            ]
        )
    assert done.value.code == 0
    capsys.readouterr()
    port = _free_port()
    _run_together(tmp_path, [
        ["train", str(config), "--no-progress", "--trainer.id", "two",
         "--trainer.distributed.coordinator_address", f"localhost:{port}",
         "--trainer.distributed.num_processes", "2", "--trainer.distributed.process_id", str(rank)]
        for rank in range(2)
    ])  # fmt: skip

    def harness_metrics(run_id):
        lines = (tmp_path / "logs" / run_id / "metrics.jsonl").read_text().splitlines()
        (last,) = [m for m in map(json.loads, lines) if m["step"] == 2]
        return {k: v for k, v in last.items() if k.startswith("lm_eval/")}

    one, two = harness_metrics("one"), harness_metrics("two")
    assert {"lm_eval/tiny_mc/acc", "lm_eval/tiny_ppl/byte_perplexity", "lm_eval/tiny_gen/exact_match"} <= set(one)
    assert set(two) == set(one)
    for name, value in one.items():
        assert two[name] == pytest.approx(value, rel=1e-5), name
