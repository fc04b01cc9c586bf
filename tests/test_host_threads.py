"""Threads for XLA's CPU runtime when a process simulates several devices
(levanter_core/trainer/host_threads.py): a process that asks for N devices gets a pool of 4N
threads unless its environment says otherwise; one device changes nothing."""

import os

from levanter_core.testing import simulated_devices
from levanter_core.trainer.host_threads import collective_threads, ensure_collective_threads, simulated_device_count


def test_the_device_count_is_read_from_the_flags_as_xla_reads_it():
    assert simulated_device_count("") == 1
    assert simulated_device_count("--xla_backend_optimization_level=1") == 1
    flags = "--xla_force_host_platform_device_count=2 --xla_cpu_use_fusion_emitters=false "
    assert simulated_device_count(flags + "--xla_force_host_platform_device_count=8") == 8  # the last one


def test_simulated_devices_get_four_threads_each_unless_the_environment_says(monkeypatch):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert ensure_collective_threads(env) == 32 and env["PJRT_NPROC"] == "32"
    assert collective_threads(1) == max(4, os.cpu_count() or 1)  # never fewer than the cores
    own = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "12"}
    assert ensure_collective_threads(own) is None and own["PJRT_NPROC"] == "12"
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    assert ensure_collective_threads(one) is None and "PJRT_NPROC" not in one
    # the tests' subprocess environments: set, unless this process's environment sets it
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    assert simulated_devices(4)["PJRT_NPROC"] == str(collective_threads(4))
    monkeypatch.setenv("PJRT_NPROC", "5")
    assert "PJRT_NPROC" not in simulated_devices(4)
