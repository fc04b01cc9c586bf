"""Settings of the whole test session (the core's tests and every plugin's).

Compiled programs are released after each test module. XLA's CPU backend maps about 14
memory regions for each program it keeps, and a test worker that ran a few hundred tests
kept thousands of programs: it reached the kernel's limit on mappings
(``vm.max_map_count``, 65,530), after which compiling failed inside LLVM's JIT, whose error
path leaves freed code registered with the C++ unwinder, and the next C++ exception crashed
the process (a segfault in ``libgcc_s``). A module's programs are rarely reused by the next
module; those that are come back from JAX's persistent compilation cache."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import sys

    if "jax" in sys.modules:  # a module that never imported JAX compiled nothing
        sys.modules["jax"].clear_caches()
        gc.collect()
