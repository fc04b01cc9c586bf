"""What a run checks before it starts (``levanter train`` and ``--dry-run`` alike): that the
tokenizer is one, that the data files are there, and that the batch sizes divide over the
devices and microbatches. None of it touches a device or reads a record of data.

Each check raises a :class:`~levanter_core.errors.UserError` (exit status 2) whose message starts
with the dotted config field to change."""

from __future__ import annotations

from levanter_core.data.pipeline import needed_caches
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import ConfigError, DataError
from levanter_core.layers.pipeline import default_microbatches
from levanter_core.layers.stack import runs
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh_config import REPLICA_AXIS, REPLICA_DCN_AXIS
from levanter_core.trainer.trainer import BatchPlan


def check_tokenizer(spec: str) -> None:
    """Load the tokenizer ``data.tokenizer`` names, so that a file or directory that is not a
    tokenizer stops the run here rather than after its run directory is made."""
    try:
        load_tokenizer(spec)
    except DataError as e:
        message = str(e)
        raise DataError(message if message.startswith("data.tokenizer") else f"data.tokenizer: {message}") from None


def check_data_inputs(data) -> None:
    """Every source and split the run reads (a ``data:`` section) must find its inputs
    (:meth:`~levanter_core.data.source.DataSourceConfig.check_inputs`)."""
    for name, split in needed_caches(data):
        try:
            data.configs[name].check_inputs(split)
        except DataError as e:
            if data.is_mixture:
                raise DataError(f"{data.field_of(name)}: {e}") from None
            raise


def _split_over(
    trainer: TrainerConfig, logical: str, what: str, kind: str, mesh_axis: str, sizes: dict[str, int] | None
) -> tuple[str, str, int] | None:
    """Where the compute mapping splits the logical axis ``logical`` (``what``, for messages), the
    dotted field that maps it, the one mesh axis it names (``kind`` splits over one, such as
    ``mesh_axis``; more is a :class:`ConfigError`) and that axis's size (from ``sizes``, else ``trainer.mesh``);
    None where it is not mapped."""
    mesh = trainer.resolved_mesh
    mapped = mesh.compute_axis_mapping().get(logical)
    if mapped is None:
        return None
    field = mesh.field_of(logical, "compute")
    names = [mapped] if isinstance(mapped, str) else list(mapped)
    if len(names) > 1:
        raise ConfigError(
            f"{field}: the {what} are mapped to {names}; {kind} splits them over one mesh axis ({mesh_axis})"
        )
    size = sizes[names[0]] if sizes is not None else (mesh.axes | mesh.dcn_axes).get(names[0], 1)
    return field, mesh.size_field(names[0]), size


def check_context_split(trainer: TrainerConfig, seq_len: int, sizes: dict[str, int] | None = None) -> None:
    """Where the compute mapping splits ``position`` (context parallelism), it must name one mesh
    axis, and each sequence of ``seq_len`` positions must cut into two equal chunks per device of
    that axis (the zigzag layout that balances causal attention). ``sizes``: the mesh axes'
    sizes on this run's devices; without them, the sizes ``trainer.mesh`` gives (an axis of -1
    is checked once the devices are known)."""
    split = _split_over(trainer, "position", "positions", "context parallelism", "context", sizes)
    if split is None:
        return
    field, size_field, size = split
    if size > 1 and seq_len % (2 * size):
        raise ConfigError(
            f"train_seq_len: {seq_len} positions do not cut into {2 * size} equal chunks: {field} splits each "
            f"sequence over {size_field} = {size} devices, two chunks each (one early, one late, so "
            f"that causal attention gives every device the same work); train on a multiple of {2 * size} positions"
        )


def check_expert_split(trainer: TrainerConfig, model: object, sizes: dict[str, int] | None = None) -> None:
    """Where the compute mapping splits ``experts`` (expert parallelism), it must name one mesh
    axis whose size divides the model's number of experts (each device holds as many). ``model``:
    the model config; one without ``moe_config()`` (or whose ``moe_config()`` is None) has no
    experts to split. ``sizes`` as for :func:`check_context_split`."""
    split = _split_over(trainer, "experts", "experts", "expert parallelism", "expert", sizes)
    if split is None:
        return
    field, size_field, size = split
    moe_config = getattr(model, "moe_config", None)
    moe = moe_config() if callable(moe_config) else None
    experts = getattr(moe, "num_experts", None)
    if size > 1 and isinstance(experts, int) and experts % size:
        raise ConfigError(
            f"{field} splits the experts over {size_field} = {size} devices, but the model has "
            f"{experts} experts per layer, which do not divide evenly; choose a size that divides {experts}"
        )


