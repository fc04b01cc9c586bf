"""The ``trainer:`` section: the training loop, precision, parallelism, checkpoints, logging."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from haliax.quantization import QuantizationConfig as HaliaxQuantization
from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from levanter_core.config.base import ConfigModel, Typed, TypedList, accepted_only_as
from levanter_core.config.types import ContextAttention, MpPolicy, Seed
from levanter_core.fileio import require_filesystem
from levanter_core.optim.model_averaging import ModelAveragingConfig
from levanter_core.trainer.mesh_config import DATA_AXIS, MODEL_AXIS, MeshConfig
from levanter_core.trainer.mesh_config import DATA_PARALLEL_AXES as DATA_PARALLEL_AXES  # public here too
from levanter_core.trainer.mesh_config import MESH_AXES as MESH_AXES
from levanter_core.trainer.mesh_config import REPLICA_AXIS as REPLICA_AXIS
from levanter_core.trainer.mesh_config import REPLICA_DCN_AXIS as REPLICA_DCN_AXIS
from levanter_core.trainer.samples import TrainingSamplesConfig
from levanter_core.trainer.viz import VizConfig
from levanter_core.trainer.watch import WatchConfig

JsonAtom = str | int | float | bool | None

FSDP_AXIS = DATA_AXIS
"""Mesh axis that splits the batch and, with FSDP, the parameters (the devices left over)."""

_MESH_FIELDS = {
    "batch_axis": "batch_axis_name",
    "fsdp_axis": "param_mapping",
    "tensor_parallel_axes": "shared_mapping",
    "model_axis_size": "axes",
    "replica_ici_axis_size": "axes",
    "replica_dcn_axis_size": "dcn_axes",
    "axis_resources": "shared_mapping",
    "parameter_axis_resources": "param_mapping",
    "compute_axis_resources": "compute_mapping",
}
"""The trainer's own parallelism fields, and the field of ``trainer.mesh`` that says the same."""


class DistributedConfig(ConfigModel):
    """Multi-process settings passed to ``jax.distributed.initialize``. Leave them unset on one
    machine, and under SLURM, Open MPI, Cloud TPU pods and Kubernetes indexed jobs, which JAX
    detects by itself (a job with more than one process then runs multi-process)."""

    coordinator_address: str | None = None
    """``host:port`` of process 0. Setting it (or ``num_processes``) turns multi-process on."""
    num_processes: int | None = None
    """How many processes take part in the run."""
    process_id: int | None = None
    """This process's index, ``0 .. num_processes-1``."""
    local_device_ids: int | list[int] | None = None
    """Which local devices this process uses (default: all, or ``CUDA_VISIBLE_DEVICES``)."""
    initialize_jax_distributed: bool = True
    """Set to false to skip ``jax.distributed.initialize`` even when the fields above are set
    or a cluster is detected."""
    heartbeat_timeout_seconds: int = Field(100, ge=1)
    """When a process has not been heard from for this long, the others stop with an error
    rather than wait for it forever (a process that died, a host that went away)."""

    @property
    def requested(self) -> bool:
        return self.initialize_jax_distributed and (
            self.coordinator_address is not None or self.num_processes is not None
        )


class RayConfig(ConfigModel):
    """Ray, for spreading data preprocessing (tokenization) over many machines. Process 0
    builds the caches; with Ray its shards are tokenized by tasks spread over the cluster's
    nodes, and the build logs how many shards each node tokenized."""

    address: str | None = None
    """The Ray cluster to tokenize on: ``host:port`` (a head started with ``ray start
    --head``), ``auto`` (the cluster this machine already belongs to, or ``RAY_ADDRESS``), or
    ``local`` (a private Ray on process 0's machine). None: a multi-process run starts its
    own cluster (``auto_start_cluster``); a single-process run tokenizes with local processes
    (``data.num_workers``)."""
    start_workers: bool = True
    """In a multi-process run, whether every training host joins the cluster as a Ray
    worker node (so all of them tokenize): a ``ray start`` process each host starts, and
    stops when the run ends. False: the cluster's workers are yours to start. A
    single-process run never starts a node."""
    auto_start_cluster: bool = True
    """In a multi-process run with no ``address``: process 0 starts a Ray head (on a free
    port, with a token only the run's processes know), the other processes join it as
    workers (``start_workers``), and the cluster is stopped when the run ends. A run whose
    caches are all built already (a resumed run) starts none. False: no Ray; process 0
    tokenizes with local processes."""


