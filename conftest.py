"""Settings of the whole test session (the core's tests and every plugin's).

Compiled programs are released after each test module. XLA's CPU backend maps about 14
memory regions for each program it keeps, and a test worker that ran a few hundred tests
kept thousands of programs: it reached the kernel's limit on mappings
(``vm.max_map_count``, 65,530), after which compiling failed inside LLVM's JIT, whose error
path leaves freed code registered with the C++ unwinder, and the next C++ exception crashed
the process (a segfault in ``libgcc_s``). A module's programs are rarely reused by the next
module; those that are come back from JAX's persistent compilation cache.

Levanter's own configs name ``gs://`` buckets, and loading a config checks that credentials for
each bucket it names can be found. The session gets stand-in Google credentials (an
authorized-user file that no request ever uses: nothing here reaches Google Cloud) unless the
environment has its own; tests of missing credentials remove them from their processes.

Compiling is most of what the suite does: a test's model is tiny, and the XLA programs it
compiles are rarely run more than a few dozen times. Unless the environment says otherwise, the
session (and every process it starts, which inherits the setting) asks XLA's CPU backend for
optimization level 1 instead of 2 (``--xla_backend_optimization_level=1``), which cut the whole
suite's time by about an eighth (``bench/RESULTS.md``, 2026-11-29), and generates the code
of fusions with XLA's older LLVM emitters instead of its newer MLIR fusion emitters
(``--xla_cpu_use_fusion_emitters=false``), which cut a sample of 46 tests from 270 s to 202 s
(2026-11-29, fourth session). Results compared among themselves keep their bits (a resumed run
is still its uninterrupted run's, a batch of served requests still gives each one's answer
alone: the tests of those run with these settings), and the golden loss curves, recorded with
XLA's defaults, hold within their tolerance (see ``levanter_core.testing.golden``). The
persistent compilation cache of the first paragraph is the one ``levanter train`` uses
(``~/.cache/levanter/jax``), set here for the test processes themselves."""

from __future__ import annotations

import gc
import json
import os
import tempfile

import jax
import pytest
from _pytest.nodeid import NodeId

# XLA settings of the session and every process it starts, unless the environment sets them
# (the module's docstring says what each gains).
SUITE_XLA_FLAGS = {"--xla_backend_optimization_level": "1", "--xla_cpu_use_fusion_emitters": "false"}


def pytest_configure(config):
    if getattr(config.option, "dist", None) == "loadgroup":
        config.option.loadscopereorder = False  # see pytest_collection_modifyitems
    flags = os.environ.get("XLA_FLAGS", "").split()
    for name, value in SUITE_XLA_FLAGS.items():
        if not any(flag.startswith(name) for flag in flags):
            flags.append(f"{name}={value}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    # JAX is imported by now (a pytest plugin imports it) but has started no backend, so the
    # flags above still apply; its cache settings are set directly, for this process only.
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/levanter/jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # torch (the reference side of the parity tests, and the test processes they start) on one
    # thread: its operations on tiny models are too small to share, and a second thread spins
    # while it waits for work, beside another test process on few cores (a tiny Qwen3-MoE's
    # `generate` took 8.5 CPU-seconds on two threads, 1.0 on one). Read when torch starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "GOOGLE_APPLICATION_CREDENTIALS" not in os.environ:
        path = os.path.join(tempfile.mkdtemp(prefix="levanter-tests-"), "application_default_credentials.json")
        with open(path, "w") as f:
            json.dump({"type": "authorized_user", "client_id": "levanter-tests", "client_secret": "unused",
                       "refresh_token": "unused"}, f)  # fmt: skip
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = path


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (``make test``), the tests of one module run on one worker,
    unless they name a group of their own (``pytest.mark.xdist_group``): a module-scoped fixture
    (a reference run, a trained checkpoint, a built cache) is then made once, not once on each
    worker that gets one of the module's tests.

    pytest-xdist groups tests by a suffix it appends to their ids, written to an attribute that
    pytest 9 no longer reads (the id now lives in ``_id``), so it is written here.

    The groups are handed out in the order of the collection (``pytest_configure`` turns off
    xdist's reordering by test count, which put the modules of one long test last), with the
    modules that hold ``slow`` tests first, so that the end of the session, when one worker may
    wait for the other, holds only short tests."""
    if not getattr(config.option, "loadgroup", False):
        return
    module = {item: item.nodeid.split("::", 1)[0] for item in items}
    with_slow = {module[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: module[item] not in with_slow)
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        group = "_".join(sorted(names)) if names else module[item]
        if not item.nodeid.endswith(f"@{group}"):
            item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