def check_pipeline_split(
    trainer: TrainerConfig, model: object, sizes: dict[str, int] | None = None, data_parallel: int | None = None
) -> None:
    """Where the compute mapping splits ``layers`` (pipeline parallelism), it must name one mesh
    axis, and the model must be one that runs its layers as a pipeline (its config's
    ``pipeline_parallel``): scanned stacks of layers whose numbers the stages (times the rounds
    of ``trainer.pipeline_repeats``) divide.
    With ``data_parallel`` (once the devices are known), each data-parallel group's rows of a
    batch must divide into ``trainer.pipeline_microbatches``. ``sizes`` as for
    :func:`check_context_split`."""
    split = _split_over(trainer, "layers", "layers", "pipeline parallelism", "stage", sizes)
    if split is None:
        return
    field, size_field, size = split
    if size == 1:
        return
    kind = getattr(model, "type", type(model).__name__)
    if not getattr(type(model), "pipeline_parallel", False):
        raise ConfigError(
            f"{field} splits the layers into {size} pipeline stages, but model type {kind!r} does not run its "
            f"layers as a pipeline; give {size_field} size 1"
        )
    if getattr(model, "scan_layers", True) is False:
        raise ConfigError(
            f"model.scan_layers: pipeline parallelism ({field}) splits a scanned stack of layers into stages; "
            "set model.scan_layers: true (model.unroll_layers may stay)"
        )
    layers = getattr(model, "num_layers", None)
    kinds = getattr(model, "layer_kinds", None)
    groups = runs(kinds()) if callable(kinds) else []  # a stack of each run of one kind (dense, moe)
    stacks: list[int] = [n for _, n, _ in groups] or ([layers] if isinstance(layers, int) else [])
    described = f"{layers} layers"
    if len(groups) > 1:
        described = f"layers (stacks of {', then '.join(f'{n} {kind}' for _, n, kind in groups)})"
    if any(n % size for n in stacks):
        raise ConfigError(
            f"{size_field}: the model's {described} do not split into {size} equal pipeline stages; choose a "
            f"number of stages that divides {' and '.join(str(n) for n in stacks)}"
        )
    repeats = trainer.pipeline_repeats
    if any(n % (size * repeats) for n in stacks):
        raise ConfigError(
            f"trainer.pipeline_repeats: {size} stages x {repeats} rounds cut the layers into {size * repeats} "
            f"chunks, which the model's {described} do not fill equally; choose a number of rounds R with "
            f"{size} x R dividing {' and '.join(str(n) for n in stacks)}"
        )
    count = trainer.pipeline_microbatches
    if repeats > 1 and count is not None and count < size:
        raise ConfigError(
            f"trainer.pipeline_microbatches: a circular pipeline (trainer.pipeline_repeats: {repeats}) needs at "
            f"least as many microbatches as its {size} stages; got {count}"
        )
    if data_parallel is None or trainer.train_batch_size == -1:
        return
    for batch in trainer.batch_schedule.sizes:
        rows = BatchPlan.from_config(trainer, data_parallel, batch).microbatch_size // data_parallel
        if count is not None and rows % count:
            raise ConfigError(
                f"trainer.pipeline_microbatches: each of the {data_parallel} data-parallel device group(s) holds "
                f"{rows} row(s) of each batch, which do not cut into {count} equal microbatches; choose a number "
                f"that divides {rows}"
            )
        default = default_microbatches(size, rows)
        if repeats > 1 and count is None and default < size:
            raise ConfigError(
                f"trainer.pipeline_repeats: a circular pipeline needs at least as many microbatches as its {size} "
                f"stages; each of the {data_parallel} data-parallel device group(s) holds {rows} row(s) of each "
                f"batch, which cut by default into {default}; set trainer.pipeline_microbatches to a divisor of "
                f"{rows} of at least {size}, give the batch more rows, or set pipeline_repeats: 1"
            )


def check_batch_sizes(trainer: TrainerConfig, data_parallel: int | None = None) -> None:
    """Each batch size of ``trainer.train_batch_size`` (every stage of a schedule) must divide
    over ``data_parallel`` devices and the microbatches of ``per_device_parallelism`` as the
    trainer splits it (:meth:`~levanter_core.trainer.trainer.BatchPlan.from_config`). Without
    ``data_parallel`` (before the devices are known), what holds on any number of devices: the
    data-parallel size is a multiple of the replicas' sizes (``replica_dcn x replica``, from
    ``trainer.mesh`` or ``replica_dcn_axis_size x replica_ici_axis_size``)."""
    if trainer.train_batch_size == -1:
        return  # per_device_parallelism x the devices: divides by construction
    if data_parallel is not None:
        for size in trainer.batch_schedule.sizes:
            BatchPlan.from_config(trainer, data_parallel, size)
        return
    mesh = trainer.resolved_mesh
    replicas = mesh.replicas()
    replica_fields = f"{mesh.size_field(REPLICA_DCN_AXIS)} x {mesh.size_field(REPLICA_AXIS)}"
    field = "trainer.train_batch_size" + ("" if isinstance(trainer.train_batch_size, int) else " (a stage)")
    for size in trainer.batch_schedule.sizes:
        if size % replicas and not trainer.allow_nondivisible_batch_size:
            raise ConfigError(
                f"{field}: {size} sequences do not split over {replica_fields} = {replicas} data-parallel "
                f"replicas; choose a multiple of "
                f"{replicas}, or set trainer.allow_nondivisible_batch_size: true"
            )
        if trainer.per_device_parallelism != -1:
            micro = trainer.per_device_parallelism * replicas
            if size % micro:
                raise ConfigError(
                    f"{field}: {size} sequences do not split into microbatches of trainer.per_device_parallelism "
                    f"({trainer.per_device_parallelism}) x {replicas} replica(s) x the data-parallel devices; choose a "
                    f"multiple of {micro} x the data axis size"
                )
