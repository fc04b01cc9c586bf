"""Several processes training one model: starting ``jax.distributed``, and the few things
processes must agree on outside the compiled step.

A run is multi-process when ``trainer.distributed`` names a coordinator (or a number of
processes), or when JAX recognises a cluster that gives this job more than one process:
SLURM (``srun``), Open MPI (``mpirun``), Cloud TPU pods (GCE and GKE) and Kubernetes
indexed jobs. Every process runs the same command; process 0 writes the run record, logs,
and builds the data caches, and all of them read their share of each batch and write their
part of each checkpoint.

Agreement outside the devices goes through JAX's coordination service (a key-value store
and barriers served by process 0): it costs no device collective, so it may be used from
any thread.
"""

from __future__ import annotations

import logging

import jax
from jax._src import distributed
from jax._src.clusters import ClusterEnv  # the detection jax.distributed.initialize() uses

logger = logging.getLogger(__name__)

# How long a process waits for another to publish a value or reach a barrier.
DEFAULT_TIMEOUT_S = 60 * 60


def detected_cluster() -> str | None:
    """The name of the cluster environment JAX recognises here (``slurm``, ``ompi``,
    ``gce_tpu``, ``gke_tpu``, ``k8s``, ...) when it gives this job more than one process;
    None otherwise (one machine, or a cluster job of a single process)."""
    for env in ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            if env.is_env_present() and env.get_process_count() > 1:
                return env.name
        except Exception as e:  # a half-configured environment: not a cluster we can use
            logger.debug("cluster detection %s failed: %s", env.__name__, e)
    return None


def initialize(config) -> str | None:
    """Start ``jax.distributed`` as ``config`` (a ``DistributedConfig``) says, or as the
    detected cluster says; return how (``"configured"`` or the cluster's name), or None for a
    single-process run. Must run before anything touches a device."""
    if not config.initialize_jax_distributed:
        return None
    how = "configured" if config.requested else detected_cluster()
    if how is None:
        return None
    local = config.local_device_ids
    if isinstance(local, int):
        local = [local]
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=local,
        heartbeat_timeout_seconds=config.heartbeat_timeout_seconds,
    )
    logger.info(
        "jax.distributed (%s): process %d of %d, %d local device(s) of %d",
        how,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return how


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_leader() -> bool:
    """Whether this is process 0, the one that logs, writes the run record and builds caches."""
    return process_index() == 0


def _client():
    # The coordination-service client that JAX's own checkpointing uses; there is no public one.
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def share(name: str, value: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Process 0's ``value`` for ``name``, in every process: process 0 publishes it (and gets it
    back), the others wait for it. Each ``name`` is published once per run. In a
    single-process run ``value`` is returned as it is."""
    if process_count() == 1:
        if value is None:
            raise ValueError(f"share({name!r}): process 0 must give a value")
        return value
    key = f"levanter/{name}"
    if is_leader():
        if value is None:
            raise ValueError(f"share({name!r}): process 0 must give a value")
        _client().key_value_set(key, value)
        return value
    return _client().blocking_key_value_get(key, int(timeout_s * 1000))


def gather(name: str, value: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str] | None:
    """Every process's ``value`` for ``name``, in process order, in process 0; None in the
    others (which do not wait). Each ``name`` is gathered once per run."""
    if process_count() == 1:
        return [value]
    key = f"levanter/{name}"
    if not is_leader():
        _client().key_value_set(f"{key}/{process_index()}", value)
        return None
    others = [_client().blocking_key_value_get(f"{key}/{i}", int(timeout_s * 1000)) for i in range(1, process_count())]
    return [value, *others]


def forget(name: str) -> None:
    """Remove what process 0 shared under ``name`` (call it from process 0 once every process
    has read it)."""
    if process_count() > 1 and is_leader():
        _client().key_value_delete(f"levanter/{name}")


def barrier(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every process reaches the barrier ``name`` (each name is used once per run)."""
    if process_count() == 1:
        return
    _client().wait_at_barrier(f"levanter/{name}", int(timeout_s * 1000))


def coordinator_host() -> str | None:
    """The host name of process 0 as the processes reach it (from the coordinator address);
    None in a single-process run."""
    address = distributed.global_state.coordinator_address
    if process_count() == 1 or not address:
        return None
    return address.rsplit(":", 1)[0].strip("[]")
