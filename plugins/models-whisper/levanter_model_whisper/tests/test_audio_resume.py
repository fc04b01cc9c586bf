"""Kill and resume with speech: a cache of audio (``format: {type: audio}``) whose build is
killed with SIGKILL at several moments and then completed equals a build that was never
interrupted, array for array; and ``levanter train`` on a tiny Whisper, killed at several
moments (while its cache is tokenized, in its first steps, inside and just after checkpoint
writes) and started again until it finishes, logs the uninterrupted run's losses bit for bit
and ends with its weights byte for byte.

Every process a test starts leads its own process group, so that what it leaves behind when
it is killed (its cache's worker processes) can be found, waited for, and checked: nothing
may be written to a cache once the process building it is dead, or a resumed build would
race it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from levanter_core.testing import logged, simulated_devices

UTTERANCES = 240
"""Synthesized utterances (about two seconds each) shared by both tests."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A directory of FLAC files spoken by eSpeak NG (two voices in turn) with ``manifest.jsonl``."""
    from levanter_audio.sentences import random_sentences
    from levanter_audio.synth import make_speech_corpus

    directory = tmp_path_factory.mktemp("speech")
    sentences = random_sentences(UTTERANCES, seed=11)
    make_speech_corpus(directory, sentences, fmt="flac", voice=["en-us+Storm", "en-us+shelby"])
    return directory


