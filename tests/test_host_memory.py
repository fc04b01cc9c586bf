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
# glibc maps afresh for every call from a thread's own arena, is called CALLS times, and the
# page faults of all calls but the first are counted, in intermediates' worth of pages.
FAULTS = """
import json, resource, sys
CALLS, INTERMEDIATE_PAGES = {calls}, {pages}
from levanter_core.trainer.host_memory import keep_freed_memory
if sys.argv[1] != "default":
    keep_freed_memory()
if sys.argv[1] not in ("default", "keep"):
    from levanter_core.config.train import load_train_config
    from levanter_core.run import configure_jax
    configure_jax(load_train_config(sys.argv[1], sys.argv[2:])[0])
import jax, jax.numpy as jnp
x, w1, w2 = jnp.ones((8192, 64)), jnp.ones((64, 2048)) / 64, jnp.ones((2048, 64))
f = jax.jit(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2)
f(x, w1, w2).block_until_ready()  # the first call compiles and grows the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(CALLS - 1):
    f(x, w1, w2).block_until_ready()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / INTERMEDIATE_PAGES))
"""
CALLS = 40
INTERMEDIATE_PAGES = 8192 * 2048 * 4 // 4096


def intermediates_paged_in(*args: str) -> float:
    """How many times over the calls after the first one the intermediate's pages were faulted
    in (by default about once per call)."""
    script = FAULTS.format(calls=CALLS, pages=INTERMEDIATE_PAGES)
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_are_reused_instead_of_paged_in_again():
    # Without it, every call pages its 64 MiB intermediate in again. With it, the heap grows a
    # few times (a freed buffer's room gets split by smaller blocks, or the next call's buffer is
    # allocated before XLA's thread frees the last one: up to 6 times in 40 calls on 2 busy
    # cores), and then every call reuses what is there.
    assert intermediates_paged_in("default") >= (CALLS - 1) * 0.75
    assert intermediates_paged_in("keep") <= (CALLS - 1) / 4


@pytest.mark.parametrize("overrides, kept", [([], True), (["--trainer.keep_host_memory", "false"], False)])
def test_run_configuration_follows_trainer_keep_host_memory(tmp_path, overrides, kept):
    data = {"train_urls": [write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])], "cache_dir": str(tmp_path / "c")}
    paged_in = intermediates_paged_in(run_config(tmp_path, data), *overrides)
    assert paged_in <= (CALLS - 1) / 4 if kept else paged_in >= (CALLS - 1) * 0.75
