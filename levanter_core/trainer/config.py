"""The ``trainer:`` section: the training loop, precision, parallelism, checkpoints, logging."""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, Field, field_validator, model_validator

from levanter_core.config.base import ConfigModel, Typed, TypedList
from levanter_core.config.types import MpPolicy
from levanter_core.optim.model_averaging import ModelAveragingConfig
from levanter_core.trainer.viz import VizConfig
from levanter_core.trainer.watch import WatchConfig

JsonAtom = str | int | float | bool | None


class DistributedConfig(ConfigModel):
    """Multi-process settings passed to ``jax.distributed.initialize``. Leave them unset
    on one machine; JAX detects SLURM and TPU pods by itself."""

    coordinator_address: str | None = None
    """``host:port`` of process 0. Setting it (or ``num_processes``) turns multi-process on."""
    num_processes: int | None = None
    """How many processes take part in the run."""
    process_id: int | None = None
    """This process's index, ``0 .. num_processes-1``."""
    local_device_ids: int | list[int] | None = None
    """Which local devices this process uses (default: all, or ``CUDA_VISIBLE_DEVICES``)."""
    initialize_jax_distributed: bool = True
    """Set to false to skip ``jax.distributed.initialize`` even when the fields above are set."""

    @property
    def requested(self) -> bool:
        return self.initialize_jax_distributed and (
            self.coordinator_address is not None or self.num_processes is not None
        )


class RayConfig(ConfigModel):
    """Ray, for spreading data preprocessing (tokenization) over many machines."""

    address: str | None = None
    """The Ray cluster to join: ``host:port``, ``auto`` (the cluster this machine already
    belongs to, or ``RAY_ADDRESS``), or ``local`` (start a private one on this machine).
    None: no Ray unless ``auto_start_cluster`` applies."""
    start_workers: bool = True
    """Whether the training hosts join the cluster as workers (they tokenize too). False:
    you start the cluster's workers yourself. For multi-process runs, which this version
    does not run yet."""
    auto_start_cluster: bool = True
    """For multi-process runs with no ``address`` (not run by this version yet): start a
    Ray cluster over the training hosts. A single-process run without ``address``
    tokenizes with local processes (``data.num_workers``) and never starts Ray."""