def split_manifest(corpus: Path, prefix: str, shards: int) -> str:
    """The corpus's manifest cut into ``shards`` manifests of consecutive records beside it
    (``{prefix}00.jsonl``...: the cache's shards); returns their glob."""
    lines = (corpus / "manifest.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    per = len(lines) // shards
    for i in range(shards):
        (corpus / f"{prefix}{i:02d}.jsonl").write_text("".join(lines[i * per : (i + 1) * per]), encoding="utf-8")
    return str(corpus / f"{prefix}*.jsonl")


# -- processes and caches ---------------------------------------------------------------------


def group_members(pgid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes of process group ``pgid`` (a killed
    process's workers keep its group after their parent is gone)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if int(group) == pgid and state != "Z":
            members.append((int(entry), cmdline))
    return members


def is_worker(cmdline: str) -> bool:
    """A cache worker: a process of multiprocessing's spawn context."""
    return "spawn_main" in cmdline


def cache_files(path) -> dict[str, tuple[int, int]]:
    """``file -> (mtime_ns, size)`` of every stored array file of the cache at ``path``."""
    files = {}
    for root, _, names in os.walk(os.path.join(path, "shards")):
        for name in names:
            try:
                stat = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # a temporary renamed away meanwhile
                continue
            files[os.path.relpath(os.path.join(root, name), path)] = (stat.st_mtime_ns, stat.st_size)
    return files


def after_the_kill(pgid: int, caches: list[str]) -> list[str]:
    """Once the leader of group ``pgid`` is killed: wait for its other processes to end (up
    to 60 s; any left then are killed) and return what each of ``caches`` had written to it
    from half a second after the kill on (the margin lets a worker that was mid-write finish
    it and notice its coordinator is gone). A non-empty answer is a bug: a build resumed by
    then would write the same shards at the same time."""
    time.sleep(0.5)
    before = {cache: cache_files(cache) for cache in caches}
    deadline = time.monotonic() + 60
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    problems = []
    left = group_members(pgid)
    if left:
        problems.append(f"processes of the killed run still alive 60 s later: {left}")
        os.killpg(pgid, signal.SIGKILL)  # the group of a process this test started
    for cache, files in before.items():
        changed = sorted(name for name, stamp in cache_files(cache).items() if files.get(name) != stamp)
        if changed:
            problems.append(f"{cache}: written after the process building it was killed: {', '.join(changed[:6])}")
    return problems


def read_ledger(path) -> dict | None:
    try:
        with open(os.path.join(path, "ledger.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def stored(path) -> tuple[dict, dict[str, np.ndarray]]:
    """The ledger less its timestamp, and every array of every shard as stored (tokens,
    document offsets, the audio samples and their offsets), whole."""
    from levanter_core.data.cache import _storage

    storage = _storage(str(path))
    ledger = storage.read_ledger()
    ledger.pop("updated")
    arrays = {}
    for i in range(len(ledger["shards"])):
        for name in ("tokens", "offsets", "field.audio", "field.audio.offsets"):
            arrays[f"shard {i} {name}"] = storage.open_array(f"shards/{i:05d}/{name}").read().result()
    return ledger, arrays


# -- 1. a cache build killed and resumed ------------------------------------------------------

BUILD_SHARDS = 10
PER_SHARD = UTTERANCES // BUILD_SHARDS  # 24 utterances: a dozen stores (flushes) each

BUILD = """
import sys
from levanter_audio.format import AudioFormat
from levanter_core.data.cache import open_cache
from levanter_core.data.config import CacheOptions
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import load_tokenizer
source = UrlSourceConfig(train_urls=[sys.argv[1]], format=AudioFormat())
open_cache(sys.argv[2], source, "train", load_tokenizer("byte"), enforce_eos=True, skip_bad_data=False, num_workers=2,
           cache_options=CacheOptions(batch_size=2, target_size_per_flush="200KB", in_process_below=0), background=False)
"""


@dataclasses.dataclass
class BuildState:
    """What the killing loop sees of one attempt: the ledger on disk, the documents it
    counted when the attempt started, and for how long a worker process has existed."""

    ledger: dict | None
    documents_at_start: int
    workers_for: float | None

    @property
    def progressed(self) -> bool:
        return self.ledger is not None and self.ledger["num_documents"] > self.documents_at_start


def finished(ledger) -> int:
    return sum(s["finished"] for s in ledger["shards"]) if ledger else 0


def half_done(ledger) -> list[str]:
    """The shards the ledger counts partly: ``index (records/PER_SHARD)``."""
    if not ledger:
        return []
    return [
        f"{i} ({s['records']}/{PER_SHARD})"
        for i, s in enumerate(ledger["shards"])
        if 0 < s["records"] < PER_SHARD and not s["finished"]
    ]


# When to kill each attempt: one of each kind of moment (before any work, while the workers
# start, between shards) and twice inside a shard, the moment a resume is most likely to get
# wrong. Each attempt starts a process and its two workers (several CPU-seconds), so more
# kills between shards would show nothing these do not.
BUILD_KILLS = [
    ("the ledger first appears", lambda s: s.ledger is not None),
    # Before its workers have started serving: a worker that finds its coordinator already
    # gone must not tokenize anything.
    ("its workers are starting", lambda s: s.progressed or (s.workers_for or 0) >= 0.3),
    ("2 shards finished", lambda s: s.progressed and finished(s.ledger) >= 2),
    ("a shard half done", lambda s: s.progressed and bool(half_done(s.ledger))),
    ("a shard half done again", lambda s: s.progressed and finished(s.ledger) >= 5 and bool(half_done(s.ledger))),
]


@pytest.mark.slow
def test_an_audio_cache_build_killed_at_several_moments_resumes_to_the_same_cache(corpus, tmp_path):
    from levanter_audio.format import AudioFormat

    from levanter_core.data.cache import open_cache, read_cache
    from levanter_core.data.source import UrlSourceConfig
    from levanter_core.data.tokenizer import load_tokenizer

    started = time.monotonic()
    shards = split_manifest(corpus, "build-part", BUILD_SHARDS)
    cache = str(tmp_path / "killed")
    kills, problems, groups = [], [], []
    try:
        for name, condition in BUILD_KILLS:
            at_start = (read_ledger(cache) or {"num_documents": 0})["num_documents"]
            with open(tmp_path / "stderr.txt", "a") as stderr:
                process = subprocess.Popen(
                    [sys.executable, "-c", BUILD, shards, cache], stderr=stderr, start_new_session=True
                )
            groups.append(process.pid)
            first_worker = None
            while process.poll() is None:
                if first_worker is None and any(is_worker(c) for _, c in group_members(process.pid)):
                    first_worker = time.monotonic()
                workers_for = None if first_worker is None else time.monotonic() - first_worker
                if condition(BuildState(read_ledger(cache), at_start, workers_for)):
                    process.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.005)
            process.wait()
            if process.returncode == -signal.SIGKILL:
                ledger = read_ledger(cache)  # what the next attempt resumes from
                documents = ledger["num_documents"] if ledger else None
                kills.append((name, finished(ledger), documents, half_done(ledger)))
            problems += [f"killed at '{name}': {problem}" for problem in after_the_kill(process.pid, [cache])]
            if (read_ledger(cache) or {}).get("complete"):
                break
        last = subprocess.run([sys.executable, "-c", BUILD, shards, cache], capture_output=True, text=True, timeout=300)
        assert last.returncode == 0, last.stderr[-4000:]
    finally:
        for pgid in groups:
            if group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)

    # Built again without a kill, in this process, with one worker and the default batches
    # and flushes: none of them changes what is stored.
    source = UrlSourceConfig(train_urls=[shards], format=AudioFormat())
    whole = tmp_path / "whole"
    open_cache(str(whole), source, "train", load_tokenizer("byte"), enforce_eos=True, skip_bad_data=False,
               num_workers=1, background=False)  # fmt: skip
    seconds = time.monotonic() - started

    print(f"\n{len(kills)} kills of the audio cache build ({seconds:.1f}s in all):")
    for name, done, documents, partial in kills:
        print(f"  at '{name}': {done} shards finished, {documents} documents, half done: {partial or 'none'}")
    assert len(kills) >= len(BUILD_KILLS) - 1, f"too few kills landed: {kills}"
    assert any(partial for *_, partial in kills), f"no kill landed with a shard half done: {kills}"
    assert not problems, "\n".join(problems)

    ledger, arrays = stored(cache)
    expected_ledger, expected = stored(whole)
    assert ledger["complete"] and ledger["num_documents"] == UTTERANCES
    assert ledger == expected_ledger
    assert arrays.keys() == expected.keys()
    for key, array in expected.items():
        assert arrays[key].dtype == array.dtype and arrays[key].shape == array.shape, key
        assert arrays[key].tobytes() == array.tobytes(), f"{key} differs from the uninterrupted build's"

    # And the cache holds the speech: a few utterances read back as the manifest has them.
    import soundfile

    reader = read_cache(cache)
    offsets = reader.document_offsets()
    records = [json.loads(line) for line in (corpus / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    for document in (0, PER_SHARD - 1, 5 * PER_SHARD + 7, UTTERANCES - 1):
        samples, _ = soundfile.read(corpus / records[document]["audio"], dtype="float32")
        np.testing.assert_array_equal(reader.document_field("audio", [document])[0], samples)
        ids = reader.tokens(int(offsets[document]), int(offsets[document + 1]))
        assert bytes(ids[1:-1].tolist()).decode() == records[document]["text"] and ids[0] == ids[-1] == 256


# -- 2. training killed and resumed -----------------------------------------------------------

STEPS = 30
TRAIN_SHARDS = 8  # 30 utterances each; a run reads 4 x 30 = 120 of the 240, in stored order
STAGING = re.compile(r"^step-(\d+)\.tmp-")
COMMITTED = re.compile(r"^step-(\d+)$")
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)$")


def write_config(workdir: Path, shards: str) -> str:
    """A Whisper of about 60k parameters (width 32, one encoder and one decoder layer, 16 mel
    bins, a 2-second window: 32,000 samples per row) learning 48-byte transcripts, 4 utterances a
    step, with a checkpoint every second (permanent every 5 steps). Records are stored one at a
    time, so a run's first steps read the cache while it is being built."""
    import yaml

    config = {
        "data": {
            "train_urls": [shards], "tokenizer": "byte", "shuffle": False,
            "cache_options": {"batch_size": 1, "target_size_per_flush": "32KB"},
        },
        "model": {
            "type": "whisper", "seq_len": 48, "max_source_positions": 100, "num_mel_bins": 16, "d_model": 32,
            "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "decoder_layers": 1, "decoder_attention_heads": 2, "decoder_ffn_dim": 64,
        },
        "trainer": {
            "seed": 0, "mp": "p=f32", "train_batch_size": 4, "num_train_steps": STEPS, "steps_per_eval": 1000,
            "require_accelerator": False, "log_dir": str(workdir / "logs"), "tracker": {"type": "json"},
            "jax_compilation_cache_dir": str(workdir / "jax-cache"),
            "checkpointer": {"base_path": str(workdir / "ckpt"), "save_interval": "1s", "keep": [{"every": 5}]},
        },
        "optimizer": {"type": "adam", "learning_rate": 3e-3, "warmup": 0, "weight_decay": 0.0},
    }  # fmt: skip
    path = workdir / "whisper.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def train_command(config: str, run_id: str, data_cache: Path) -> list[str]:
    return [
        sys.executable, "-c", "from levanter_core.cli import main; main()", "train", config, "--no-progress",
        "--trainer.id", run_id, "--data.cache_dir", str(data_cache),
    ]  # fmt: skip


def cpu_env() -> dict:
    # every run compared here is started with it, so each may compile at the lowest level
    return {**os.environ, **simulated_devices(1, quick_compile=True)}


def logged_losses(workdir: Path, run_id: str) -> dict[int, float]:
    """``step -> train/loss`` in the run's metrics.jsonl now (a line cut short by a kill is
    ignored; a step logged twice fails)."""
    return logged(workdir / "logs" / run_id, once=True, missing_ok=True)


def final_arrays(checkpoint: Path) -> dict[str, np.ndarray]:
    """Every array a checkpoint holds, by name, read from its zarr files."""
    import tensorstore as ts

    from levanter_core.checkpoint import METADATA_FILE

    arrays = {}
    for leaf in json.loads((checkpoint / METADATA_FILE).read_text())["leaves"]:
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(checkpoint / leaf["name"])}}
        arrays[leaf["name"]] = ts.open(spec).result().read().result()
    return arrays


@dataclasses.dataclass(frozen=True)
class Kill:
    """When to SIGKILL a training attempt. ``cache``: as soon as its cache's ledger counts a
    document (the data is being tokenized, no step taken). ``step``: once it has logged step
    ``target``. ``on_write``: the moment it starts writing a checkpoint of step ``target`` or
    later. ``after_commit``: ``delay`` seconds after it completes one."""

    kind: str
    target: int = 0
    delay: float = 0.0

    def __str__(self) -> str:
        return {
            "cache": "as its cache counts a first document",
            "step": f"once step {self.target} is logged",
            "on_write": f"when writing step >= {self.target}",
            "after_commit": f"{self.delay * 1000:.0f}ms after committing step >= {self.target}",
        }[self.kind]


# One kill of each kind: every attempt starts Whisper afresh (imports, compilation, its cache's
# workers), the costliest part of the test, and a second kill of a kind shows nothing new.
TRAIN_KILLS = [
    Kill("cache"),
    Kill("step", 2),
    Kill("on_write", 8),
    Kill("after_commit", 14, 0.05),
]


@dataclasses.dataclass
class Attempt:
    kill: Kill | None
    returncode: int
    stdout: str
    stderr: str
    resumed: list[tuple[str, int, bool]]
    """Each ``resumed from PATH at step N`` printed, with whether PATH's marker existed then."""
    inside_write: bool
    losses: dict[int, float]
    """metrics.jsonl once the attempt had ended (before the next one rewrites it)."""
    cache_at_kill: dict | None
    """The run's cache ledger right after the kill."""
    problems: list[str]


def attempt(config: str, workdir: Path, run_id: str, data_cache: Path, kill: Kill | None) -> Attempt:
    """Start the run, SIGKILL it as ``kill`` says (None: let it finish), and report."""
    from levanter_core.checkpoint import COMMIT_MARKER

    checkpoints = workdir / "ckpt" / run_id

    def listing() -> set[str]:
        return set(os.listdir(checkpoints)) if checkpoints.is_dir() else set()

    before = listing()
    stderr_path = workdir / f"stderr-{time.monotonic_ns()}.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            train_command(config, run_id, data_cache), cwd=workdir, env=cpu_env(),
            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
        )  # fmt: skip
    lines: list[str] = []
    resumed: list = []

    def watch() -> None:
        for line in proc.stdout:
            lines.append(line)
            if match := RESUMED.match(line.strip()):
                path, step = match.group(1), int(match.group(2))
                resumed.append((path, step, os.path.isfile(os.path.join(path, COMMIT_MARKER))))

    reader = threading.Thread(target=watch)
    reader.start()
    started = time.monotonic()
    kill_at = None
    ledger_path = data_cache / "train"
    try:
        while proc.poll() is None:
            now = time.monotonic()
            assert now - started < 300, f"attempt ({kill}) still running after 300 s"
            if kill is not None and kill_at is None:
                if kill.kind == "cache":
                    ledger = read_ledger(ledger_path)
                    hit = ledger is not None and ledger["num_documents"] > 0
                elif kill.kind == "step":  # a step this attempt logged, not one kept from before
                    first = resumed[0][1] if resumed else 0
                    hit = max(logged_losses(workdir, run_id), default=0) >= max(kill.target, first + 1)
                else:
                    pattern = STAGING if kill.kind == "on_write" else COMMITTED
                    hit = any((m := pattern.match(n)) and int(m.group(1)) >= kill.target for n in listing() - before)
                if hit:
                    kill_at = now + kill.delay
            if kill_at is not None and now >= kill_at:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cache_at_kill = read_ledger(ledger_path) if proc.returncode == -signal.SIGKILL else None
    problems = [f"killed {kill}: {problem}" for problem in after_the_kill(proc.pid, [str(ledger_path)])]
    inside_write = any(STAGING.match(name) for name in listing() - before)
    reader.join()
    losses = logged_losses(workdir, run_id)
    return Attempt(
        kill, proc.returncode, "".join(lines), stderr_path.read_text(), resumed, inside_write, losses,
        cache_at_kill, problems,
    )  # fmt: skip


def same_documents(a: Path, b: Path) -> int:
    """Check that the caches at ``a`` and ``b`` hold the same first documents (as many as both
    have ready) to the last bit; returns how many were compared."""
    from levanter_core.data.cache import read_cache

    first, second = read_cache(str(a)), read_cache(str(b))
    n = min(first.num_documents, second.num_documents)
    offsets = first.document_offsets()[: n + 1]
    np.testing.assert_array_equal(offsets, second.document_offsets()[: n + 1])
    np.testing.assert_array_equal(first.tokens(0, int(offsets[-1])), second.tokens(0, int(offsets[-1])))
    for x, y in zip(first.document_field("audio", np.arange(n)), second.document_field("audio", np.arange(n))):
        assert x.tobytes() == y.tobytes()
    return n


@pytest.mark.slow
def test_audio_training_killed_at_several_moments_matches_the_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    started = time.monotonic()
    config = write_config(tmp_path, split_manifest(corpus, "train-part", TRAIN_SHARDS))
    reference = attempt(config, tmp_path, "uninterrupted", tmp_path / "data-cache-uninterrupted", None)
    assert reference.returncode == 0 and f"done: step {STEPS}" in reference.stdout, reference.stderr[-4000:]
    expected = logged_losses(tmp_path, "uninterrupted")
    assert sorted(expected) == list(range(1, STEPS + 1))
    reference_seconds = time.monotonic() - started

    cache = tmp_path / "data-cache"
    attempts = [attempt(config, tmp_path, "killed", cache, kill) for kill in TRAIN_KILLS]
    attempts.append(attempt(config, tmp_path, "killed", cache, None))  # the same command once more, to the end
    killed, final = attempts[:-1], attempts[-1]
    resumed_steps = [step for a in attempts for _, step, _ in a.resumed]

    print(f"\nuninterrupted run {reference_seconds:.1f}s; {len(killed)} kills, resumed at steps {resumed_steps}; "
          f"{time.monotonic() - started:.1f}s in all")  # fmt: skip
    for a in killed:
        where = "inside a checkpoint write" if a.inside_write else "outside checkpoint writes"
        ledger = a.cache_at_kill
        data = "no cache yet"
        if ledger is not None:
            state = "complete" if ledger["complete"] else "being built"
            data = f"cache {state} ({ledger['num_documents']} of {UTTERANCES} documents)"
        start = f"resumed at step {a.resumed[0][1]}" if a.resumed else "started afresh"
        print(f"  killed {a.kill}: {start}, {where}, {data}; last logged step {max(a.losses, default=0)}")

    for a in killed:
        assert a.returncode == -signal.SIGKILL, f"attempt ({a.kill}) exited {a.returncode} first:\n{a.stderr[-4000:]}"
    for a in attempts:
        assert "Traceback" not in a.stderr, a.stderr[-4000:]
        assert "damaged" not in a.stdout, a.stdout
    assert final.returncode == 0 and f"done: step {STEPS}" in final.stdout, final.stderr[-4000:]
    assert sum(step > 0 for step in resumed_steps) >= 2, resumed_steps
    assert any(a.cache_at_kill and not a.cache_at_kill["complete"] for a in killed), "no kill while the cache was built"
    assert any(1 <= max(a.losses, default=0) <= 5 for a in killed), "no kill in the first steps"
    assert any(a.inside_write for a in killed), "no kill landed inside a checkpoint write"
    problems = [p for a in attempts for p in a.problems]
    assert not problems, "\n".join(problems)
    for a in attempts:
        for path, _, marked in a.resumed:
            assert marked, f"resumed from {path}, which had no commit marker"

    # Every loss any attempt logged is the uninterrupted run's, to the last bit.
    for a in attempts:
        for step, loss in a.losses.items():
            assert loss == expected[step], f"step {step}: {loss!r} after resuming, {expected[step]!r} uninterrupted"
    assert sorted(final.losses) == list(range(1, STEPS + 1))

    want = final_arrays(tmp_path / "ckpt" / "uninterrupted" / f"step-{STEPS}")
    found = final_arrays(tmp_path / "ckpt" / "killed" / f"step-{STEPS}")
    assert sorted(found) == sorted(want)
    for name, array in want.items():
        assert found[name].dtype == array.dtype and found[name].shape == array.shape, name
        assert found[name].tobytes() == array.tobytes(), f"{name} differs from the uninterrupted run's"

    # The cache built across the kills holds what the uninterrupted run's holds.
    assert same_documents(cache / "train", tmp_path / "data-cache-uninterrupted" / "train") >= STEPS * 4
