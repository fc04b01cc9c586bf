"""Enough threads for XLA's CPU runtime when it simulates more devices than the host has cores.

``--xla_force_host_platform_device_count=N`` (in ``XLA_FLAGS``) makes one process show ``N`` CPU
devices, which is how parallelism is tried on a machine without accelerators. XLA's CPU client
then runs the thunks of every device's program that may go concurrently on one shared pool of
``max(cores, N)`` threads (``XLAEigen``), and a collective holds its thread until every device of
its group has reached it. When the devices of a program run two independent collectives at once
(a pipeline's gather of a stage's parameters over ``data`` beside its exchange between stages),
those that started first can hold every thread of the pool while the collectives they wait for
sit in its queue behind them: the program never finishes (XLA aborts at its collective timeout).
With 8 devices on 2 cores this stopped about one run in ten of a pipeline with FSDP inside its
stages; the stuck threads were all eight of the pool, and the devices missing from each
rendezvous had no thread (``bench/RESULTS.md``, 2026-11-29, fifth session).

XLA reads the pool's size from ``PJRT_NPROC`` when its CPU client starts.
:func:`ensure_collective_threads` sets it, before JAX's backend starts, to
:data:`THREADS_PER_DEVICE` threads per simulated device where ``XLA_FLAGS`` asks for several and
the environment does not set it. The extra threads sleep unless collectives wait; the work of
the devices still shares the host's cores.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

THREADS_PER_DEVICE = 4
"""Threads of XLA's CPU pool per simulated device: room for each device to wait at several
collectives at once."""

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def simulated_device_count(xla_flags: str) -> int:
    """The number of CPU devices ``xla_flags`` (an ``XLA_FLAGS`` value) asks XLA to simulate; 1
    where it does not say (the last setting counts, as for XLA)."""
    found = _DEVICE_COUNT.findall(xla_flags or "")
    return int(found[-1]) if found else 1


def collective_threads(devices: int) -> int:
    """The size of XLA's CPU thread pool for ``devices`` simulated devices:
    :data:`THREADS_PER_DEVICE` each, and never fewer than the host's cores."""
    return max(THREADS_PER_DEVICE * devices, os.cpu_count() or 1)


def ensure_collective_threads(environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set ``PJRT_NPROC`` in ``environ`` (this process's environment by default) for the
    simulated devices its ``XLA_FLAGS`` asks for, unless it is set already or there is at most
    one device. Returns the value set, or None. Takes effect only before JAX's CPU backend
    starts (a process's first use of a device)."""
    env = os.environ if environ is None else environ
    devices = simulated_device_count(env.get("XLA_FLAGS", ""))
    if devices <= 1 or "PJRT_NPROC" in env:
        return None
    threads = collective_threads(devices)
    env["PJRT_NPROC"] = str(threads)
    return threads


__all__ = ["THREADS_PER_DEVICE", "collective_threads", "ensure_collective_threads", "simulated_device_count"]
