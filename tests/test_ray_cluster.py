"""The processes of a run start (or join) a Ray cluster and tokenize on it: two processes on
this machine, each a Ray node, build the same cache as local workers do, and leave no Ray
process behind."""

import json
import os
import signal
import sys

import pytest
from multiproc import Processes, cpu_env, free_port
from test_cache import assert_same_cache, build, source, write_corpus

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "ray_cluster_proc.py")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def alive(pid: int, started: str) -> bool:
    """Whether the process that had ``pid`` at ``started`` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == started and fields[0] != "Z"


def run_two(tmp_path, *extra: str, timeout: float = 300) -> list[dict]:
    """``ray_cluster_proc.py`` in two processes of one run; their reports. Whatever they
    started and left running is killed, and the test fails."""
    port = free_port()
    outs = [str(tmp_path / f"report-{i}.json") for i in range(2)]
    commands = [
        [sys.executable, SCRIPT, str(port), str(i), str(tmp_path / "data"), str(tmp_path / "ray"), outs[i], *extra]
        for i in range(2)
    ]
    reports = []
    with Processes(commands, [cpu_env(), cpu_env()], tmp_path) as procs:
        try:
            codes = procs.wait(timeout)
        finally:
            for out in outs:
                if os.path.exists(out):
                    reports.append(json.loads(read(out)))
            left = [(pid, started) for r in reports for pid, started in r.get("started", []) if alive(pid, started)]
            for pid, _ in left:
                os.kill(pid, signal.SIGKILL)
        assert codes == [0, 0], procs.outputs_text()
        assert len(reports) == 2, procs.outputs_text()
        assert not left, f"Ray processes left running: {left}\n{procs.outputs_text()}"
    return reports


def test_two_processes_tokenize_on_their_own_cluster(tmp_path):
    write_corpus(tmp_path / "data", files=8, lines=300)
    leader, other = run_two(tmp_path)

    assert leader.get("error") is None and other.get("error") is None, (leader, other)
    assert leader["address"] == other["address"] and leader["address"].startswith("localhost:")
    assert leader["documents"] == 8 * 300
    # Both nodes, process 0's head and process 1's worker, tokenized some of the 8 shards.
    spread = leader["shards_by_node"]
    assert len(spread) == 2 and sum(spread.values()) == 8, spread
    # Each process had started a node (``ray start`` and the node's processes under it).
    assert len(leader["started"]) > 2 and len(other["started"]) > 2
    # The stopped head is forgotten: a later ``ray.init()`` on this machine does not try to join it.
    note = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    port = leader["address"].rsplit(":", 1)[1]
    assert not (os.path.exists(note) and read(note).strip().endswith(f":{port}"))

    build(tmp_path / "local", source(tmp_path / "data"), num_workers=2)
    assert_same_cache(tmp_path / "ray", tmp_path / "local")


def test_an_address_nothing_answers_at_fails_clearly(tmp_path):
    write_corpus(tmp_path / "data", files=1, lines=10)
    reports = run_two(tmp_path, f"127.0.0.1:{free_port()}", timeout=120)

    for report in reports:
        assert "trainer.ray.address: no Ray cluster answers at '127.0.0.1:" in report["error"]
        assert "started" not in report  # failed before starting anything


def test_a_node_that_cannot_start_is_an_error_with_its_output():
    from levanter_core.distributed.ray_cluster import RayNodeError, _start_node

    with pytest.raises(RayNodeError) as failure:
        _start_node("worker", ["--address=localhost:1", "--no-such-option"], dict(os.environ))
    message = str(failure.value)
    assert message.startswith("trainer.ray: the Ray worker node of process 0 could not start")
    assert "exited with status 2" in message and "No such option '--no-such-option'" in message
