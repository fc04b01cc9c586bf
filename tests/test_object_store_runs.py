"""Run directories and Hugging Face exports in an S3 bucket (moto's S3 server, started on
127.0.0.1 by these tests): ``trainer.log_dir``, ``hf_save_path`` and ``levanter export-hf``'s
CHECKPOINT and OUTPUT as ``s3://`` URLs.

The run directory is written in a local mirror and uploaded as the run goes
(levanter_core/trainer/run_sync.py); exports are written locally, then uploaded with their
safetensors index last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import REPO, code_docs, run_cli, run_config, write_jsonl
from conftest import bucket_objects as objects
from levanter_core import fileio
from levanter_core.trainer.run_sync import RunDirectory, RunDirectorySync, mirror_directory


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch) -> str:
    """A temporary directory of the test's own, where mirrors of run directories go."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return str(directory)


def download(url: str, local) -> str:
    """Copy every object under ``url`` into the local directory ``local``; returns it."""
    for relative, content in objects(url).items():
        target = os.path.join(local, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(content)
    return str(local)


def jsonl(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.decode().splitlines()]


# -- the run directory's mirror -------------------------------------------------------------------


def test_a_local_log_dir_is_used_as_it_is(tmp_path):
    directory = RunDirectory.open(str(tmp_path / "logs"), "run", leader=True)
    assert (directory.path, directory.location, directory.sync) == (str(tmp_path / "logs" / "run"),) * 2 + (None,)
    assert not directory.mirrored


def test_the_mirror_is_uploaded_as_it_changes_and_downloaded_by_the_next_attempt(bucket, own_tmpdir):
    directory = RunDirectory.open(f"{bucket}/logs/", "run", leader=True)
    assert directory.location == f"{bucket}/logs/run"
    assert directory.path == mirror_directory(f"{bucket}/logs", "run")
    assert directory.path.startswith(own_tmpdir)
    local = directory.path
    with open(os.path.join(local, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    os.makedirs(os.path.join(local, "viz"))
    with open(os.path.join(local, "viz", "step-1.html"), "w") as f:
        f.write("<p>1</p>")
    with open(os.path.join(local, "summary.json.partial"), "w") as f:  # a write in progress
        f.write("{")
    directory.flush()
    assert objects(directory.location) == {"metrics.jsonl": b'{"step": 1}\n', "viz/step-1.html": b"<p>1</p>"}

    with open(os.path.join(local, "metrics.jsonl"), "a") as f:
        f.write('{"step": 2}\n')
    os.remove(os.path.join(local, "viz", "step-1.html"))
    directory.close()
    assert objects(directory.location) == {"metrics.jsonl": b'{"step": 1}\n{"step": 2}\n'}

    # Another attempt, on this machine (a stale file in the mirror) or another (no mirror).
    with open(os.path.join(local, "stale.txt"), "w") as f:
        f.write("from an attempt whose files never reached the bucket")
    again = RunDirectory.open(f"{bucket}/logs", "run", leader=True)
    try:
        assert sorted(os.listdir(again.path)) == ["metrics.jsonl"]
        with open(os.path.join(again.path, "metrics.jsonl")) as f:
            assert f.read() == '{"step": 1}\n{"step": 2}\n'
    finally:
        again.close()
    assert objects(directory.location) == {"metrics.jsonl": b'{"step": 1}\n{"step": 2}\n'}


def test_changes_are_uploaded_in_the_background(bucket, tmp_path):
    sync = RunDirectorySync(str(tmp_path / "mirror"), f"{bucket}/logs/run", interval=0.2)
    sync.download()
    sync.start()
    try:
        (tmp_path / "mirror" / "metrics.jsonl").write_text('{"step": 1}\n')
        deadline = time.monotonic() + 30
        while objects(f"{bucket}/logs/run") != {"metrics.jsonl": b'{"step": 1}\n'}:
            assert time.monotonic() < deadline, "the background thread did not upload the change"
            time.sleep(0.1)
    finally:
        sync.close()


def test_a_run_directory_in_a_missing_bucket_stops_the_run_naming_the_field(bucket, own_tmpdir):
    from levanter_core.errors import ConfigError

    directory = RunDirectory.open("s3://no-such-bucket-here/logs", "run", leader=True)
    try:
        with open(os.path.join(directory.path, "config.yaml"), "w") as f:
            f.write("seed: 0\n")
        with pytest.raises(ConfigError, match=r"trainer\.log_dir: could not write the run directory s3://no-such"):
            directory.flush(required=True)
    finally:
        directory.close()


# -- training with trainer.log_dir in a bucket ----------------------------------------------------


def tiny_run(tmp_path, bucket: str, **trainer) -> str:
    data = {
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(200))],
        "validation_urls": [write_jsonl(tmp_path / "valid.jsonl", code_docs(20, offset=200))],
        "cache_dir": str(tmp_path / "cache"),
    }
    return run_config(tmp_path, data, run_id="remote", steps=6, log_dir=f"{bucket}/logs", **trainer)


def train(config: str, tmp_path, attempt: str, *args: str):
    """``levanter train``, with a temporary directory of its own (so a new, empty mirror: as a
    new machine would have)."""
    scratch = tmp_path / f"tmp-{attempt}"
    scratch.mkdir()
    result = run_cli("train", config, "--no-progress", *args, env={"TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def committed_steps(url: str) -> list[int]:
    """The steps of the complete checkpoints under ``url``."""
    from levanter_core.checkpoint import COMMIT_MARKER

    names = [n for n in fileio.list_names(url) if n.startswith("step-") and n[5:].isdigit()]
    return sorted(int(n[5:]) for n in names if fileio.exists(f"{url}/{n}/{COMMIT_MARKER}"))


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_has_stored_every_step_up_to_it_and_resumes(tmp_path, bucket):
    config = tiny_run(tmp_path, bucket, checkpointer={"base_path": f"{bucket}/ckpt", "keep": [{"every": 3}]})
    run_dir, checkpoints = f"{bucket}/logs/remote", f"{bucket}/ckpt/remote"
    scratch = tmp_path / "tmp-killed"
    scratch.mkdir()
    # Far more steps than it will be given time for: it is killed once a checkpoint is complete,
    # long before the periodic upload (every 30 s) or the last one.
    killed = subprocess.Popen(
        [sys.executable, "-c", "from levanter_core.cli import main; main()", "train", config, "--no-progress",
         "--trainer.num_train_steps", "100000"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(scratch)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not committed_steps(checkpoints):
            assert killed.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint was completed in 300 s"
            time.sleep(0.2)
    finally:
        killed.kill()
        killed.wait()
    saved = committed_steps(checkpoints)[-1]
    logged = [m["step"] for m in jsonl(objects(run_dir).get("metrics.jsonl", b"")) if "train/loss" in m]
    assert logged[:saved] == list(range(1, saved + 1)), "a step up to the checkpoint was not stored"

    # The same command on another machine (an empty mirror) resumes and logs each step once.
    steps = saved + 3
    again = train(config, tmp_path, "again", "--trainer.num_train_steps", str(steps))
    assert f"run directory: {run_dir}\n" in again.stdout
    assert f"at step {saved}" in again.stdout
    stored = objects(run_dir)
    assert {"config.yaml", "run.json", "requirements.txt", "summary.json"} <= stored.keys()
    assert json.loads(stored["summary.json"])["run_dir"] == run_dir
    records = jsonl(stored["metrics.jsonl"])
    assert [m["step"] for m in records if "train/loss" in m] == list(range(1, steps + 1))
    assert [m["step"] for m in records if "eval/loss" in m] == list(range(0, steps + 1, 3))


# -- Hugging Face exports to a bucket -------------------------------------------------------------


def test_export_hf_reads_a_checkpoint_in_a_bucket_and_uploads_the_export(tmp_path, bucket):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import jax
    from haliax import Axis
    from levanter_model_gpt2.gpt2 import Gpt2Config

    from levanter_core.checkpoint import write_checkpoint
    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.hf.parity import hf_logits, our_logits

    config, vocab = Gpt2Config(hidden_dim=32, num_heads=2, num_layers=2, seq_len=32), 257
    model = config.build(Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    checkpoint = f"{bucket}/imports/tiny/step-0"
    metadata = {"config": {"model": config.model_dump(mode="json"), "data": {"tokenizer": "byte"}}, "vocab_size": vocab}
    write_checkpoint({"model": model}, checkpoint, step=0, metadata=metadata)
    # An import keeps the tokenizer files it came with beside the weights: they travel to the export.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 77,
    }  # fmt: skip
    fileio.write_text(f"{checkpoint}/hf_tokenizer/tokenizer.json", load_tokenizer("byte").to_tokenizer_json())
    fileio.write_text(f"{checkpoint}/hf_tokenizer/tokenizer_config.json", json.dumps(tokenizer_config))

    output = f"{bucket}/exports/tiny"
    result = run_cli("export-hf", checkpoint, output, "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"exported {checkpoint} to {output}" in result.stdout
    stored = objects(output)
    shards = sorted(name for name in stored if name.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors.index.json" in stored
    assert json.loads(stored["tokenizer_config.json"]) == tokenizer_config

    local = download(output, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(local, attn_implementation="eager")
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 16))
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(model, tokens), atol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(local).model_max_length == 77


def test_an_upload_replaces_an_earlier_export_with_its_index_last(tmp_path, bucket, monkeypatch):
    from levanter_core.hf.checkpoint import INDEX_FILE, upload_hf_directory

    output = f"{bucket}/exports/again"
    fileio.write_text(f"{output}/{INDEX_FILE}", '{"weight_map": {"old": "model-00001-of-00009.safetensors"}}')
    for name, content in {"config.json": "{}", "model-00001-of-00001.safetensors": "w", INDEX_FILE: "{}"}.items():
        (tmp_path / name).write_text(content)
    fs, _ = fileio.filesystem(output)  # fsspec keeps one instance: the one the upload uses
    uploaded, index_when = [], []
    put_file = fs.put_file

    def recording_put_file(source, target, **kwargs):
        index_when.append(fs.exists(f"{target.rsplit('/', 1)[0]}/{INDEX_FILE}"))
        uploaded.append(os.path.basename(source))
        return put_file(source, target, **kwargs)

    monkeypatch.setattr(fs, "put_file", recording_put_file)
    upload_hf_directory(str(tmp_path), output)
    assert uploaded[-1] == INDEX_FILE and sorted(uploaded) == sorted(os.listdir(tmp_path))
    assert not any(index_when), "the earlier export's index was still there during the upload"
    assert objects(output)[INDEX_FILE] == b"{}"


@pytest.mark.slow
def test_exports_during_training_go_to_a_bucket(tmp_path, bucket):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from levanter_core.hf.bridge import load_checkpoint_model
    from levanter_core.hf.parity import hf_logits, our_logits

    config = tiny_run(tmp_path, bucket, checkpointer={"base_path": str(tmp_path / "ckpt"), "keep": []})
    result = train(config, tmp_path, "only", "--hf_save_path", f"{bucket}/hf", "--hf_save_steps", "3")
    exports = f"{bucket}/hf/remote"
    assert f"saved the model in Hugging Face form to {exports}/step-3\n" in result.stdout
    stored = objects(exports)
    for step in (3, 6):
        files = {name.split("/", 1)[1] for name in stored if name.startswith(f"step-{step}/")}
        assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= files, files

    local = download(f"{exports}/step-6", tmp_path / "step-6")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(local, attn_implementation="eager")
    trained = load_checkpoint_model(str(tmp_path / "ckpt" / "remote")).model
    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 16))
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(trained, tokens), atol=1e-4)


def test_import_hf_writes_its_checkpoint_into_a_bucket_and_export_hf_gives_the_model_back(tmp_path, bucket, capsys):
    """A Hugging Face model imported straight into the bucket, tokenizer files beside it, and
    exported from there: the same logits as the original."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from levanter_core.cli import main
    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.hf.parity import hf_logits

    source = str(tmp_path / "hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=257, n_embd=32, n_head=2, n_layer=2, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(source)
    with open(os.path.join(source, "tokenizer.json"), "w") as f:
        f.write(load_tokenizer("byte").to_tokenizer_json())

    imported = f"{bucket}/imports/tiny"
    result = run_cli("import-hf", source, imported)
    assert result.returncode == 0, result.stderr[-3000:]
    stored = objects(imported)
    assert "COMMITTED" in stored and "hf_tokenizer/tokenizer.json" in stored
    # A second import is refused before anything is loaded: in this process, as a process of
    # its own would cost an import of the framework for one message.
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        main(["import-hf", source, imported])
    assert again.value.code == 2 and "already holds a checkpoint" in capsys.readouterr().err

    exported = str(tmp_path / "exported")
    result = run_cli("export-hf", imported, exported)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(os.path.join(exported, "tokenizer.json"))
    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 16))
    original = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(original, tokens), atol=1e-5)
