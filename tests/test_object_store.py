"""Checkpoints, caches and multi-process runs in an S3 bucket: a real S3 API (moto's server,
started on 127.0.0.1 by these tests), reached by TensorStore and fsspec as a cloud bucket
would be.

What an object store changes: no directory can be renamed, so a checkpoint is written in place
and committed by its ``COMMITTED`` marker, written last; the cache's ledger is replaced by a
single put."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import test_resume
from test_resume import command, logged_losses

from conftest import REPO, bucket_objects, code_docs, run_cli, run_config, write_jsonl
from levanter_core import fileio
from levanter_core.checkpoint import (
    COMMIT_MARKER,
    TensorStoreCheckpointer,
    discover_latest,
    load_checkpoint,
    write_checkpoint,
)


def state(seed: float) -> dict:
    import jax.numpy as jnp

    return {"w": jnp.arange(24.0).reshape(4, 6) * seed, "b": jnp.full(5, seed)}


def shapes(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# -- the checkpointer on a bucket ---------------------------------------------------------------


def test_checkpoints_in_a_bucket_commit_by_marker_and_unfinished_ones_are_cleared(bucket):
    base = f"{bucket}/ckpt/run"
    checkpointer = TensorStoreCheckpointer(base, save_interval=None, keep=[])
    assert checkpointer.latest() is None
    write_checkpoint(state(1.0), f"{base}/step-2", step=2)
    write_checkpoint(state(2.0), f"{base}/step-4", step=4)
    assert sorted(bucket_objects(f"{base}/step-4"))[0] == COMMIT_MARKER
    assert discover_latest(base) == f"{base}/step-4"
    loaded = load_checkpoint(shapes(state(0.0)), base)
    np.testing.assert_array_equal(loaded["w"], state(2.0)["w"])

    # A save that died before its marker: the arrays of step 6 are there, the marker is not.
    write_checkpoint(state(3.0), f"{base}/step-6", step=6)
    fs, root = fileio.filesystem(f"{base}/step-6/{COMMIT_MARKER}")
    fs.rm_file(root)
    assert discover_latest(base) == f"{base}/step-4"  # never loaded
    assert load_checkpoint(shapes(state(0.0)), base)["b"][0] == 2.0

    # The next checkpointer on the path removes it; a new save of step 6 then writes it whole.
    checkpointer = TensorStoreCheckpointer(base, save_interval=None, keep=[])
    assert fileio.list_names(base) == ["step-2", "step-4"]
    checkpointer.save(state(5.0), 6, temporary=True)
    checkpointer.wait_until_finished()
    assert discover_latest(base) == f"{base}/step-6"
    assert load_checkpoint(shapes(state(0.0)), base)["b"][0] == 5.0
    assert checkpointer.is_temporary(f"{base}/step-6")
    checkpointer.mark_permanent(f"{base}/step-6")
    assert not checkpointer.is_temporary(f"{base}/step-6")

    # Deleting takes the marker first, then the rest.
    checkpointer.delete(f"{base}/step-2")
    assert fileio.list_names(base) == ["step-4", "step-6"]


def test_a_damaged_checkpoint_in_a_bucket_is_set_aside_and_the_previous_one_loads(bucket):
    base = f"{bucket}/ckpt/run"
    write_checkpoint(state(1.0), f"{base}/step-2", step=2)
    write_checkpoint(state(2.0), f"{base}/step-4", step=4)
    fs, root = fileio.filesystem(f"{base}/step-4/w/0.0")
    fs.rm_file(root)  # an array chunk lost
    checkpointer = TensorStoreCheckpointer(base, save_interval=None, keep=[])
    template = shapes(state(0.0))
    restored, path = checkpointer.resume(template)
    assert path == f"{base}/step-2" and restored["b"][0] == 1.0
    names = fileio.list_names(base)
    assert "step-4" not in names and any(n.startswith("step-4.damaged-") for n in names), names


def test_a_flipped_bit_in_a_chunk_in_the_bucket_is_damage_and_the_previous_checkpoint_loads(bucket, capsys):
    import jax

    base = f"{bucket}/ckpt/run"
    weights = {step: {"w": jax.random.normal(jax.random.key(step), (128, 16))} for step in (2, 4)}
    for step, tree in weights.items():
        write_checkpoint(tree, f"{base}/step-{step}", step=step)
    fs, chunk = fileio.filesystem(f"{base}/step-4/w/0.0")
    raw = bytearray(fs.cat_file(chunk))
    raw[len(raw) // 2] ^= 0x04  # in the stored bytes of one weight: zstd decompresses it without complaint
    fs.pipe_file(chunk, bytes(raw))

    checkpointer = TensorStoreCheckpointer(base, save_interval=None, keep=[])
    restored, path = checkpointer.resume(shapes(weights[2]))
    assert path == f"{base}/step-2"
    np.testing.assert_array_equal(restored["w"], weights[2]["w"])
    assert "w: chunk 0.0 reads with xxh3_64" in capsys.readouterr().out
    assert any(n.startswith("step-4.damaged-") for n in fileio.list_names(base))


def test_a_bucket_that_does_not_exist_is_a_clear_error(s3_server, monkeypatch):
    from levanter_core.errors import CheckpointError

    for name, value in s3_server.environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CheckpointError, match="cannot write checkpoints to s3://no-such-bucket/run"):
        TensorStoreCheckpointer("s3://no-such-bucket/run", save_interval=None, keep=[])


def test_missing_credentials_stop_the_run_at_config_load_naming_the_field(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env |= {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    args = ["train", os.path.join(REPO, "config", "gpt2_nano.yaml"), "--dry-run",
            "--trainer.checkpointer.base_path", "s3://some-bucket/ckpt"]  # fmt: skip
    result = subprocess.run(command(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "trainer.checkpointer.base_path (command line" in result.stderr
    assert "no AWS credentials were found" in result.stderr and "storage.s3.access_key_id" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_storage_section_sets_the_endpoint_and_credentials(tmp_path, s3_server, monkeypatch):
    """Nothing in the environment: the config's ``storage.s3`` says where the store is and how
    to sign in, and the saved config keeps the secret out. Then a run initialized from the
    checkpoint the first one left in the bucket."""
    for name in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    bucket = s3_server.create_bucket(f"test-{uuid.uuid4().hex[:12]}")
    env = s3_server.environment
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(40))], "cache_dir": str(tmp_path / "cache")}
    config = run_config(tmp_path, data, steps=2, checkpointer={"base_path": f"{bucket}/ckpt", "keep": []})
    with open(config, "a") as f:
        f.write(
            "storage:\n  s3:\n"
            f"    endpoint_url: {env['AWS_ENDPOINT_URL']}\n    region: us-east-1\n"
            f"    access_key_id: {env['AWS_ACCESS_KEY_ID']}\n    secret_access_key: {env['AWS_SECRET_ACCESS_KEY']}\n"
        )
    result = run_cli("train", config, "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert discover_latest(f"{bucket}/ckpt/pipe") == f"{bucket}/ckpt/pipe/step-2"
    saved = (tmp_path / "logs" / "pipe" / "config.yaml").read_text()
    assert env["AWS_SECRET_ACCESS_KEY"] not in saved and "secret_access_key: null" in saved

    # A new run starting from that checkpoint in the bucket (trainer.initialize_from).
    branch = run_cli("train", config, "--no-progress", "--trainer.id", "branch", "--trainer.num_train_steps", "3",
                     "--trainer.initialize_from", f"{bucket}/ckpt/pipe")  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-3000:]
    assert f"resumed from {bucket}/ckpt/pipe/step-2 at step 2" in branch.stdout, branch.stdout
    assert discover_latest(f"{bucket}/ckpt/branch") == f"{bucket}/ckpt/branch/step-3"


# -- kill -9 in the middle of saves to the bucket -------------------------------------------------


def train_args(workdir: str, checkpoints: str, run_id: str, steps: int) -> list[str]:
    """The small GPT-2 of tests/test_resume.py (a permanent checkpoint every 4 steps, a
    temporary one every second), its checkpoints in the bucket."""
    return [*test_resume.train_args(workdir, run_id, steps=steps), "--trainer.checkpointer.base_path", checkpoints]


def step_prefixes(checkpoints: str) -> tuple[set[int], set[int]]:
    """The steps of the ``step-N`` prefixes under ``checkpoints``: those with a marker, and those
    with objects but no marker (a save, or a deletion, under way or cut short)."""
    fs, root = fileio.filesystem(checkpoints)
    fs.invalidate_cache()
    found: dict[int, bool] = {}
    for path in fs.find(root):
        name, _, rest = path[len(root) + 1 :].partition("/")
        if name.startswith("step-") and name[5:].isdigit():
            step = int(name[5:])
            found[step] = found.get(step, False) or rest == COMMIT_MARKER
    return {s for s, marked in found.items() if marked}, {s for s, marked in found.items() if not marked}


class WatchedBucket(ThreadingHTTPServer):
    """A relay on 127.0.0.1 between a training process and the S3 server that passes every
    request on unchanged and, once it has stored the second object of a save of step
    ``min_step`` or later (a ``step-N/`` prefix under ``run_prefix``), SIGKILLs ``process``:
    a kill that lands inside a save on every attempt, however fast the save or slow the
    machine (watching the bucket from outside raced the small model's quick saves)."""

    daemon_threads = True

    def __init__(self, upstream: str, run_prefix: str, min_step: int):
        super().__init__(("127.0.0.1", 0), _Relay)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.pattern = re.compile(rf"/{re.escape(run_prefix)}/step-(\d+)/(.+)")
        self.min_step = min_step
        self.process: subprocess.Popen | None = None
        self.killed_in = ""
        self.stored: dict[int, int] = {}
        self.lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the killed run's connections break mid-reply
            super().handle_error(request, client_address)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stored_object(self, path: str) -> None:
        match = self.pattern.match(urllib.parse.urlsplit(path).path)
        if not match or int(match[1]) < self.min_step or match[2] == COMMIT_MARKER:
            return
        with self.lock:
            step = int(match[1])
            self.stored[step] = self.stored.get(step, 0) + 1
            if self.stored[step] == 2 and not self.killed_in and self.process is not None:
                self.process.send_signal(signal.SIGKILL)
                self.killed_in = f"step-{step}"


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: WatchedBucket

    def relay(self) -> None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=120)
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in ("expect", "transfer-encoding", "content-length", "connection"):
                upstream.putheader(name, value)
        upstream.putheader("Content-Length", str(len(body)))
        upstream.endheaders(body)
        response = upstream.getresponse()
        data = response.read()
        upstream.close()
        if self.command == "PUT" and response.status == 200:
            self.server.stored_object(self.path)
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(name, value)
        self.send_header(
            "Content-Length", response.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    def log_message(self, *args) -> None:
        pass


def run_killed_in_a_save(args: list[str], checkpoints: str, min_step: int) -> tuple[int, str, list[tuple[str, bool]]]:
    """Start the run, its S3 requests through a :class:`WatchedBucket` that SIGKILLs it inside
    the first save of step ``min_step`` or later. Returns the exit status, the save it was
    killed in (or "" when it ended first), and each checkpoint it said it resumed from, with
    whether that checkpoint's marker was there when it said so."""
    bucket_name, _, run_prefix = checkpoints.removeprefix("s3://").partition("/")
    relay = WatchedBucket(os.environ["AWS_ENDPOINT_URL"], f"{bucket_name}/{run_prefix}", min_step)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "AWS_ENDPOINT_URL": relay.endpoint}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    with relay.lock:
        relay.process = subprocess.Popen(
            command(args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
    proc = relay.process
    resumed: list[tuple[str, bool]] = []

    def watch():
        for line in proc.stdout:
            if line.startswith("resumed from "):
                path = line.split()[2]
                resumed.append((path, fileio.exists(f"{path}/{COMMIT_MARKER}")))

    reader = threading.Thread(target=watch)
    reader.start()
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join()
    relay.shutdown()
    relay.server_close()
    return proc.returncode, relay.killed_in, resumed


@pytest.mark.slow
def test_sigkill_during_saves_to_the_bucket_then_resume_matches_the_uninterrupted_run(bucket, tmp_path):
    steps = 24
    workdir = str(tmp_path)
    checkpoints = f"{bucket}/ckpt"
    done = subprocess.run(command(train_args(workdir, checkpoints, "whole", steps)), cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reference = logged_losses(workdir, "whole")
    assert sorted(reference) == list(range(1, steps + 1))

    args = train_args(workdir, checkpoints, "killed", steps)
    kills, resumed = [], []
    # Three kills, early, midway and late, each inside a save of a step after a permanent
    # checkpoint (every 4 steps; a save waits for the one before it to be committed): so each
    # later attempt resumes, past what the kill left unfinished. Every attempt is a new process
    # (imports, compilation), so a fourth kill of the same kind would add cost and nothing else.
    targets = [5, 10, 15]
    for target in targets:
        code, killed_in, said = run_killed_in_a_save(args, f"{checkpoints}/killed", target)
        assert code == -signal.SIGKILL, f"the attempt aiming at step {target} was not killed (exit {code})"
        kills.append(killed_in)
        resumed += said
    final = subprocess.run(command(args), cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert final.returncode == 0 and f"done: step {steps}" in final.stdout, final.stderr[-3000:]
    resumed += [(line.split()[2], True) for line in final.stdout.splitlines() if line.startswith("resumed from ")]
    print(f"\nkilled inside the saves of {kills}; resumed from {[path.rsplit('/', 1)[1] for path, _ in resumed]}")

    assert len(kills) == len(targets) and all(kills)
    assert len(resumed) >= 3
    for path, marked in resumed:
        assert marked, f"resumed from {path}, which had no {COMMIT_MARKER} marker"
    losses = logged_losses(workdir, "killed")
    assert sorted(losses) == list(range(1, steps + 1))
    for step, loss in losses.items():
        assert loss == reference[step], f"step {step}: {loss!r} after the kills, {reference[step]!r} uninterrupted"
    assert step_prefixes(f"{checkpoints}/killed")[1] == set()  # the last run cleared what the kills left
    final_state = f"{checkpoints}/killed/step-{steps}"
    whole_state = f"{checkpoints}/whole/step-{steps}"
    expected, found = load_checkpoint_raw(whole_state), load_checkpoint_raw(final_state)
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].tobytes() == array.tobytes(), f"{name} differs from the uninterrupted run's"


def load_checkpoint_raw(checkpoint: str) -> dict[str, np.ndarray]:
    """Every array of a checkpoint, by name, read straight from its zarr arrays."""
    import tensorstore as ts

    leaves = json.loads(fileio.read_bytes(f"{checkpoint}/metadata.json"))["leaves"]
    return {
        leaf["name"]: ts.open({"driver": "zarr", "kvstore": fileio.kvstore_spec(f"{checkpoint}/{leaf['name']}")})
        .result()
        .read()
        .result()
        for leaf in leaves
    }


# -- a cache built into the bucket, killed twice ------------------------------------------------


def ledger_in(url: str) -> dict | None:
    try:
        return json.loads(fileio.read_bytes(f"{url}/ledger.json"))
    except FileNotFoundError:
        return None


def cache_config(tmp_path, data_dir: str, cache_dir: str, run_id: str) -> str:
    """A tiny GPT-2 trained 4 steps on the corpus of ``data_dir``, its cache in ``cache_dir``."""
    # worker processes, even for this little data: the kills leave them orphaned, and they must stop
    options = {"batch_size": 100, "target_size_per_flush": "50KB", "in_process_below": 0}
    data = {"train_urls": [f"{data_dir}/part*.jsonl"], "cache_dir": cache_dir, "shuffle": False, "num_workers": 2,
            "cache_options": options}  # fmt: skip
    return run_config(tmp_path, data, run_id=run_id, steps=4)


@pytest.mark.slow
def test_a_cache_built_into_the_bucket_killed_twice_trains_exactly_as_one_built_whole(bucket, tmp_path):
    from test_cache import assert_same_cache, write_corpus

    shards, lines = 16, 2000
    data = str(tmp_path / "data")
    write_corpus(data, files=shards, lines=lines)
    remote = cache_config(tmp_path, data, f"{bucket}/cache", "remote")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def finished(ledger) -> int:
        return sum(s["finished"] for s in ledger["shards"]) if ledger else 0

    def mid_shard(ledger) -> bool:
        return bool(ledger) and any(0 < s["records"] < lines and not s["finished"] for s in ledger["shards"])

    kills = []
    points = [("3 shards finished", lambda ledger: finished(ledger) >= 3),
              ("a shard half done after 8 (or 10 finished)",
               lambda ledger: finished(ledger) >= 10 or (finished(ledger) >= 8 and mid_shard(ledger)))]  # fmt: skip
    for name, condition in points:
        stderr = open(tmp_path / f"cache-{len(kills)}.log", "w")
        process = subprocess.Popen(command(["cache", remote]), cwd=REPO, env=env, stdout=stderr, stderr=stderr)
        while process.poll() is None and not condition(ledger := ledger_in(f"{bucket}/cache/train")):
            time.sleep(0.02)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills.append((name, finished(ledger)))
        code = process.wait()
        assert code == -signal.SIGKILL, f"the build ended first ({code}):\n" + open(stderr.name).read()[-3000:]
        time.sleep(0.5)  # the orphaned workers notice that their coordinator is gone
    assert not ledger_in(f"{bucket}/cache/train")["complete"]

    last = subprocess.run(command(["cache", remote]), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr[-3000:]
    assert ledger_in(f"{bucket}/cache/train")["complete"]

    # The same cache, byte for byte, as one built locally without interruption, and the same training.
    # The local cache is built whole first: a run stops its background build when training ends,
    # which for these 4 steps can come before the last shard is tokenized.
    local = cache_config(tmp_path, data, str(tmp_path / "local-cache"), "local")
    built = subprocess.run(command(["cache", local]), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    for config in (local, remote):
        result = run_cli("train", config, "--no-progress")
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_cache(f"{bucket}/cache/train", tmp_path / "local-cache" / "train")
    losses = {run: logged_losses(str(tmp_path), run) for run in ("local", "remote")}
    assert sorted(losses["remote"]) == [1, 2, 3, 4] and losses["remote"] == losses["local"]
    print("kills:", kills)


# -- two processes sharing nothing but the bucket --------------------------------------------------


@pytest.mark.slow
def test_two_processes_sharing_only_the_bucket_train_like_one(bucket, tmp_path):
    """Each process has its own working directory (its logs, its compilation cache) and nothing
    else on disk in common with the other: data, cache and checkpoints are in the bucket."""
    from multiproc import CLI, cpu_env, distributed_args, free_port

    fs, root = fileio.filesystem(f"{bucket}/data")
    for i in range(4):
        fs.pipe_file(
            f"{root}/train-{i}.jsonl", "".join(json.dumps(d) + "\n" for d in code_docs(50, offset=50 * i)).encode()
        )
    data = {"train_urls": [f"{bucket}/data/train-*.jsonl"], "cache_dir": f"{bucket}/cache", "shuffle": False}

    def config_in(directory, run_id: str) -> str:
        directory.mkdir()
        path = run_config(directory, data, run_id=run_id, steps=6, train_batch_size=8, log_dir="logs",
                          checkpointer={"base_path": f"{bucket}/ckpt", "keep": [{"every": 3}]},
                          ray={"auto_start_cluster": False})  # fmt: skip
        return path

    one = config_in(tmp_path / "one", "one")
    result = subprocess.run([*CLI, "train", one, "--no-progress"], cwd=tmp_path / "one", env=cpu_env(),
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]

    port = free_port()
    procs = []
    for i in range(2):
        config = config_in(tmp_path / f"process-{i}", "two")
        log = open(tmp_path / f"process-{i}.log", "w")
        procs.append(subprocess.Popen([*CLI, "train", config, "--no-progress", *distributed_args(port, 2, i)],
                                      cwd=tmp_path / f"process-{i}", env=cpu_env(), stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [(tmp_path / f"process-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)

    def losses(directory, run_id):
        return logged_losses(str(directory), run_id)

    want, got = losses(tmp_path / "one", "one"), losses(tmp_path / "process-0", "two")
    assert sorted(got) == list(range(1, 7)) and not (tmp_path / "process-1" / "logs" / "two" / "metrics.jsonl").exists()
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    assert discover_latest(f"{bucket}/ckpt/two") == f"{bucket}/ckpt/two/step-6"
