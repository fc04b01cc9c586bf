"""trainer.keep_host_memory: the buffers XLA's CPU backend frees are reused, not paged in again
on every call. Each case runs in a fresh process, since the setting is process-wide."""

import json
import platform
import subprocess
import sys

import pytest

from conftest import REPO, run_config, write_jsonl

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only"
)

# argv: "default", "keep", or a config path and overrides to configure the run with, as
# `levanter train` does (keep_freed_memory first, then configure_jax with the config). Then a
# jitted function with a 64 MiB intermediate (tanh(x @ w1), 8192 x 2048 float32), past the size
# glibc maps afresh for every call from a thread's own arena, is timed in page faults.
FAULTS_PER_CALL = """
import json, resource, sys
from levanter_core.trainer.host_memory import keep_freed_memory
if sys.argv[1] != "default":
    keep_freed_memory()
if sys.argv[1] not in ("default", "keep"):
    from levanter_core.config.train import load_train_config
    from levanter_core.trainer.run import configure_jax
    configure_jax(load_train_config(sys.argv[1], sys.argv[2:])[0])
import jax, jax.numpy as jnp
x, w1, w2 = jnp.ones((8192, 64)), jnp.ones((64, 2048)) / 64, jnp.ones((2048, 64))
f = jax.jit(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w1, w2).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The median call: the heap grows on the first calls (and once more whenever a call's buffer
# happens to be allocated before the previous one's is freed).
print(json.dumps(sorted(faults)[len(faults) // 2]))
"""
INTERMEDIATE_PAGES = 8192 * 2048 * 4 // 4096


def faults_per_call(*args: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_CALL, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_are_reused_instead_of_paged_in_again():
    # Without it, each call pages its 64 MiB intermediate in again; with it, nothing is.
    assert faults_per_call("default") >= INTERMEDIATE_PAGES / 2
    assert faults_per_call("keep") < INTERMEDIATE_PAGES / 20


@pytest.mark.parametrize("overrides, kept", [([], True), (["--trainer.keep_host_memory", "false"], False)])
def test_run_configuration_follows_trainer_keep_host_memory(tmp_path, overrides, kept):
    data = {"train_urls": [write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])], "cache_dir": str(tmp_path / "c")}
    faults = faults_per_call(run_config(tmp_path, data), *overrides)
    assert faults < INTERMEDIATE_PAGES / 20 if kept else faults >= INTERMEDIATE_PAGES / 2