class TrainerConfig(ConfigModel):
    """How to train: steps and batches, precision, device mesh, evaluation, tracking, checkpoints."""

    seed: int = 0
    """The random seed. Every random number of the run (init, dropout, data order) derives from it."""
    mp: MpPolicy = "f32"
    """Mixed-precision policy in jmp syntax, e.g. ``p=f32,c=bfloat16``: parameters kept in float32,
    computation in bfloat16."""

    log_dir: str = "logs/"
    """Run directories go under this path: ``{log_dir}/{run_id}/``."""
    id: str | None = None
    """The run id. Unset: derived from the config file name and a hash of the resolved config,
    so running the same command again resumes the same run."""
    tracker: TypedList("tracker", "json") = Field(default_factory=dict)  # type: ignore[valid-type]
    """Where metrics go: one tracker section or a list of them. Default: the built-in ``json``
    tracker, writing ``metrics.jsonl`` in the run directory."""
    checkpointer: Typed("checkpointer", "tensorstore") = Field(default_factory=dict)  # type: ignore[valid-type]
    """Checkpoint location and save policy (``base_path``, ``save_interval``, ``keep``)."""

    crash_on_nan: bool = True
    """Stop the run with an error when the loss becomes NaN."""
    crash_on_inf: bool = True
    """Stop the run with an error when the loss becomes infinite."""

    num_train_steps: int = Field(400_000, ge=1)
    """How many optimizer steps to train for."""
    train_batch_size: int = Field(512, ge=1)
    """Sequences per optimizer step (the global batch, across all devices)."""
    per_device_parallelism: int = Field(
        -1, validation_alias=AliasChoices("per_device_parallelism", "per_device_train_parallelism")
    )
    """Sequences each device processes at once. -1: ``train_batch_size / data-parallel devices``.
    Smaller values accumulate gradients over several microbatches."""
    per_device_eval_parallelism: int = -1
    """Sequences each device evaluates at once. -1: same as ``per_device_parallelism``."""
    steps_per_eval: int = Field(1000, ge=1)
    """Evaluate on the validation set every this many steps (and at the end)."""
    max_eval_batches: int | None = Field(None, ge=1)
    """Evaluate on at most this many batches. None: the whole validation set."""

    batch_axis: str = "batch"
    """Logical axis of the batch; it is sharded over the mesh's data axis."""
    fsdp_axis: str | list[str] | None = "embed"
    """Logical axis (or axes) whose parameters are sharded over the data axis (FSDP)."""
    tensor_parallel_axes: list[str] | None = None
    """Logical axes sharded over the mesh's model axis (tensor parallelism)."""
    model_axis_size: int = Field(1, ge=1)
    """Devices on the model (tensor-parallel) axis; the rest form the data axis."""
    axis_resources: dict[str, str | list[str]] = Field(default_factory=dict)
    """Advanced: logical -> mesh axis mapping used for both parameters and compute."""
    parameter_axis_resources: dict[str, str | list[str]] = Field(default_factory=dict)
    """Advanced: logical -> mesh axis mapping for parameters and optimizer state only."""

    load_checkpoint: bool | None = None
    """None: resume from the latest checkpoint if there is one. True: a checkpoint must exist.
    False: start fresh."""
    load_checkpoint_path: str | None = None
    """Where to look for the checkpoint to resume: a checkpoint or a directory of them.
    Default: the checkpointer's path for this run."""
    initialize_from: str | None = None
    """Start from this checkpoint's state (a checkpoint or a directory of them) as a new run."""

    viz: VizConfig | None = None
    """Every ``viz.interval`` steps, draw the log-probability of each token of a few
    validation sequences as an HTML heatmap (``{run_dir}/viz/step-N.html``, also sent to the
    trackers). None: no heatmaps."""

    watch: WatchConfig | None = None
    """Log norms (and optionally histograms) of the parameters, gradients and updates every
    ``watch.interval`` steps, as ``watch/...`` metrics. None: nothing watched."""

    model_averaging: ModelAveragingConfig | None = None
    """Keep a running average of the weights beside the model (``type: ema`` or
    ``ema_decay_sqrt``), checkpointed with the training state; evaluation uses the average.
    None: no averaging."""

    jax_config: dict[str, JsonAtom] = Field(default_factory=lambda: {"jax_threefry_partitionable": True})
    """Options passed to ``jax.config.update`` before anything runs."""
    jax_compilation_cache_dir: str | None = None
    """JAX's persistent compilation cache directory (a second start skips compilation)."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Multi-process settings (``jax.distributed``)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray cluster used for data preprocessing."""

    @field_validator("per_device_parallelism", "per_device_eval_parallelism")
    @classmethod
    def _positive_or_auto(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be a positive number of sequences, or -1 for automatic; got {v}")
        return v

    @model_validator(mode="after")
    def _check_axes(self) -> "TrainerConfig":
        tp = set(self.tensor_parallel_axes or [])
        if self.batch_axis in tp:
            raise ValueError(f"batch_axis {self.batch_axis!r} cannot also be a tensor_parallel_axes entry")
        return self

    # -- derived -------------------------------------------------------------------------
    @property
    def fsdp_axes(self) -> list[str]:
        if self.fsdp_axis is None:
            return []
        return [self.fsdp_axis] if isinstance(self.fsdp_axis, str) else list(self.fsdp_axis)

    def compute_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes while computing: the batch over ``data``, TP axes over ``model``."""
        mapping: dict[str, Any] = {self.batch_axis: "data"}
        for axis in self.tensor_parallel_axes or []:
            mapping[axis] = "model"
        mapping.update({k: _as_mesh_axes(v) for k, v in self.axis_resources.items()})
        return mapping

    def parameter_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes at rest: FSDP axes over ``data``, TP axes over ``model``."""
        mapping: dict[str, Any] = {axis: "data" for axis in self.fsdp_axes}
        for axis in self.tensor_parallel_axes or []:
            mapping[axis] = "model"
        mapping.update({k: _as_mesh_axes(v) for k, v in self.axis_resources.items()})
        mapping.update({k: _as_mesh_axes(v) for k, v in self.parameter_axis_resources.items()})
        return mapping


def _as_mesh_axes(value: str | list[str]) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(value)
