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
environment has its own; tests of missing credentials remove them from their processes."""

from __future__ import annotations

import gc
import json
import os
import tempfile

import pytest


def pytest_configure(config):
    if "GOOGLE_APPLICATION_CREDENTIALS" not in os.environ:
        path = os.path.join(tempfile.mkdtemp(prefix="levanter-tests-"), "application_default_credentials.json")
        with open(path, "w") as f:
            json.dump({"type": "authorized_user", "client_id": "levanter-tests", "client_secret": "unused",
                       "refresh_token": "unused"}, f)  # fmt: skip
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = path


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import sys

    if "jax" in sys.modules:  # a module that never imported JAX compiled nothing
        sys.modules["jax"].clear_caches()
        gc.collect()
