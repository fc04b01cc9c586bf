"""Tokenizers named by Hugging Face hub id (``data.tokenizer: gpt2``), read through the
Hugging Face cache. The cache is built here, in tmp_path, the way huggingface_hub lays it out,
or filled from a hub served on localhost; nothing reaches the network."""

import hashlib
import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
from tokenizers import Tokenizer as RustTokenizer

from conftest import code_docs, metrics, run_cli, run_config, write_jsonl
from levanter_core.data.tokenizer import check_tokenizer_available, load_tokenizer
from levanter_core.errors import DataError
from levanter_core.testing import train_bpe_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def tokenizer_files(tmp_path: Path) -> dict[str, bytes]:
    """A small byte-level BPE and the ``tokenizer_config.json`` a hub model has beside it."""
    texts = [d["text"] for d in code_docs(50)]
    path = train_bpe_tokenizer(texts, str(tmp_path / "tokenizer.json"), vocab_size=300, special_tokens=("<s>", "</s>"))
    config = {"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>", "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": Path(path).read_bytes(), "tokenizer_config.json": json.dumps(config).encode()}


def put_in_hub_cache(hub_cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Store ``files`` as model ``repo_id`` at branch ``main`` in the Hugging Face cache at
    ``hub_cache``: content in ``blobs/``, named by hash; ``snapshots/<commit>/`` of links to
    them; ``refs/main`` holding the commit. Returns the snapshot directory."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(b"".join(files.values())).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, with the hub offline (in this process)."""
    hub_cache = tmp_path / "hf" / "hub"
    hub_cache.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def hub_env(tmp_path: Path) -> dict:
    """The environment of an offline `levanter` subprocess whose Hugging Face cache is
    ``tmp_path/hf/hub`` (where ``offline_hub`` puts it)."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1"}


def tiny_run(tmp_path: Path, steps: int = 2) -> str:
    """A tiny GPT-2 run's config in tmp_path, with ``data.tokenizer: gpt2``."""
    data = {
        "type": "url",
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(200))],
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": "gpt2",
    }
    return run_config(tmp_path, data, run_id="hub-tok", steps=steps, steps_per_eval=100)


def test_a_hub_name_loads_from_the_cache_like_the_same_files_in_a_directory(tmp_path, offline_hub):
    files = tokenizer_files(tmp_path)
    snapshot = put_in_hub_cache(offline_hub, "gpt2", files)
    # The layout is huggingface_hub's own: its cache lookup finds the file.
    assert huggingface_hub.try_to_load_from_cache("gpt2", "tokenizer.json") == str(snapshot / "tokenizer.json")
    local = tmp_path / "local"
    local.mkdir()
    for name, content in files.items():
        (local / name).write_bytes(content)

    from_hub, from_dir = load_tokenizer("gpt2"), load_tokenizer(str(local))
    assert from_hub.name == "gpt2"
    assert from_hub.vocab_size == from_dir.vocab_size == 300
    assert from_hub.fingerprint == from_dir.fingerprint
    # tokenizer_config.json is read: the end-of-text and beginning tokens and the chat template.
    assert (from_hub.eos_token, from_hub.bos_token, from_hub.chat_template) == ("</s>", "<s>", CHAT_TEMPLATE)
    assert from_hub.eos_id == RustTokenizer.from_str(files["tokenizer.json"].decode()).token_to_id("</s>")
    text = "def f7(x):\n    return x * 7\n"
    ids = from_hub.encode_batch([text])[0]
    assert ids.tolist() == from_dir.encode_batch([text])[0].tolist()
    assert from_hub.decode(ids) == text


def test_an_org_name_loads_and_a_local_directory_of_that_name_comes_first(tmp_path, offline_hub, monkeypatch):
    files = tokenizer_files(tmp_path)
    put_in_hub_cache(offline_hub, "some-org/tiny-model", files)
    assert load_tokenizer("some-org/tiny-model").vocab_size == 300

    monkeypatch.chdir(tmp_path)
    (tmp_path / "some-org" / "tiny-model").mkdir(parents=True)
    (tmp_path / "some-org" / "tiny-model" / "tokenizer.json").write_bytes(files["tokenizer.json"])
    local = load_tokenizer("some-org/tiny-model")
    assert local.bos_token is None  # the local directory's: it has no tokenizer_config.json


def test_offline_without_a_cached_copy_says_what_to_do(offline_hub):
    with pytest.raises(DataError) as error:
        check_tokenizer_available("meta-llama/Llama-2-7b-hf")
    message = str(error.value)
    assert message.startswith("data.tokenizer: 'meta-llama/Llama-2-7b-hf'")
    assert "HF_HUB_OFFLINE is set" in message
    assert "hf download meta-llama/Llama-2-7b-hf tokenizer.json tokenizer_config.json" in message
    assert str(offline_hub) in message
    assert "local directory" in message


def test_a_cached_model_without_tokenizer_json_is_named(tmp_path, offline_hub):
    put_in_hub_cache(offline_hub, "gpt2", {"config.json": b"{}"})
    with pytest.raises(DataError, match=r"hub model 'gpt2' has no tokenizer.json .*hf download gpt2 tokenizer.json"):
        load_tokenizer("gpt2")


def test_a_missing_file_is_not_looked_up_on_the_hub(tmp_path, offline_hub):
    with pytest.raises(DataError, match="is neither 'byte', an existing tokenizer.json file"):
        load_tokenizer(str(tmp_path / "nowhere" / "tokenizer.json"))
    with pytest.raises(DataError, match="is neither"):
        load_tokenizer("tokenizer.json")


