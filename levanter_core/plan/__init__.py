"""``levanter plan``: what a training config needs on hardware this machine does not have.

:mod:`~levanter_core.plan.hardware` is the table of accelerators, :mod:`~levanter_core.plan.hlo`
reads a compiled program's collectives, :mod:`~levanter_core.plan.estimate` compiles the real
training step for simulated devices and turns it into memory, time and whether it fits, and
:mod:`~levanter_core.plan.command` runs it for the command line, in a process with the devices.
"""