class QuantizationConfig(ConfigModel):
    """Quantized training of the linear layers (Haliax's quantization): their matrix products run in
    FP8 (with delayed scaling: each layer keeps a history of the largest values it saw, updated
    by the training step) or INT8, while the parameters stay in their own precision."""

    fp8: bool = False
    """Matrix products of the linear layers in FP8 (E4M3 forward, E5M2 gradients)."""
    int8: bool = False
    """Matrix products of the linear layers in INT8."""
    targets: list[str] | str | None = None
    """Which linear layers: a list of module names, or a regular expression matched against their
    dotted paths. None: every linear layer."""
    amax_history_length: int = Field(1024, ge=1)
    """FP8: how many steps of largest absolute values each layer remembers for its scale."""

    @model_validator(mode="after")
    def _one_kind(self) -> QuantizationConfig:
        if self.fp8 and self.int8:
            raise ValueError("fp8 and int8 cannot both be on; choose one")
        return self

    @property
    def enabled(self) -> bool:
        return self.fp8 or self.int8

    def to_haliax(self):
        return HaliaxQuantization(
            targets=self.targets, amax_history_length=self.amax_history_length, fp8=self.fp8, int8=self.int8
        )


class BatchSizeStage(ConfigModel):
    """One stage of a batch-size schedule: ``value`` sequences per step from step ``start`` on."""

    start: int = Field(ge=0)
    """The first step of this stage."""
    value: int = Field(ge=1)
    """The batch size from ``start`` on."""


def _tracker_sections(value: Any) -> Any:
    """A tracker section written without ``type`` is W&B's, as in Levanter (whose default tracker
    is W&B); ``trainer.tracker`` left out is the built-in ``json`` tracker."""

    def typed(section: Any) -> Any:
        if isinstance(section, dict) and "type" not in section:
            return {"type": "wandb", **section}
        return section

    if isinstance(value, (list, tuple)):
        return [typed(v) for v in value]
    return typed(value)


def _default_jax_config() -> dict[str, JsonAtom]:
    return {"jax_threefry_partitionable": True}


