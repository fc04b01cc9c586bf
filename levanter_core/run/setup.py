"""Before a run trains: what the config names is checked (preflight), JAX and the processes
are set up, the batch size is worked out for the devices, and the notes a Levanter user needs
are said. Also the run's trackers, and the clean-up of a run that bad data stopped before it
trained."""

from __future__ import annotations

import logging
import os
import shutil

import jax

from levanter_core import distributed
from levanter_core.config.train import TrainConfig
from levanter_core.data.tokenizer import check_tokenizer_available
from levanter_core.errors import ConfigError
from levanter_core.fileio import is_local, require_filesystem
from levanter_core.tracker import CompositeTracker, NoopTracker
from levanter_core.tracker.base import RunInfo
from levanter_core.trainer import host_memory
from levanter_core.trainer.checks import (
    check_batch_sizes,
    check_context_split,
    check_data_inputs,
    check_expert_split,
    check_pipeline_split,
    check_tokenizer,
)
from levanter_core.trainer.host_threads import ensure_collective_threads
from levanter_core.trainer.mesh import data_axis_size, make_mesh

logger = logging.getLogger("levanter_core.trainer.run")


def configure_jax(config: TrainConfig) -> None:
    trainer = config.trainer
    ensure_collective_threads()  # simulated devices (XLA_FLAGS): before JAX's CPU backend starts
    if trainer.keep_host_memory:
        host_memory.keep_freed_memory()  # before JAX's first use of its backend starts XLA's threads
    else:
        host_memory.release_freed_memory()

    if trainer.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(trainer.jax_compilation_cache_dir))
        # JAX caches only compilations that took a second or more by default; the eval step
        # and the small programs of start-up take less each, but add up on every start.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    for name, value in trainer.jax_config.items():
        try:
            jax.config.update(name, value)
        except (AttributeError, ValueError, TypeError) as e:
            raise ConfigError(f"trainer.jax_config.{name}: JAX does not accept {value!r}: {e}") from None

    distributed.initialize(trainer.distributed)
    if trainer.require_accelerator and jax.default_backend() == "cpu":
        raise ConfigError(
            "trainer.require_accelerator is true, but JAX found no GPU or TPU (its backend is cpu); "
            "run on a machine with one, or set trainer.require_accelerator: false to train on the CPU"
        )


def preflight(config: TrainConfig) -> None:
    """Check, before anything starts (no device, no data read), what the config names but this
    environment cannot provide, and what the run would refuse once started: the tokenizer
    (there, and a tokenizer), the data files, batch sizes that do not divide over the replicas
    and microbatches (:mod:`~levanter_core.trainer.checks`), and places the checkpointer or
    the exports cannot reach. Raises a :class:`UserError` naming the field."""
    check_tokenizer_available(config.data.tokenizer)  # a hub tokenizer that cannot be had
    check_tokenizer(config.data.tokenizer)
    check_data_inputs(config.data)
    check_batch_sizes(config.trainer)
    check_context_split(config.trainer, config.train_length)
    check_expert_split(config.trainer, config.model)
    check_pipeline_split(config.trainer, config.model)
    trainer = config.trainer
    places = {
        "trainer.checkpointer.base_path": trainer.checkpointer.base_path,
        "trainer.load_checkpoint_path": trainer.load_checkpoint_path,
        "trainer.initialize_from": trainer.initialize_from,
        "initialize_from_checkpoint_path": config.initialize_from_checkpoint_path,
    }
    for field, path in places.items():
        problem = path and trainer.checkpointer.location_problem(path)
        if problem:
            raise ConfigError(f"{field}: {problem}")
    # The run directory and the exports are written locally and uploaded with fsspec: any
    # filesystem it can open will do.
    for field, path in {"trainer.log_dir": trainer.log_dir, "hf_save_path": config.hf_save_path}.items():
        try:
            require_filesystem(path)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None


def batch_for_devices(config: TrainConfig) -> TrainConfig:
    """``config`` with ``trainer.train_batch_size: -1`` worked out for this run's devices:
    ``per_device_parallelism`` on each data-parallel one (Levanter's meaning)."""
    if config.trainer.train_batch_size != -1:
        return config

    trainer = config.trainer.for_devices(data_axis_size(make_mesh(config.trainer)))
    print(
        f"trainer.train_batch_size -1: {trainer.train_batch_size} sequences per step "
        f"({config.trainer.per_device_parallelism} per data-parallel device)",
        flush=True,
    )
    return config.model_copy(update={"trainer": trainer})


def levanter_differences(config: TrainConfig) -> list[str]:
    """Where this run, as configured, does something other than Levanter would with the same
    config: defaults of Levanter's that need an account or an accelerator."""
    notes = []
    if "tracker" not in config.trainer.model_fields_set:
        notes.append(
            "trainer.tracker is not set: metrics go to metrics.jsonl in the run directory (Levanter's default "
            "is W&B; set trainer.tracker: {type: wandb} for it)"
        )
    if config.trainer.require_accelerator is None and jax.default_backend() == "cpu":
        notes.append(
            "no GPU or TPU found: this run trains on the CPU, which it may (Levanter's default, "
            "trainer.require_accelerator: true, would stop it instead; set trainer.require_accelerator to true or "
            "false to say which you mean and drop this note)"
        )
    return notes


def describe_processes() -> str:
    return (
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices ({jax.devices()[0].device_kind})"
    )


def remove_untrained_run(config: TrainConfig, run_id: str) -> None:
    """Remove what a run that bad data stopped before its first step leaves: its run directory
    (the record of a run that never trained, an empty ``metrics.jsonl``) and its checkpoint
    directory when empty. A run directory with a logged step, or checkpoints, stays."""
    run_dir = os.path.join(config.trainer.log_dir, run_id)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
        return
    checkpoints = config.trainer.checkpointer.expanded_path(run_id)
    if is_local(checkpoints) and os.path.isdir(checkpoints):
        if os.listdir(checkpoints):
            return
        os.rmdir(checkpoints)
    shutil.rmtree(run_dir, ignore_errors=True)
    logger.info("removed %s: bad data stopped the run before its first step", run_dir)


def make_tracker(config: TrainConfig, info: RunInfo):
    """The run's trackers; in a multi-process run only process 0 has them (the others log nothing)."""
    if not distributed.is_leader():
        return NoopTracker()
    trackers = [t.init(info) for t in config.trainer.tracker]
    return trackers[0] if len(trackers) == 1 else CompositeTracker(trackers)