class LocalHub(BaseHTTPRequestHandler):
    """The part of the Hugging Face hub's HTTP API that ``snapshot_download`` uses, serving
    the files of one model (``MODEL``) at one commit; every other repository is not found."""

    MODEL = "gpt2"
    COMMIT = "0123456789abcdef0123456789abcdef01234567"
    files: dict[str, bytes] = {}
    requested: list[str] = []

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?")[0]
        self.requested.append(f"{self.command} {path}")
        listing = [
            {"type": "file", "path": name, "size": len(content), "oid": hashlib.sha1(content).hexdigest()}
            for name, content in self.files.items()
        ]
        resolve = f"/{self.MODEL}/resolve/{self.COMMIT}/"
        if path == f"/api/models/{self.MODEL}/revision/main":
            self._send(json.dumps({"id": self.MODEL, "sha": self.COMMIT}).encode())
        elif path == f"/api/models/{self.MODEL}/tree/{self.COMMIT}":
            self._send(json.dumps(listing).encode())
        elif path.startswith(resolve) and path[len(resolve) :] in self.files:
            content = self.files[path[len(resolve) :]]
            self._send(content, {"X-Repo-Commit": self.COMMIT, "ETag": f'"{hashlib.sha1(content).hexdigest()}"'})
        else:
            self._send(b"{}", {"X-Error-Code": "RepoNotFound"}, status=404)

    def _send(self, body: bytes, headers: dict | None = None, status: int = 200):
        self.send_response(status)
        headers = {"Content-Type": "application/json", **(headers or {}), "Content-Length": str(len(body))}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_hub(tmp_path):
    """A hub on localhost holding model ``gpt2``: its tokenizer files and weights. Yields the
    environment of a `levanter` subprocess that reaches it, with its cache in tmp_path."""
    LocalHub.files = {**tokenizer_files(tmp_path), "config.json": b"{}", "model.safetensors": b"\0" * 64}
    LocalHub.requested = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), LocalHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**hub_env(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
    yield env
    server.shutdown()
    server.server_close()


def test_a_reachable_hub_fills_the_cache_for_offline_runs(tmp_path, local_hub):
    config = tiny_run(tmp_path)
    online = run_cli("train", config, "--dry-run", env=local_hub)
    assert online.returncode == 0, online.stderr
    assert "tokenizer: gpt2" in online.stdout
    snapshot = tmp_path / "hf" / "hub" / "models--gpt2" / "snapshots" / LocalHub.COMMIT
    # Only the tokenizer's files are fetched, not the weights.
    assert sorted(os.listdir(snapshot)) == ["tokenizer.json", "tokenizer_config.json"]
    assert not any("model.safetensors" in r for r in LocalHub.requested)

    LocalHub.requested = []
    offline = run_cli("train", config, "--dry-run", env={**local_hub, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert LocalHub.requested == []

    unknown = run_cli("train", config, "--dry-run", "--data.tokenizer", "some-org/no-such-model", env=local_hub)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "the Hugging Face hub has no model 'some-org/no-such-model'" in unknown.stderr


def test_offline_without_a_cached_copy_exits_2_before_reading_data(tmp_path):
    config = tiny_run(tmp_path)
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    for extra in ([], ["--dry-run"]):
        result = run_cli("train", config, "--no-progress", *extra, env=hub_env(tmp_path))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("error: data.tokenizer: 'gpt2' is not a local path")
        assert "hf download gpt2 tokenizer.json tokenizer_config.json" in result.stderr
        assert not (tmp_path / "cache").exists()  # no data read
        assert not (tmp_path / "logs").exists()  # no run started
    assert os.listdir(tmp_path / "hf" / "hub") == []


@pytest.mark.slow
def test_train_offline_with_a_tokenizer_from_the_hub_cache(tmp_path):
    put_in_hub_cache(tmp_path / "hf" / "hub", "gpt2", tokenizer_files(tmp_path))
    config = tiny_run(tmp_path, steps=2)
    result = run_cli("train", config, "--no-progress", env=hub_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "done: step 2" in result.stdout
    losses = [m["train/loss"] for m in metrics(tmp_path, "hub-tok") if "train/loss" in m]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # The model's vocabulary is the tokenizer's, and the data ends each document with the
    # end-of-text token of its tokenizer_config.json.
    with open(tmp_path / "ckpt" / "hub-tok" / "step-2" / "metadata.json") as f:
        assert json.load(f)["metadata"]["vocab_size"] == 300
    with open(tmp_path / "cache" / "train" / "ledger.json") as f:
        ledger = json.load(f)
    assert ledger["tokenizer_name"] == "gpt2"
    assert ledger["identity"]["eos_id"] == RustTokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("</s>")


def test_an_export_carries_a_hub_tokenizers_files(tmp_path, offline_hub):
    import jax
    from haliax import Axis

    from levanter_core.config.base import validate_section
    from levanter_core.hf.bridge import write_hf_model

    files = tokenizer_files(tmp_path)
    put_in_hub_cache(offline_hub, "gpt2", files)
    config = validate_section(
        "model", {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1, "seq_len": 32}
    )
    Vocab = Axis("vocab", 300)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    out = tmp_path / "export"
    write_hf_model(model, config, Vocab, str(out), run_config={"data": {"tokenizer": "gpt2"}})
    # the snapshot's own files, tokenizer_config.json (eos, bos, chat template) included
    assert (out / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    exported = json.loads((out / "config.json").read_text())
    eos = RustTokenizer.from_str(files["tokenizer.json"].decode()).token_to_id("</s>")
    assert exported["eos_token_id"] == eos and exported["vocab_size"] == 300