class TrainerConfig(ConfigModel):
    """How to train: steps and batches, precision, device mesh, evaluation, tracking, checkpoints."""

    @model_validator(mode="before")
    @classmethod
    def _levanter_wandb_section(cls, data: Any) -> Any:
        # Levanter's deprecated `trainer.wandb` section: the W&B tracker, in place of `tracker`.
        if isinstance(data, dict) and "wandb" in data:
            data = dict(data)
            section = data.pop("wandb")
            if section is not None:
                warnings.warn(
                    "trainer.wandb is deprecated (as in Levanter): write trainer.tracker: {type: wandb, ...}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                data["tracker"] = {"type": "wandb", **(section if isinstance(section, dict) else {})}
        if isinstance(data, dict) and "tracker" in data:
            data = {**data, "tracker": _tracker_sections(data["tracker"])}
        return data

    seed: Seed = 0
    """The random seed, 0 to 2^32 - 1. Every random number of the run (init, dropout, data order)
    derives from it."""
    mp: MpPolicy = "f32"
    """Mixed-precision policy in jmp syntax, e.g. ``p=f32,c=bfloat16``: parameters kept in float32,
    computation in bfloat16."""

    log_dir: str = "logs/"
    """Run directories go under this path: ``{log_dir}/{run_id}/``. An ``s3://`` or ``gs://``
    URL: the run writes a local mirror and process 0 uploads it as it goes (docs/storage.md)."""
    id: str | None = None
    """The run id. Unset: derived from the config file name and a hash of what the config sets
    (fields at their defaults do not count), so running the same command again resumes the same
    run, also after an upgrade that adds fields."""
    tracker: TypedList("tracker", "json") = Field(default_factory=dict)  # type: ignore[valid-type]
    """Where metrics go: one tracker section or a list of them. Default: the built-in ``json``
    tracker, writing ``metrics.jsonl`` in the run directory (Levanter's default is W&B, which
    needs an account: name it to use it). A section without ``type`` is W&B's, as in Levanter.
    ``metrics.jsonl`` is written whatever the trackers."""
    checkpointer: Typed("checkpointer", "tensorstore") = Field(default_factory=dict)  # type: ignore[valid-type]
    """Checkpoint location and save policy (``base_path``, ``save_interval``, ``keep``)."""

    crash_on_nan: bool = True
    """Stop the run with an error when the loss becomes NaN."""
    crash_on_inf: bool = True
    """Stop the run with an error when the loss becomes infinite."""

    num_train_steps: int = Field(400_000, ge=1)
    """How many optimizer steps to train for."""
    train_batch_size: int | list[BatchSizeStage] = 512
    """Sequences per optimizer step (the global batch, across all devices): a number, or a
    schedule ``[{start: 0, value: 64}, {start: 1000, value: 128}, ...]`` whose first stage starts
    at step 0 (the step is compiled once per batch size; each step reads the sequences after the
    previous step's, so the data is the same whatever the schedule cuts it into). -1:
    ``per_device_parallelism`` x the data-parallel devices (no gradient accumulation), as in
    Levanter; worked out when the run starts."""
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
    """Logical axis of the batch; it is split over every data-parallel mesh axis
    (``replica_dcn``, ``replica`` and ``data``)."""
    fsdp_axis: str | list[str] | None = "embed"
    """Logical axis (or axes) of the parameters split over the mesh's ``data`` axis (FSDP):
    parameters and optimizer state are stored in pieces and gathered just in time for compute.
    None: parameters are not split over ``data``. A split axis's size must be a multiple of
    the mesh axis's (JAX stores no uneven pieces); the run checks this before compiling."""
    tensor_parallel_axes: list[str] | None = None
    """Logical axes split over the mesh's ``model`` axis (tensor parallelism), both at rest
    and while computing, e.g. ``[mlp, heads]``. Their sizes must be multiples of
    ``model_axis_size``. ``heads`` also splits ``kv_heads``, the head axis of the attention
    layers with grouped key-value heads (Llama and the other kit families), so that Levanter's
    ``[mlp, heads]`` means tensor parallelism over the heads for them too."""
    model_axis_size: int = Field(1, ge=1)
    """Devices on the ``model`` (tensor-parallel) mesh axis. The devices left over, divided by
    the replica sizes, form the ``data`` (FSDP) axis."""
    replica_ici_axis_size: int = Field(1, ge=1)
    """Devices on the ``replica`` mesh axis: pure data parallelism within a slice or process
    group (each replica holds whole copies of its FSDP shards), beside FSDP on ``data``."""
    replica_dcn_axis_size: int = Field(1, ge=1)
    """Replicas across slices or processes (the ``replica_dcn`` mesh axis, over the data-center
    network): pure data parallelism between process groups, so that only gradients cross the
    slow network. Each DCN replica is a group of whole processes (TPU slices on TPU), so it must
    divide their number."""
    allow_nondivisible_batch_size: bool = False
    """Allow ``train_batch_size`` (and the microbatch and eval batch sizes) not to be a multiple
    of the data-parallel size. The batch is then placed whole on every device and split
    unevenly inside the step, which costs a copy of each batch per device."""
    axis_resources: dict[str, str | list[str]] = Field(default_factory=dict)
    """Advanced: logical -> mesh axis (or axes) mapping used for both parameters and compute;
    overrides the basic fields above. Mesh axes: ``replica_dcn``, ``replica``, ``data``, ``model``."""
    parameter_axis_resources: dict[str, str | list[str]] = Field(default_factory=dict)
    """Advanced: logical -> mesh axis mapping for parameters and optimizer state at rest only."""
    compute_axis_resources: dict[str, str | list[str]] = Field(default_factory=dict)
    """Advanced: logical -> mesh axis mapping while computing only (activations, and the
    parameters as gathered for compute)."""
    mesh: MeshConfig | None = None
    """The device mesh and the axis mappings in Levanter's spelling (``axes``, ``dcn_axes``,
    ``batch_axis_name``, ``shared_mapping``, ``compute_mapping``, ``param_mapping``), in place of
    the fields above (``batch_axis`` to ``compute_axis_resources``), which are translated into it:
    one code path either way. Giving both is an error. None: the fields above decide."""
    context_attention: ContextAttention = "ring"
    """How attention runs when ``trainer.mesh`` splits each sequence's positions over the
    ``context`` axis (``axes: {context: N}``, ``shared_mapping: {position: context}``): ``ring``
    passes keys and values around the N devices (each holds 1/N of them at a time, N - 1 rounds
    of communication); ``all_gather`` gathers all of them on every device for its queries (one
    round, all of a layer's keys and values on each device). See docs/parallelism.md."""
    expert_capacity_factor: float | None = Field(default=None, gt=0)
    """Where ``trainer.mesh`` splits a mixture of experts' experts over the ``expert`` axis
    (``axes: {expert: N}``, ``shared_mapping: {experts: expert}``), how many (token, expert)
    pairs each device may send to each other device, as a multiple of the balanced load
    (``tokens x top_k / N``); pairs past it are dropped (their expert's output counts as zero).
    None: dropless (room for every pair, exact, at N times the exchange's memory and bytes).
    See docs/parallelism.md."""
    pipeline_microbatches: int | None = Field(default=None, ge=1)
    """Where ``trainer.mesh`` splits the layers into stages (``axes: {stage: S}``: pipeline
    parallelism), how many microbatches each batch (each microbatch of
    ``per_device_parallelism``, where it cuts the batch) is fed through the stages in. The
    stages idle a fraction ``(S - 1) / (M + S - 1)`` of the step (the bubble); more microbatches
    shrink it, each with fewer rows. Each data-parallel device group's rows must divide into
    them. None: the most, up to ``4 x S``, that divide those rows. See docs/parallelism.md."""
    pipeline_repeats: int = Field(default=1, ge=1)
    """Where ``trainer.mesh`` splits the layers into ``S`` stages, the rounds ``R`` each
    microbatch makes of them. 1: GPipe's schedule, each stage ``L / S`` consecutive layers. More:
    the circular schedule, each stage ``R`` chunks of ``L / (S R)`` layers (chunk ``r S + s`` on
    stage ``s``), which shrinks the bubble to ``(S - 1) / (R M + S - 1)`` at the cost of moving
    the chunks to their stages each step (an all-to-all of the layers' weights, and of their
    gradients back). Needs ``S R`` to divide the layers and at least ``S`` microbatches. See
    docs/parallelism.md."""

    load_checkpoint: bool | None = None
    """None: resume from the latest checkpoint if there is one. True: a checkpoint must exist.
    False: start fresh."""
    load_checkpoint_path: str | None = None
    """Where to look for the checkpoint to resume: a checkpoint or a directory of them.
    Default: the checkpointer's path for this run."""
    initialize_from: str | None = None
    """Start from this checkpoint's state (a checkpoint or a directory of them) as a new run."""
    allow_partial_checkpoint: bool = False
    """Load a checkpoint (resume, ``initialize_from``) that lacks some parts of the state, e.g.
    one saved without the averaged model or with another optimizer: what it lacks starts fresh,
    with a warning naming each missing part. False: such a checkpoint is refused."""

    quantization: QuantizationConfig | None = None
    """Quantized training of the linear layers (``{fp8: true}`` or ``{int8: true}``). None: none."""

    profiler: bool = False
    """Record a JAX profiler trace of ``profiler_num_steps`` steps starting at
    ``profiler_start_step``, into ``{run_dir}/profiler/`` (open with TensorBoard's profile
    plugin, or Perfetto)."""
    profiler_start_step: int = Field(5, ge=0)
    """The first step traced (later than the first steps, which compile)."""
    profiler_num_steps: int = Field(100, ge=1)
    """How many steps are traced (fewer if the run ends first)."""
    profiler_perfetto_link: bool = False
    """Also write a Perfetto trace (``perfetto_trace.json.gz``) beside the trace and print its path,
    to open at ui.perfetto.dev."""

    require_accelerator: bool | None = None
    """True: stop before training when JAX finds no GPU or TPU. None or false: train on whatever
    there is (Levanter's None requires an accelerator except on macOS; here CPU training is a
    first-class use, so None allows it)."""
    plan_check: bool = False
    """Before the model is allocated, compile the training step for this run's devices from
    shapes alone (what ``levanter plan`` does) and stop the run, with the plan's memory per device,
    when its peak would not fit a device: the accelerator's memory (``levanter_core.plan.hardware``)
    or, on CPU devices, this machine's memory shared among them. Costs one more compilation."""
    shutdown_at_exit: bool | float = False
    """Levanter shuts the TPU VM down this long after the run ends; this framework never powers off
    a machine, so only false is accepted."""

    viz: VizConfig | None = None
    """Every ``viz.interval`` steps, draw the log-probability of each token of a few
    validation sequences as an HTML heatmap (``{run_dir}/viz/step-N.html``, also sent to the
    trackers). None: no heatmaps."""

    sample: TrainingSamplesConfig | None = None
    """Every ``sample.interval`` steps (and after the last), continue ``sample.prompts`` with the
    model and log the texts to the trackers (``samples/0``, ``samples/1``...). None: no samples."""

    watch: WatchConfig | None = None
    """Log norms (and optionally histograms) of the parameters, gradients and updates every
    ``watch.interval`` steps, as ``watch/...`` metrics. None: nothing watched."""

    model_averaging: ModelAveragingConfig | None = None
    """Keep a running average of the weights beside the model (``type: ema`` or
    ``ema_decay_sqrt``), checkpointed with the training state; evaluation uses the average.
    None: no averaging."""

    jax_config: dict[str, JsonAtom] = Field(default_factory=_default_jax_config)
    """Options passed to ``jax.config.update`` before anything runs."""
    jax_compilation_cache_dir: str | None = "~/.cache/levanter/jax"
    """JAX's persistent compilation cache (``~`` is expanded): compiled programs are stored here,
    so a second start of the same run (or any run with the same model, batch and mesh) skips
    compilation. Every compilation is cached, however short. None: no cache (unless the
    ``JAX_COMPILATION_CACHE_DIR`` environment variable names one)."""
    keep_host_memory: bool = True
    """Keep host memory that is freed for reuse rather than return it to the operating system
    (glibc's ``malloc``, on Linux). XLA's CPU backend otherwise maps, zeroes and pages in each
    step's buffers afresh: steps of the reference GPT-2 on CPU take 15% less time with it. The
    process's resident memory then stays at its peak, up to twice a step's working memory.
    ``levanter train`` sets it up before anything else; from Python, call
    ``levanter_core.trainer.host_memory.keep_freed_memory()`` first thing."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Multi-process settings (``jax.distributed``)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray cluster used for data preprocessing."""

    _filesystem_installed = field_validator("load_checkpoint_path", "initialize_from")(require_filesystem)

    _no_shutdown = accepted_only_as(
        False,
        "shutdown_at_exit",
        why="shutting the machine down at exit is not supported; remove the field or set it to false, "
        "and stop the machine from your job script",
    )

    @field_validator("train_batch_size")
    @classmethod
    def _check_schedule(cls, v: int | list[BatchSizeStage]) -> int | list[BatchSizeStage]:
        if isinstance(v, int):
            if v < 1 and v != -1:
                raise ValueError(
                    f"must be a positive number of sequences (or -1: per_device_parallelism x devices), got {v}"
                )
            return v
        starts = [stage.start for stage in v]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"a batch-size schedule's stages must start at step 0 and increase (got starts {starts})")
        return v

    @field_validator("per_device_parallelism", "per_device_eval_parallelism")
    @classmethod
    def _positive_or_auto(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be a positive number of sequences, or -1 for automatic; got {v}")
        return v

    @field_validator("axis_resources", "parameter_axis_resources", "compute_axis_resources")
    @classmethod
    def _mesh_axes_only(cls, mapping: dict[str, str | list[str]]) -> dict[str, str | list[str]]:
        for logical, physical in mapping.items():
            unknown = [a for a in ([physical] if isinstance(physical, str) else physical) if a not in MESH_AXES]
            if unknown:
                raise ValueError(
                    f"{logical!r} is mapped to {unknown[0]!r}, which is not a mesh axis; "
                    f"the mesh axes are {', '.join(MESH_AXES)}"
                )
        return mapping

    @model_validator(mode="after")
    def _check_axes(self) -> TrainerConfig:
        tp = set(self.tensor_parallel_axes or [])
        if self.batch_axis in tp:
            raise ValueError(f"batch_axis {self.batch_axis!r} cannot also be a tensor_parallel_axes entry")
        return self

    @model_validator(mode="after")
    def _one_mesh(self) -> TrainerConfig:
        if self.mesh is None:
            self._translated_mesh()  # what the run will use: built once here, so that it builds
            return self
        fields = type(self).model_fields
        for name in _MESH_FIELDS:
            value = getattr(self, name)
            if value == fields[name].get_default(call_default_factory=True):
                continue
            if name == "batch_axis" and value == self.mesh.batch_axis_name:
                continue  # what trainer.mesh says already (a resolved config, loaded again)
            raise ValidationError.from_exception_data(
                "trainer",
                [
                    {
                        "type": PydanticCustomError("mesh_twice", "{message}", {"message": _twice(name, value)}),
                        "loc": ("mesh",),
                        "input": self.mesh,
                    }
                ],
            )
        # The training step names the batch with batch_axis: it is trainer.mesh's.
        object.__setattr__(self, "batch_axis", self.mesh.batch_axis_name)
        return self

    @model_validator(mode="after")
    def _batch_per_device(self):
        if self.train_batch_size == -1 and self.per_device_parallelism < 1:
            raise ValueError(
                "train_batch_size -1 means per_device_parallelism sequences on each data-parallel device: "
                "set per_device_parallelism too (or give train_batch_size a number)"
            )
        return self

    def for_devices(self, data_parallel: int) -> TrainerConfig:
        """This config with ``train_batch_size: -1`` worked out for ``data_parallel`` devices
        (``per_device_parallelism`` each); itself otherwise."""
        if self.train_batch_size != -1:
            return self
        return self.model_copy(update={"train_batch_size": self.per_device_parallelism * data_parallel})

    # -- derived -------------------------------------------------------------------------
    @property
    def batch_schedule(self) -> BatchSchedule:
        """``train_batch_size`` as a schedule (one stage for a plain number)."""
        if self.train_batch_size == -1:
            raise ValueError("train_batch_size -1 is worked out for the devices when the run starts (for_devices)")
        stages = (
            [(0, self.train_batch_size)]
            if isinstance(self.train_batch_size, int)
            else [(stage.start, stage.value) for stage in self.train_batch_size]
        )
        return BatchSchedule(tuple(stages))

    @property
    def fsdp_axes(self) -> list[str]:
        if self.fsdp_axis is None:
            return []
        return [self.fsdp_axis] if isinstance(self.fsdp_axis, str) else list(self.fsdp_axis)

    def tensor_parallel_logical_axes(self) -> list[str]:
        """``tensor_parallel_axes`` with ``kv_heads`` added where ``heads`` is named (and
        ``kv_heads`` is not mapped otherwise): a grouped-query attention layer's head axis."""
        axes = list(self.tensor_parallel_axes or [])
        mapped = set(self.axis_resources) | set(self.compute_axis_resources) | set(self.parameter_axis_resources)
        if "heads" in axes and "kv_heads" not in axes and "kv_heads" not in mapped:
            axes.append("kv_heads")
        return axes

    @property
    def layer_settings(self) -> dict[str, Any]:
        """The settings of the layers that run split over devices, as
        :func:`levanter_core.layers.parallel.parallel_settings` takes them."""
        return {
            "context_attention_strategy": self.context_attention,
            "expert_capacity_factor": self.expert_capacity_factor,
            "pipeline_microbatches": self.pipeline_microbatches,
            "pipeline_repeats": self.pipeline_repeats,
        }

    @property
    def resolved_mesh(self) -> MeshConfig:
        """The mesh config in effect: ``mesh`` as written, or the one the fields ``batch_axis``
        to ``compute_axis_resources`` translate to. Every part of the run reads the mesh's
        sizes and mappings from it. (``mesh`` itself stays as written, so that a config's run id
        and its saved ``config.yaml`` are what they were before ``mesh`` existed.)"""
        return self.mesh if self.mesh is not None else self._translated_mesh()

    def _translated_mesh(self) -> MeshConfig:
        """``trainer.mesh`` equivalent to the fields ``batch_axis`` to ``compute_axis_resources``:
        the same sizes and the same resolved mappings, with each entry remembering the field it
        came from. Levanter's defaults that those fields do not split (``mlp``, ``heads``,
        ``kv_heads`` over ``model``) are turned off, so nothing new is split."""
        origins: dict[tuple[str, str], str] = {
            ("size", "replica_dcn"): "trainer.replica_dcn_axis_size",
            ("size", "replica"): "trainer.replica_ici_axis_size",
            ("size", "data"): "the data axis size (devices / (model_axis_size x replica sizes))",
            ("size", "model"): "trainer.model_axis_size",
            ("batch", self.batch_axis): "trainer.batch_axis",
        }
        shared: dict[str, Any] = {"mlp": [], "heads": [], "kv_heads": []}
        implied = {("shared", axis) for axis in shared}
        named = set(self.tensor_parallel_axes or [])
        for axis in self.tensor_parallel_logical_axes():
            shared[axis] = MODEL_AXIS
            origins["shared", axis] = (
                "trainer.tensor_parallel_axes"
                if axis in named
                else "trainer.tensor_parallel_axes (heads, which splits kv_heads)"
            )
            if axis in named:
                implied.discard(("shared", axis))
        for axis, value in self.axis_resources.items():
            shared[axis] = value
            origins["shared", axis] = f"trainer.axis_resources.{axis}"
            implied.discard(("shared", axis))
        # Before, the tensor-parallel axes and axis_resources won over fsdp_axis.
        params: dict[str, Any] = {}
        for axis in self.fsdp_axes:
            if axis in self.tensor_parallel_logical_axes() or axis in self.axis_resources:
                continue
            params[axis] = FSDP_AXIS
            origins["param", axis] = "trainer.fsdp_axis"
        for axis, value in self.parameter_axis_resources.items():
            params[axis] = value
            origins["param", axis] = f"trainer.parameter_axis_resources.{axis}"
        for axis in self.compute_axis_resources:
            origins["compute", axis] = f"trainer.compute_axis_resources.{axis}"
        mesh = MeshConfig(
            axes={"replica": self.replica_ici_axis_size, "data": -1, "model": self.model_axis_size},
            dcn_axes={"replica_dcn": self.replica_dcn_axis_size},
            batch_axis_name=self.batch_axis,
            shared_mapping=shared,
            compute_mapping=dict(self.compute_axis_resources),
            param_mapping=params,
        )
        return mesh.traced(origins, implied)

    def compute_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes while computing (:meth:`MeshConfig.compute_axis_mapping` of
        :attr:`resolved_mesh`). With the basic fields: the batch over every data-parallel axis,
        the tensor-parallel axes over ``model``; then ``axis_resources`` and
        ``compute_axis_resources``. FSDP axes are absent: parameters are gathered whole along
        them for compute."""
        return self.resolved_mesh.compute_axis_mapping()

    def parameter_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes at rest, parameters and optimizer state
        (:meth:`MeshConfig.parameter_axis_mapping` of :attr:`resolved_mesh`). With the basic
        fields: the FSDP axes over ``data``, the tensor-parallel axes over ``model``; then
        ``axis_resources`` and ``parameter_axis_resources``. Replicas hold whole copies of the
        FSDP shards."""
        return self.resolved_mesh.parameter_axis_mapping()

    def parameter_axis_field(self, axis: str) -> str:
        """The dotted config field that decides where the parameter mapping puts the logical
        ``axis``: for error messages."""
        return self.resolved_mesh.field_of(axis, "param")


def _twice(name: str, value: Any) -> str:
    """The message for ``trainer.mesh`` given with the trainer's field ``name`` set to ``value``."""
    return (
        f"trainer.mesh and trainer.{name} both say how the model's axes map onto the devices; say it once: "
        f"write {_in_mesh(name, value)} and remove trainer.{name}, or remove trainer.mesh"
    )


def _in_mesh(name: str, value: Any) -> str:
    """What the trainer's field ``name`` set to ``value`` reads as in ``trainer.mesh``."""
    field = f"trainer.mesh.{_MESH_FIELDS[name]}"
    if name in ("model_axis_size", "replica_ici_axis_size", "replica_dcn_axis_size"):
        axis = {"model_axis_size": MODEL_AXIS, "replica_ici_axis_size": REPLICA_AXIS}.get(name, REPLICA_DCN_AXIS)
        return f"{field}.{axis}: {value}"
    if name == "batch_axis":
        return f"{field}: {value}"
    if name in ("fsdp_axis", "tensor_parallel_axes"):
        axes = [] if value is None else [value] if isinstance(value, str) else value
        mesh_axis = FSDP_AXIS if name == "fsdp_axis" else MODEL_AXIS
        value = dict.fromkeys(axes, mesh_axis)
    entries = ", ".join(f"{k}: {v if isinstance(v, str) else '[' + ', '.join(v) + ']'}" for k, v in value.items())
    return f"{field}: {{{entries}}}"


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """Batch sizes by step: ``stages`` are ``(first step, batch size)``, the first at step 0."""

    stages: tuple[tuple[int, int], ...]

    @property
    def sizes(self) -> list[int]:
        """Every batch size of the schedule, each once, in order of first use."""
        return list(dict.fromkeys(size for _, size in self.stages))

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def size_at(self, step: int) -> int:
        size = self.stages[0][1]
        for start, value in self.stages:
            if start > step:
                break
            size = value
        return size

    def offset_at(self, step: int) -> int:
        """How many sequences the steps before ``step`` read: where step ``step``'s batch starts."""
        offset = 0
        for i, (start, size) in enumerate(self.stages):
            end = self.stages[i + 1][0] if i + 1 < len(self.stages) else None
            if step <= start:
                break
            offset += size * ((step if end is None else min(step, end)) - start)
        return offset
