"""Helpers for testing plugins against the core (used by the plugins' own test suites).

- this module: tiny runs (``run_config``, ``train_briefly``), data and tokenizers for them,
  a plugin's discovery (``listed_plugin``), a local S3 server;
- :mod:`.tiny`: tiny model configs, ours (``tiny_model``) and Hugging Face's (``tiny_hf_config``);
- :mod:`.metrics`: what a run logged (``read_metrics``, ``logged``);
- :mod:`.model_family`: the tests every model family inherits (``ModelFamilyTests``), imported
  from there, since it needs pytest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from levanter_core.config.train import load_train_config
from levanter_core.hf.parity import random_hf_model
from levanter_core.run import run_training
from levanter_core.testing.metrics import logged, read_metrics
from levanter_core.testing.tiny import TINY_HF, tiny_hf_config, tiny_model
from levanter_core.trainer.host_threads import ensure_collective_threads

__all__ = [
    "MODEL", "TINY_HF", "LocalS3Server", "code_docs", "listed_plugin", "logged", "read_metrics", "run_config",
    "simulated_devices", "tiny_hf_config", "tiny_hf_llama", "tiny_model", "train_bpe_tokenizer", "train_briefly",
    "write_jsonl",
]  # fmt: skip

MODEL = tiny_model()
"""A GPT-2 small enough to train a few steps on CPU in seconds (needs levanter-model-gpt2)."""


def simulated_devices(devices: int, *, quick_compile: bool = False) -> dict[str, str]:
    """Environment entries for a subprocess whose JAX runs on ``devices`` simulated CPU devices:
    ``JAX_PLATFORMS=cpu``, and this process's ``XLA_FLAGS`` with the device count set.

    ``quick_compile``: also ask XLA's CPU backend for its lowest optimization level
    (``--xla_backend_optimization_level=0``), which halves the time a subprocess that compiles
    dozens of tiny programs spends compiling (the optimizer matrix: 30 of them). Only for a
    subprocess whose results are compared among themselves: code compiled at another level
    rounds differently (a batch of requests served together no longer gives the bits of each
    served alone, as levels 1 and 2 do). It replaces a level this process's flags set.

    Also ``PJRT_NPROC``, unless this process's environment sets it: threads enough for the
    devices' collectives (:mod:`levanter_core.trainer.host_threads`)."""
    count, level = "--xla_force_host_platform_device_count", "--xla_backend_optimization_level"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    if quick_compile:
        flags = [*(f for f in flags if not f.startswith(level)), f"{level}=0"]
    entries = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join([*flags, f"{count}={devices}"])}
    if "PJRT_NPROC" not in os.environ:  # the subprocess inherits this process's setting otherwise
        ensure_collective_threads(entries)
    return entries


def write_jsonl(path: Path, records: Iterable[dict]) -> str:
    """Write ``records`` to ``path`` as JSON lines; return the path as a string (for a config)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def code_docs(n: int, offset: int = 0) -> list[dict]:
    """``n`` small, distinct Python-like text documents (``{"text": ...}``), numbered from ``offset``."""
    return [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 2} for i in range(offset, offset + n)]


def run_config(
    tmp_path: Path, data: dict, *, run_id: str = "pipe", steps: int = 6, model: dict = MODEL, **trainer
) -> str:
    """A tiny GPT-2 run on ``data`` (a ``data:`` section) as a YAML file in ``tmp_path``, with
    logs and checkpoints under ``tmp_path``; ``trainer`` fields are added or overridden. Returns
    the file's path."""
    config = {
        "data": {"tokenizer": "byte", **data},
        "model": model,
        "trainer": {
            "id": run_id,
            "train_batch_size": 4,
            "num_train_steps": steps,
            "steps_per_eval": 3,
            "max_eval_batches": 2,
            "log_dir": str(tmp_path / "logs"),
            "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []},
            **trainer,
        },
        "optimizer": {"learning_rate": 1e-2, "warmup": 0},
    }
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def train_briefly(config_path: str, workdir: str, *, steps: int = 4, overrides: Sequence[str] = ()):
    """Train the config at ``config_path`` for ``steps`` steps in-process, with its data,
    logs, checkpoints and cache under ``workdir`` and a small slice of the Python
    standard library as the corpus (so it runs offline in seconds). Returns the
    :class:`~levanter_core.run.result.RunResult`."""
    args = [
        "--trainer.num_train_steps", str(steps),
        "--trainer.steps_per_eval", str(steps),
        "--trainer.max_eval_batches", "1",
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "checkpoints"),
        "--data.cache_dir", os.path.join(workdir, "cache"),
        "--data.max_files", "20",
        *overrides,
    ]  # fmt: skip
    config, _ = load_train_config(config_path, args)
    return run_training(config, config_path=config_path, progress=False)


def train_bpe_tokenizer(
    texts: Iterable[str], path: str, *, vocab_size: int, special_tokens: tuple[str, ...] = ("<|endoftext|>",)
) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` with the ``tokenizers`` library (offline,
    in seconds for small corpora) and save it as the ``tokenizer.json`` at ``path``. Returns
    ``path``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(path)
    return path


def tiny_hf_llama(
    directory: str,
    texts: Iterable[str],
    *,
    vocab_size: int,
    context: int = 256,
    tokenizer_config: dict | None = None,
) -> str:
    """A random two-layer ``transformers`` Llama (hidden size 64, two key-value heads) with a
    byte-level BPE trained on ``texts``, saved as a Hugging Face model directory: a model to
    serve, sample or evaluate in tests with nothing downloaded. Its end-of-text token
    ``<|endoftext|>`` is also its beginning-of-text token; ``context`` is its
    ``max_position_embeddings``; ``tokenizer_config`` (``tokenizer_config.json``) is written
    when given. Returns ``directory``."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    path = train_bpe_tokenizer(texts, os.path.join(directory, "tokenizer.json"), vocab_size=vocab_size)
    tokenizer = Tokenizer.from_file(path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    if tokenizer_config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    random_hf_model(config, seed=0).save_pretrained(directory)
    return directory


def listed_plugin(distribution: str) -> dict:
    """What ``levanter plugins --json`` says about ``distribution`` (its hooks, types and error),
    run in a subprocess as a user would, with this interpreter: a plugin's discovery test."""
    out = subprocess.run(
        [sys.executable, "-c", "from levanter_core.cli import main; main()", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    listed = {p["distribution"]: p for p in json.loads(out.stdout)["plugins"]}
    if distribution not in listed:
        raise AssertionError(f"{distribution} is not among the plugins found: {sorted(listed)}")
    return listed[distribution]


class LocalS3Server:
    """An S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's server mode
    (``pip install 'moto[server]'``) in its own process, with buckets kept in memory. Use it as
    a context manager; :attr:`environment` holds what a client needs (endpoint, region, dummy
    credentials)."""

    def __init__(self):
        self.process = None
        self.endpoint = ""

    def __enter__(self) -> LocalS3Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        with socket.socket() as s:  # a port free now; moto binds it a moment later
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        code = "import sys; from moto.server import main; sys.exit(main(sys.argv[1:]))"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None

    @property
    def environment(self) -> dict[str, str]:
        """Environment variables that point S3 clients (TensorStore, fsspec, boto) here."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "levanter-test",
            "AWS_SECRET_ACCESS_KEY": "levanter-test-secret",
        }

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``s3://name``."""
        import boto3

        env = self.environment
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"
