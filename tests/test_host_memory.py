"""trainer.keep_host_memory: the buffers XLA's CPU backend frees are reused, not paged in again
on every call. Each case runs in a fresh process, since the setting is process-wide."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, run_config, write_jsonl

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only"
)

# A jitted function with a 64 MiB intermediate (tanh(x @ w1), 8192 x 2048 float32): past the
# size that glibc maps afresh for every call from a thread's own arena.
FAULTS_PER_CALL = """
import json, resource, sys
if sys.argv[1] == "keep":
    from levanter_core.trainer.host_memory import keep_freed_memory
    kept = keep_freed_memory()
else:
    kept = False
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
print(json.dumps({"kept": kept, "faults_per_call": sorted(faults)[len(faults) // 2]}))
"""


def _faults_per_call(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_CALL, mode], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_are_reused_instead_of_paged_in_again():
    intermediate_pages = 8192 * 2048 * 4 // 4096
    default = _faults_per_call("default")
    kept = _faults_per_call("keep")
    # Without it, each call pages its 64 MiB intermediate in again; with it, nothing is.
    assert not default["kept"] and default["faults_per_call"] >= intermediate_pages / 2, default
    assert kept["kept"] and kept["faults_per_call"] < intermediate_pages / 20, kept


CONFIGURE = """
import json, sys
from levanter_core.trainer import host_memory
host_memory.keep_freed_memory()  # as `levanter train` does first
from levanter_core.config.train import load_train_config
from levanter_core.trainer.run import configure_jax
config, _ = load_train_config(sys.argv[1], sys.argv[2:])
configure_jax(config)
print(json.dumps({"kept": host_memory._kept}))
"""


@pytest.mark.parametrize("overrides, kept", [([], True), (["--trainer.keep_host_memory", "false"], False)])
def test_run_configuration_follows_trainer_keep_host_memory(tmp_path, overrides, kept):
    data = {"train_urls": [write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])], "cache_dir": str(tmp_path / "c")}
    config = run_config(tmp_path, data)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONFIGURE), config, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"kept": kept}
