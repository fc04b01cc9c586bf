"""The path of one training run, from a validated config to the final checkpoint.

``run_training`` is what ``levanter train`` calls:

config -> JAX set-up -> run directory -> data (tokenized cache) -> mesh ->
model and optimizer -> fresh or resumed state -> trackers -> train loop
(log, eval, checkpoint) -> final checkpoint and summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from typing import Any

import yaml

from levanter_core import __version__, lora
from levanter_core.config.train import TrainConfig, objective_class
from levanter_core.errors import CheckpointError, ConfigError, DataError
from levanter_core.fileio import is_local, join, require_filesystem, write_text_atomically
from levanter_core.models.lm import LmConfig
from levanter_core.plugins import get_manager
from levanter_core.tracker.base import RunInfo, finish_tracker
from levanter_core.trainer.run_sync import SYNC_INTERVAL_SECONDS, RunDirectory

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
    """What a finished run reports back (also written to ``summary.json`` by the json tracker)."""

    run_id: str
    run_dir: str
    """``{trainer.log_dir}/{run_id}``: a local directory or an object-store URL."""
    start_step: int
    final_step: int
    first_loss: float | None = None
    last_loss: float | None = None
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    tokens_per_second: float | None = None
    wall_seconds: float = 0.0
    checkpoint: str | None = None
    ended_early: str | None = None
    """Why training stopped before ``trainer.num_train_steps`` (the data ran out: ``epoch``,
    ``data.stop_strategy``); None when it did not."""


# -- identity and the run record ---------------------------------------------------------------


def resolved_config(config: TrainConfig) -> dict:
    """The config with every default filled in, as JSON-able data."""
    return config.model_dump(mode="json")


def derive_run_id(config: TrainConfig, config_path: str | None) -> str:
    """``trainer.id`` if set; else ``{config file stem}-{hash of the resolved config}``, so the
    same command (same config, same overrides) names the same run and resumes it."""
    if config.trainer.id:
        return config.trainer.id
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    return f"{stem}-{config_digest(config)[:8]}"


def config_digest(config: TrainConfig) -> str:
    """A hash of the config without what may differ between the processes of one run or
    between attempts at it (``trainer.id``, ``trainer.distributed``). Only what differs from
    the defaults counts (and every section's ``type``), so a release that adds a field with a
    default leaves the run ids of existing configs, and so their resumption, as they were."""
    data = _non_defaults(config)
    data.get("trainer", {}).pop("id", None)
    data.get("trainer", {}).pop("distributed", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _non_defaults(value: Any) -> Any:
    """``value`` (a config, or a value inside one) as JSON-able data, leaving out every field
    that has its default, except ``type`` (which says what the rest means)."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            current = getattr(value, name)
            if name != "type" and not field.is_required() and current == field.get_default(call_default_factory=True):
                continue
            out[name] = _non_defaults(current)
        return out
    if isinstance(value, (list, tuple)):
        return [_non_defaults(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _non_defaults(v) for k, v in value.items()}
    return value


def agreed_run_id(config: TrainConfig, config_path: str | None) -> str:
    """The run id, the same in every process: process 0's. Raises :class:`ConfigError` in a
    process whose config differs from process 0's (a run's processes must all be started with
    the same config and overrides; only ``trainer.distributed`` may differ)."""
    from levanter_core import distributed

    run_id, digest = derive_run_id(config, config_path), config_digest(config)
    if distributed.process_count() == 1:
        return run_id
    leader = json.loads(distributed.share("run", json.dumps({"run_id": run_id, "digest": digest})))
    verdicts = distributed.gather("run_config_matches", str(leader["digest"] == digest))
    # Process 0 learns which processes differ; a process that differs knows it itself.
    differing = [i for i, same in enumerate(verdicts or []) if same != "True"]
    if leader["digest"] != digest:
        differing = [distributed.process_index()]
    if differing:
        who = f"process {differing[0]} was" if len(differing) == 1 else f"processes {differing} were"
        raise ConfigError(
            f"{who} started with a config that differs from process 0's. Start every process of a run with "
            "the same config file and overrides; only trainer.distributed (process_id, local_device_ids) may differ."
        )
    return leader["run_id"]


def __getattr__(name: str):
    """Names that moved out of this module: they still import from here, with a warning."""
    moved = {
        "RUN_SETTINGS": ("levanter_core.models.lm.LmConfig.run_settings", lambda: LmConfig.run_settings),
        "plugin_versions": ("levanter_core.plugins.get_manager().versions", lambda: get_manager().versions),
    }
    if name not in moved:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new, value = moved[name]
    warnings.warn(
        f"{__name__}.{name} moved to {new}; use that (the old path is removed in levanter-core 0.3)",
        DeprecationWarning,
        stacklevel=2,
    )
    return value()


def _git_state(directory: str) -> dict | None:
    """The commit checked out in the git repository holding ``directory``, and whether the
    working tree differs from it; None outside a repository (or without git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status), "root": git("rev-parse", "--show-toplevel")}


def write_run_record(run_dir: str, resolved: dict, config_path: str | None, plugins: dict) -> list[str]:
    """Save the resolved config (``config.yaml``), the code version (``run.json``: git commit of
    the working directory and of levanter itself, versions of every plugin) and the installed
    packages (``requirements.txt``, in ``pip freeze`` form) in the run directory; return the
    three paths."""
    import jax

    os.makedirs(run_dir, exist_ok=True)
    config_file = os.path.join(run_dir, "config.yaml")
    write_text_atomically(config_file, yaml.safe_dump(resolved, sort_keys=False))
    record = {
        "config_file": os.path.abspath(config_path) if config_path else None,
        "command": sys.argv,
        "working_directory": os.getcwd(),
        "git": _git_state(os.getcwd()),
        "levanter_core": __version__,
        "levanter_core_git": _git_state(os.path.dirname(os.path.abspath(__file__))),
        "plugins": plugins,
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "processes": jax.process_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    record_file = os.path.join(run_dir, "run.json")
    write_text_atomically(record_file, json.dumps(record, indent=2))
    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    requirements = os.path.join(run_dir, "requirements.txt")
    write_text_atomically(requirements, "\n".join(packages) + "\n")
    return [config_file, record_file, requirements]


# -- JAX set-up ----------------------------------------------------------------------------


def configure_jax(config: TrainConfig) -> None:
    from levanter_core.trainer import host_memory

    trainer = config.trainer
    if trainer.keep_host_memory:
        host_memory.keep_freed_memory()  # before JAX's first use of its backend starts XLA's threads
    else:
        host_memory.release_freed_memory()

    import jax

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
    from levanter_core import distributed

    distributed.initialize(trainer.distributed)
    if trainer.require_accelerator and jax.default_backend() == "cpu":
        raise ConfigError(
            "trainer.require_accelerator is true, but JAX found no GPU or TPU (its backend is cpu); "
            "run on a machine with one, or set trainer.require_accelerator: false to train on the CPU"
        )


# -- the run -------------------------------------------------------------------------------


def preflight(config: TrainConfig) -> None:
    """Check, before anything starts (no device, no data read), what the config names but this
    environment cannot provide, and what the run would refuse once started: the tokenizer
    (there, and a tokenizer), the data files, batch sizes that do not divide over the replicas
    and microbatches (:mod:`~levanter_core.trainer.checks`), and places the checkpointer or
    the exports cannot reach. Raises a :class:`UserError` naming the field."""
    from levanter_core.data.tokenizer import check_tokenizer_available
    from levanter_core.trainer.checks import check_batch_sizes, check_data_inputs, check_tokenizer

    check_tokenizer_available(config.data.tokenizer)  # a hub tokenizer that cannot be had
    check_tokenizer(config.data.tokenizer)
    check_data_inputs(config.data)
    check_batch_sizes(config.trainer)
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


def run_training(config: TrainConfig, *, config_path: str | None = None, progress: bool = True) -> RunResult:
    """Train as ``config`` says; resume if this run already has a checkpoint.

    In a multi-process run every process calls this with the same config: process 0 writes
    the run record, logs to the trackers, shows progress and builds the data caches; every
    process reads its share of each batch and writes its part of each checkpoint."""
    preflight(config)
    configure_jax(config)
    config = _batch_for_devices(config)
    from levanter_core.trainer.checks import check_batch_sizes
    from levanter_core.trainer.mesh import data_axis_size, make_mesh

    check_batch_sizes(config.trainer, data_axis_size(make_mesh(config.trainer)))  # on this run's devices

    from levanter_core import distributed
    from levanter_core.checkpoint.lock import hold_run_lock
    from levanter_core.data.pipeline import build_lm_data
    from levanter_core.distributed.ray_cluster import ray_for_run
    from levanter_core.trainer.extend import warn_if_restarting

    wall_start = time.perf_counter()
    trainer_cfg = config.trainer
    leader = distributed.is_leader()
    progress = progress and leader  # one progress bar, process 0's
    run_id = agreed_run_id(config, config_path)
    # One trainer per run: a second one stops here, before it touches the run's files.
    lock = hold_run_lock(trainer_cfg.checkpointer.expanded_path(run_id))
    # Under an object-store log_dir, everything is written into a local mirror that is uploaded
    # as the run goes (see run_sync); the mirror starts as a copy of what a resumed run left.
    created = leader and is_local(trainer_cfg.log_dir) and not os.path.exists(os.path.join(trainer_cfg.log_dir, run_id))
    untrained = False  # set when bad data stops a run this attempt created, before it trained
    try:
        directory = RunDirectory.open(trainer_cfg.log_dir, run_id, leader=leader)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        run_dir = directory.path
        resolved, plugins = resolved_config(config), get_manager().versions()
        record_files = write_run_record(run_dir, resolved, config_path, plugins) if leader else []
        directory.flush(required=True)
        logger.info("run %s: run directory %s", run_id, directory.location)
        if leader:
            print(f"run directory: {directory.location}", flush=True)
            if directory.mirrored:
                print(
                    f"  (written to {run_dir} and uploaded every {SYNC_INTERVAL_SECONDS:.0f} s, before each "
                    "checkpoint and at the end)",
                    flush=True,
                )
            for note in levanter_differences(config):
                print(f"note: {note}", flush=True)
            warn_if_restarting(config, resolved, run_id)  # "train longer" names a new run: say so
        if distributed.process_count() > 1:
            print(_describe_processes(), flush=True)
        run = _Run(run_id, directory, resolved, plugins, record_files, wall_start)

        # A multi-process run tokenizes on a Ray cluster over its hosts (trainer.ray); the caches
        # build in the background while the model is set up, and batches wait for them.
        with ray_for_run(trainer_cfg.ray) as ray_config:
            data = build_lm_data(
                config.data,
                seq_len=config.model.seq_len,
                seed=trainer_cfg.seed if config.data_seed is None else config.data_seed,
                initial_batch_size=trainer_cfg.batch_schedule.size_at(0),
                max_epochs=config.epoch,
                offsets=trainer_cfg.batch_schedule.offset_at,
                ray=ray_config,
                progress=progress,
                build=leader,
                field_lengths=_row_lengths(config.model, config),
            )
            try:
                return _train(config, run, data, progress)
            finally:
                data.close()
    except DataError:
        untrained = created
        raise
    finally:
        directory.close()  # the last upload, whether the run succeeded or not
        if lock is not None:
            lock.release()
        if untrained:
            _remove_untrained_run(config, run_id)


def _remove_untrained_run(config: TrainConfig, run_id: str) -> None:
    """Remove what a run that bad data stopped before its first step leaves: its run directory
    (the record of a run that never trained, an empty ``metrics.jsonl``) and its checkpoint
    directory when empty. A run directory with a logged step, or checkpoints, stays."""
    import shutil

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


def _batch_for_devices(config: TrainConfig) -> TrainConfig:
    """``config`` with ``trainer.train_batch_size: -1`` worked out for this run's devices:
    ``per_device_parallelism`` on each data-parallel one (Levanter's meaning)."""
    if config.trainer.train_batch_size != -1:
        return config
    from levanter_core.trainer.mesh import data_axis_size, make_mesh

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
    import jax

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


def _describe_processes() -> str:
    import jax

    return (
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices ({jax.devices()[0].device_kind})"
    )


@dataclasses.dataclass(frozen=True)
class _Run:
    """What identifies a run and was written before training starts."""

    run_id: str
    directory: RunDirectory
    resolved: dict
    plugins: dict
    record_files: list[str]
    wall_start: float


def _row_lengths(model_config, config: TrainConfig | None = None) -> dict[str, int]:
    """What one batch row holds of a format's own arrays for this model (the objective's)."""
    return objective_class(model_config, config).row_lengths(model_config)


def _objective(config: TrainConfig, model_config):
    """The training objective the model type names, built for this run."""
    wanted, planned = _row_lengths(model_config, config), _row_lengths(config.model, config)
    if wanted != planned:
        raise ConfigError(
            f"the model built ({model_config.type}) needs batch rows of {wanted}, but the data was set up for "
            f"{planned} from the model section; make the model section describe the model trained "
            "(use_hf_model_config changes it)"
        )
    return objective_class(model_config, config).from_config(config)


def _train(config: TrainConfig, run: _Run, data, progress: bool) -> RunResult:
    import jax

    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    trainer_cfg = config.trainer
    run_id, run_dir, resolved, plugins = run.run_id, run.directory.path, run.resolved, run.plugins
    model_config, Vocab, hf_directory = _resolve_model(config, data.tokenizer)

    mesh = make_mesh(trainer_cfg)
    num_steps = trainer_cfg.num_train_steps
    optimizer = config.optimizer.build_for_trainer(num_steps)
    trainer = Trainer(
        trainer_cfg,
        optimizer,
        _objective(config, model_config),
        mesh=mesh,
        eval_params=config.optimizer.params_for_evaluation,
    )

    key = jax.random.PRNGKey(trainer_cfg.seed)
    adapt = _adapter_surgery(config, key)

    def base_init(key):
        return model_config.build(Vocab, key=key)

    def model_init(key):
        model = base_init(key)
        return model if adapt is None else adapt(model)

    # The checkpoint describes itself: the architecture actually built (which differs from
    # the config file's under use_hf_model_config) and its vocabulary size.
    checkpoint_config = {**resolved, "model": model_config.model_dump(mode="json")}
    metadata = {"config": checkpoint_config, "plugins": plugins, "run_id": run_id, "vocab_size": Vocab.size}
    base = _lora_base(config, hf_directory, Vocab)
    if base is not None:
        metadata["lora_base"] = base
    checkpointer = trainer_cfg.checkpointer.create(run_id, metadata=metadata)
    load_hf = None
    if hf_directory is not None:

        def load_hf():
            from haliax import Axis

            from levanter_core.hf import load_hf_weights
            from levanter_core.hf.bridge import read_hf_config, resize_vocab
            from levanter_core.hf.checkpoint import HfCheckpoint

            hf_Vocab = Axis("vocab", read_hf_config(hf_directory)["vocab_size"])
            model = load_hf_weights(model_config, hf_Vocab, HfCheckpoint(hf_directory))
            print(f"initialized from Hugging Face model {config.hf_source}", flush=True)
            if hf_Vocab != Vocab and config.resize_vocab_to_match_tokenizer:
                model = resize_vocab(model, model_config, Vocab, key=jax.random.fold_in(key, 1))
                print(
                    f"resized its vocabulary from {hf_Vocab.size} to the tokenizer's {Vocab.size} "
                    "(resize_vocab_to_match_tokenizer)",
                    flush=True,
                )
            elif hf_Vocab != Vocab:  # special tokens were added (_resolve_model refuses any other misfit)
                # as Levanter's sft: the tokenizer's size, new rows at the mean of the existing ones
                model = resize_vocab(model, model_config, Vocab, key=None)
                added = ", ".join(data.tokenizer.added_tokens)
                print(
                    f"added special tokens {added}: the vocabulary goes from {hf_Vocab.size} to {Vocab.size} "
                    "tokens, new embedding and output rows at the mean of the existing rows",
                    flush=True,
                )
            reinit = config.special_tokens.tokens_to_reinit()
            if reinit:
                from levanter_core.models.token_rows import reinitialize_rows, token_ids

                ids = token_ids(data.tokenizer, reinit, field="special_tokens.reinit_tokens")
                model = reinitialize_rows(
                    model, ids, jax.random.fold_in(key, 2),
                    embeddings=config.special_tokens.reinit_embeddings, lm_head=config.special_tokens.reinit_lm_head,
                )  # fmt: skip
                print(f"re-drew the embedding and output rows of {', '.join(reinit)} (reinit_tokens)", flush=True)
            return model if adapt is None else adapt(model)

    trainer.check_sharding(model_init, key)  # a mapping that does not fit the model fails here, before compiling
    trunk = config.initialize_from_checkpoint_path
    if base is not None:
        # A LoRA run's checkpoints hold its adapters; loading one puts them onto the base weights.
        checkpointer = lora.AdapterCheckpoints(
            checkpointer,
            lambda: _initial_state(trainer, trainer_cfg, None, model_init, key, load_hf=load_hf, adapt=adapt)[0],
            base,
        )
    state, resumed_from = _initial_state(
        trainer, trainer_cfg, checkpointer, model_init, key, load_hf=load_hf, trunk=trunk, adapt=adapt
    )
    if config.lora is not None:
        _say_adapters(state.model, base)
    _check_model_takes_packed_data(state.model, config)
    start_step = int(state.step)
    if resumed_from:
        print(f"resumed from {resumed_from} at step {start_step}", flush=True)

    run_info = RunInfo(
        run_id=run_id, run_dir=run_dir, config=resolved, resume_step=start_step if resumed_from else None
    )
    tracker = _make_tracker(config, run_info)
    result = RunResult(run_id, run.directory.location, start_step, start_step)
    status = "success"  # what the trackers are told at the end
    try:
        tracker.log_hyperparameters(resolved)
        for path in run.record_files:
            tracker.log_artifact(path, name=os.path.basename(path), type="run_record")
        flops = model_config.flops_per_token(Vocab.size)  # None: a model that does not count them
        if flops is not None:
            flops *= trainer.objective.flops_scale
        exporter = None
        if config.hf_save_path or config.peft_save_path:
            exporter = HfExporter(config, run_id, model_config, Vocab, data.tokenizer, resolved, hf_directory)
            exporter.check(state.model)
        loop = _TrainLoop(
            config, trainer, data, tracker, checkpointer, run_directory=run.directory, flops_per_token=flops,
            progress=progress, exporter=exporter,
        )  # fmt: skip
        state = loop.run(state, result)
        run.directory.flush()  # every step logged is stored before the last checkpoint exists
        checkpointer.on_step(state, int(state.step), force=True)
        if exporter is not None and exporter.last_step != int(state.step):
            exporter.export(trainer.eval_model(state), int(state.step))
        checkpointer.wait_until_finished()
        result.checkpoint = checkpointer.latest()
        result.wall_seconds = time.perf_counter() - run.wall_start
        tracker.log_summary({k: v for k, v in dataclasses.asdict(result).items() if v is not None})
    except BaseException as error:
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        # The run is failing already; a save still being written is finished, not cut short.
        try:
            checkpointer.wait_until_finished()
        except Exception as e:
            logger.error("the checkpoint being saved when the run failed could not be completed: %s", e)
        raise
    finally:
        finish_tracker(tracker, status)
    return result


def _initial_state(trainer, cfg, checkpointer, model_init, key, *, load_hf=None, trunk: str | None = None, adapt=None):
    """Loaded from this run's newest checkpoint that loads, else from ``initialize_from``,
    else from the whole state of ``trunk`` (``initialize_from_checkpoint_path``), else around the
    weights ``load_hf()`` returns (``initialize_from_hf``), else fresh. ``adapt`` puts a LoRA
    run's adapters onto weights loaded without them. Without a ``checkpointer``: the state a
    run without checkpoints of its own would start from (a LoRA run's base)."""
    from levanter_core.checkpoint import discover_latest, load_checkpoint, read_metadata

    partial = cfg.allow_partial_checkpoint
    lora_run = adapt is not None
    adapt = adapt or (lambda model: model)

    def template():
        # a partial load keeps the fresh values of what the checkpoint lacks, so it needs them
        return trainer.init_state(model_init, key) if partial else trainer.state_template(model_init, key)

    if checkpointer is not None and cfg.load_checkpoint is not False:
        where = cfg.load_checkpoint_path or checkpointer.path
        resumed = (
            checkpointer.resume(template(), where, allow_partial=True)
            if partial
            else checkpointer.resume(template(), where)
        )
        if resumed is not None:
            return resumed
        if cfg.load_checkpoint:
            raise CheckpointError(f"trainer.load_checkpoint is true but there is no complete checkpoint under {where}")
    if cfg.initialize_from:
        found = discover_latest(cfg.initialize_from)
        if found is None:
            raise CheckpointError(f"trainer.initialize_from: no complete checkpoint under {cfg.initialize_from}")
        stored = read_metadata(found)
        if "lora_base" in stored.get("metadata", {}):
            raise CheckpointError(
                f"trainer.initialize_from: {found} holds a LoRA run's adapters, not a model's weights; start "
                "from the base model it names (its config's initialize_from_hf or trainer.initialize_from), or "
                "export it merged first (levanter export-hf)"
            )
        weights_only = not any(leaf["name"].startswith("opt_state/") for leaf in stored["leaves"])
        if weights_only or lora_run:
            # weights alone (e.g. from `levanter import-hf`), or the base of a LoRA run: fresh
            # optimizer, step 0
            import equinox as eqx

            base = eqx.filter_eval_shape(lambda k: lora.base_model(model_init(k)), key)
            model = adapt(load_checkpoint(base, found, subtree="model"))
            return trainer.state_from_model(model, key), None
        return checkpointer.load_state(template(), found, allow_partial=partial), found
    if trunk and checkpointer is not None:
        found = discover_latest(trunk) or trunk
        state = checkpointer.load_state(template(), found, allow_partial=partial)
        print(f"initialized from the training state of {found} (step {int(state.step)})", flush=True)
        return state, None
    if load_hf is not None:
        return trainer.state_from_model(load_hf(), key), None
    return trainer.init_state(model_init, key), None


_LORA_STREAM = 0x10A0
"""Folded into the run's key (``trainer.seed``) for the LoRA adapters' initial values."""


def _adapter_surgery(config: TrainConfig, key):
    """The function that puts the run's LoRA adapters onto a model (``lora``), None without."""
    import jax

    if config.lora is None:
        return None
    adapter_key = jax.random.fold_in(key, _LORA_STREAM)
    return lambda model: lora.loraize(model, config.lora, key=adapter_key)


def _lora_base(config: TrainConfig, hf_directory: str | None, Vocab) -> dict | None:
    """What a LoRA run's checkpoints point to for the base weights (stored in their metadata
    as ``lora_base``): the Hugging Face model of ``initialize_from_hf`` or the checkpoint of
    ``trainer.initialize_from``. None (the checkpoints then hold the whole model) without LoRA,
    or when the base cannot be read back from a source: a model initialized at random, or an
    imported one whose vocabulary the run resized."""
    from levanter_core.checkpoint import discover_latest

    if config.lora is None:
        return None
    if hf_directory is not None:
        from levanter_core.hf.bridge import read_hf_config

        if read_hf_config(hf_directory).get("vocab_size") != Vocab.size:
            return None
        return {"initialize_from_hf": config.hf_source}
    if config.trainer.initialize_from:
        found = discover_latest(config.trainer.initialize_from)
        return {"initialize_from": found} if found else None
    return None


def _say_adapters(model, base: dict | None) -> None:
    total, trained = lora.count_parameters(model), lora.count_parameters(lora.adapter_params(model))
    where = "point to the base weights" if base else "hold the whole model (its base has no source to point to)"
    print(
        f"LoRA: training {trained:,} adapter parameters of {total:,} ({trained / total:.2%}); checkpoints {where}",
        flush=True,
    )


def _with_run_settings(hf_model, model):
    """``hf_model`` (the architecture read from ``config.json``) with ``model``'s run settings."""
    given = model.model_fields_set | {"seq_len"}
    settings = [name for name in type(model).run_settings if name in given and name in type(hf_model).model_fields]
    update = {name: getattr(model, name) for name in settings}
    return hf_model.model_copy(update=update)


def _resolve_model(config: TrainConfig, tokenizer):
    """The model config to build, its vocabulary axis, and the Hugging Face directory to
    initialize from (None without ``initialize_from_hf``). The vocabulary is the
    tokenizer's, or that of the weights the run starts from, which may be larger.

    A tokenizer that does not fit the Hugging Face checkpoint stops the run here, before
    anything is built, unless ``resize_vocab_to_match_tokenizer`` asks for the checkpoint's
    vocabulary to be resized to the tokenizer's. A tokenizer grown by ``special_tokens`` (whose
    other ids must match the checkpoint's) makes the vocabulary the tokenizer's size."""
    from haliax import Axis

    from levanter_core.checkpoint import discover_latest, read_metadata

    model_config, vocab_size, directory, origin = config.model, tokenizer.vocab_size, None, None
    if config.initialize_from_hf:
        from levanter_core.hf.bridge import check_tokenizer_fits, config_from_hf, read_hf_config, resolve_source

        directory = resolve_source(config.hf_source)
        hf_config = read_hf_config(directory)
        if config.use_hf_model_config:
            model_config = _with_run_settings(config_from_hf(hf_config), config.model)
        vocab_size, origin = hf_config.get("vocab_size"), "initialize_from_hf"
        if not isinstance(vocab_size, int):
            raise CheckpointError(f"initialize_from_hf: {directory}/config.json has no integer vocab_size")
        if config.special_tokens.reinit_tokens:  # refused here, before anything is built
            from levanter_core.models.token_rows import token_ids

            token_ids(tokenizer, config.special_tokens.tokens_to_reinit(), field="special_tokens.reinit_tokens")
        if config.resize_vocab_to_match_tokenizer:
            return model_config, Axis("vocab", tokenizer.vocab_size), directory
        if getattr(tokenizer, "added_tokens", ()):
            # special_tokens added some: the model takes the tokenizer's size, as in Levanter's sft
            # (rows past the checkpoint's end are added, padding rows past the tokenizer's end dropped)
            check_tokenizer_fits(directory, max(vocab_size, tokenizer.vocab_size), tokenizer, source=config.hf_source)
            return model_config, Axis("vocab", tokenizer.vocab_size), directory
        check_tokenizer_fits(directory, vocab_size, tokenizer, source=config.hf_source)
    elif config.trainer.initialize_from and (found := discover_latest(config.trainer.initialize_from)):
        # the vocabulary of the weights we start from (an import keeps its model's padded size)
        vocab_size = read_metadata(found).get("metadata", {}).get("vocab_size", vocab_size)
        origin = "trainer.initialize_from"
    if not isinstance(vocab_size, int) or vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"{origin}: the model's vocabulary ({vocab_size}) is smaller than the tokenizer's "
            f"({tokenizer.vocab_size}, data.tokenizer: {tokenizer.name}); use the model's own tokenizer"
        )
    return model_config, Axis("vocab", vocab_size), directory


def _check_model_takes_packed_data(model, config: TrainConfig) -> None:
    """Packed data (chat, supervised) needs a model whose ``activations`` accept an
    ``attn_mask``, or examples would attend to each other: say so before compiling."""
    import inspect

    packed = [name for name, source in config.data.configs.items() if source.format.packed]
    if packed and "attn_mask" not in inspect.signature(model.activations).parameters:
        raise ConfigError(
            f"model.type {config.model.type!r} cannot train on packed data ({config.data.field_of(packed[0])}.format "
            f"is {config.data.configs[packed[0]].format.type!r}): its activations() takes no attn_mask, so the "
            "examples packed into a sequence would attend to each other"
        )


def _make_tracker(config: TrainConfig, info: RunInfo):
    """The run's trackers; in a multi-process run only process 0 has them (the others log nothing)."""
    from levanter_core import distributed
    from levanter_core.tracker import CompositeTracker, NoopTracker

    if not distributed.is_leader():
        return NoopTracker()
    trackers = [t.init(info) for t in config.trainer.tracker]
    return trackers[0] if len(trackers) == 1 else CompositeTracker(trackers)


def _run_subdirectory(path: str | None, run_id: str) -> str | None:
    if not path:
        return None
    return os.path.join(os.path.expanduser(path), run_id) if is_local(path) else join(path, run_id)


class HfExporter:
    """Hugging Face exports during training (``hf_save_path``, ``hf_save_steps``, ``hf_upload``,
    ``hf_save_dtype``): the model evaluation uses, as ``levanter export-hf`` would write it, to
    ``{hf_save_path}/{run_id}/step-N/``, a local directory or an object-store URL (written
    locally first, then uploaded, its safetensors index last)."""

    _DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}

    def __init__(self, config: TrainConfig, run_id: str, model_config, Vocab, tokenizer, resolved: dict, hf_directory):
        from levanter_core.hf.bridge import read_hf_config

        self.config, self.model_config, self.Vocab, self.tokenizer = config, model_config, Vocab, tokenizer
        self.run_id = run_id
        self.directory = _run_subdirectory(config.hf_save_path, run_id)
        self.peft_directory = _run_subdirectory(config.peft_save_path, run_id)
        self.resolved = resolved
        self.imported = read_hf_config(hf_directory) if hf_directory else None
        dtype = config.hf_save_dtype or "float32"
        self.dtype = self._DTYPES.get(dtype, dtype)
        self.last_step: int | None = None

    def check(self, model=None) -> None:
        """Refuse, before training, a model that has no Hugging Face form, or (``model``, with
        ``peft_save_path``) adapters that have no PEFT form."""
        import jax

        from levanter_core.hf.convert import HfConvertible

        if self.peft_directory is not None and model is not None and jax.process_count() == 1:
            from levanter_core.hf.peft import check_peft_form

            try:
                check_peft_form(model)
            except CheckpointError as e:
                raise ConfigError(f"peft_save_path: {e}") from None
        if not self.config.hf_save_path:
            return
        if not isinstance(self.model_config, HfConvertible):
            raise ConfigError(f"hf_save_path: model type {self.model_config.type!r} has no Hugging Face form to save")
        try:
            self.model_config.to_hf_config(self.Vocab.size)
        except ValueError as e:
            raise ConfigError(f"hf_save_path: the model cannot be saved in Hugging Face form: {e}") from None

    def export(self, model, step: int) -> str:
        import jax
        from jax.experimental import multihost_utils

        from levanter_core import distributed
        from levanter_core.hf.bridge import local_output, write_hf_model
        from levanter_core.hf.checkpoint import upload_hf_directory

        if jax.process_count() > 1:  # every process holds a part; process 0 writes the whole
            model = multihost_utils.process_allgather(model, tiled=True)
        self.last_step = step
        if self.peft_directory is not None and distributed.is_leader():
            self._export_peft(model, step)
        if self.directory is None:
            return None
        output = join(self.directory, f"step-{step}")
        if not distributed.is_leader():
            return output
        with local_output(output) as written:
            write_hf_model(
                model, self.model_config, self.Vocab, written, run_config=self.resolved,
                imported_hf_config=self.imported, tokenizer=self.tokenizer, dtype=self.dtype,
            )  # fmt: skip
            if not is_local(output):
                upload_hf_directory(written, output)
            print(f"saved the model in Hugging Face form to {output}", flush=True)
            if self.config.hf_upload:
                self._upload(written, step, self.config.hf_upload, "hf_upload")
        return output

    def _export_peft(self, model, step: int) -> None:
        """The adapters as a PEFT adapter directory ``{peft_save_path}/{run_id}/step-N``."""
        from levanter_core.hf.bridge import _write_tokenizer, local_output
        from levanter_core.hf.checkpoint import upload_hf_directory
        from levanter_core.hf.peft import task_type_of, write_peft_adapter

        output = join(self.peft_directory, f"step-{step}")
        with local_output(output) as written:
            write_peft_adapter(
                model, self.config.lora, written, base_model_name_or_path=self.config.hf_source,
                task_type=task_type_of(self.model_config, self.Vocab.size),
            )  # fmt: skip
            _write_tokenizer((), self.resolved, written, self.tokenizer)
            if not is_local(output):
                upload_hf_directory(written, output)
            print(f"saved the LoRA adapters in PEFT form to {output}", flush=True)
            if self.config.peft_hf_upload:
                self._upload(written, step, self.config.peft_hf_upload, "peft_hf_upload")

    def _upload(self, written: str, step: int, repo: str, field: str) -> None:
        """Send the export in the local directory ``written`` to the hub repository ``repo``
        (the config's ``field``)."""
        from huggingface_hub import upload_folder

        try:
            upload_folder(repo_id=repo, folder_path=written, commit_message=f"step {step} of {self.run_id}")
            print(f"uploaded step {step} to the Hugging Face hub repository {repo}", flush=True)
        except Exception as e:  # the network or the hub; the export on disk stands, training goes on
            logger.error("%s: could not upload %s to %s: %s", field, written, repo, e)
            print(f"{field}: could not upload step {step} to {repo}: {e}", flush=True)


class _Profile:
    """The JAX profiler trace of ``trainer.profiler``: steps ``profiler_start_step`` to
    ``profiler_start_step + profiler_num_steps - 1`` (fewer if the run ends first), written to
    ``{run_dir}/profiler/``."""

    def __init__(self, trainer_cfg, run_dir: str):
        self.on = trainer_cfg.profiler
        self.first = trainer_cfg.profiler_start_step
        self.last = trainer_cfg.profiler_start_step + trainer_cfg.profiler_num_steps - 1
        self.perfetto = trainer_cfg.profiler_perfetto_link
        self.directory = os.path.join(run_dir, "profiler")
        self.active = False

    def before_step(self, index: int) -> None:
        if self.on and not self.active and self.first <= index <= self.last:
            import jax

            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=self.perfetto)
            self.active = True
            print(f"profiling steps {index + 1} to {self.last + 1} into {self.directory}", flush=True)

    def after_step(self, index: int, metrics) -> None:
        if self.active and index >= self.last:
            import jax

            jax.block_until_ready(metrics)
            self.stop()

    def stop(self) -> None:
        if not self.active:
            return
        import jax

        jax.profiler.stop_trace()
        self.active = False
        print(f"profiler trace written to {self.directory}", flush=True)
        if self.perfetto:
            traces = [
                os.path.join(root, name)
                for root, _, names in os.walk(self.directory)
                for name in names
                if name.startswith("perfetto_trace")
            ]
            if traces:
                print(f"Perfetto trace (open it at ui.perfetto.dev): {max(traces, key=os.path.getmtime)}", flush=True)


class _TrainLoop:
    """Steps, logging, evaluation and checkpoints; metrics are fetched one step late."""

    def __init__(
        self,
        config: TrainConfig,
        trainer,
        data,
        tracker,
        checkpointer,
        *,
        run_directory: RunDirectory,
        flops_per_token: float | None,
        progress: bool,
        exporter: HfExporter | None = None,
    ):
        import jax
        import numpy as np

        self.config = config
        self.run_directory = run_directory
        self.run_dir = run_directory.path
        self.trainer = trainer
        self.data = data
        self.tracker = tracker
        self.checkpointer = checkpointer
        self.progress = progress
        self.num_steps = config.trainer.num_train_steps
        # Every step's learning rate, computed once on the host's side of the loop: evaluating the
        # schedule (a JAX computation) per step would queue it behind the step in flight, and the
        # loop would wait for that step before dispatching the next.
        schedule = config.optimizer.lr_scheduler(self.num_steps)
        self.learning_rates = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(self.num_steps)), np.float64)
        self.batches = config.trainer.batch_schedule
        # the tokens of a batch row: its sequences' (a preference pair holds two)
        self.row_tokens = config.model.seq_len * trainer.objective.sequences_per_row
        self.tokens_per_step = trainer.plan.batch_size * self.row_tokens
        self.flops_per_token = flops_per_token
        self._evaluators: list = []  # the plugins' (evaluator, every), built when the loop starts
        self._eval_constants_found: tuple | None = None  # the objective's, for evaluation
        self.reference = None  # the state's reference model (objectives that keep one), set by run()
        self.entropy_fn = None
        if config.log_entropy:
            from levanter_core.models.lm import lm_eval_entropy

            self.entropy_fn = lm_eval_entropy
        self.profile = _Profile(config.trainer, self.run_dir)
        self.exporter = exporter

    def evaluate(self, model) -> dict[str, float]:
        """The objective's metrics of every validation set, their averages, and those of each
        tag (for language modelling loss and bits per byte, see
        :func:`levanter_core.trainer.evaluators.eval_metrics`); the entropy too with
        ``log_entropy``. Empty without validation data."""
        from levanter_core.data.dataset import eval_batches

        size, limit = self.trainer.plan.eval_batch_size, self.trainer.config.max_eval_batches
        rows = self.trainer.local_rows(self.trainer.EvalBatch)
        totals, entropies = {}, {}
        for name, dataset in self.data.validation.items():
            batches = eval_batches(dataset, size, limit, rows=rows)
            found = self.trainer.evaluate_totals(model, batches, *self._eval_constants(model), reference=self.reference)
            if found is None:
                continue
            totals[name] = found
            if self.entropy_fn is not None:
                batches = eval_batches(dataset, size, limit, rows=rows)
                entropies[name] = self.trainer.evaluate(model, batches, fn=self.entropy_fn)
        if not totals:
            return {}
        metrics = self.trainer.objective.eval_metrics(totals, self._tags(), per_set=self.config.data.is_mixture)
        if entropies:
            # weighed by tokens, as the loss is
            tokens = {name: totals[name][1] for name in entropies}

            def mean(names):
                return sum(entropies[n] * tokens[n] for n in names) / max(sum(tokens[n] for n in names), 1.0)

            metrics["eval/entropy"] = mean(entropies)
            if self.config.data.is_mixture:
                metrics.update({f"eval/{name}/entropy": value for name, value in entropies.items()})
            for tag, names in self._tags().items():
                names = [n for n in names if n in entropies]
                if names:
                    metrics[f"eval/{tag}/entropy"] = mean(names)
        return metrics

    def _eval_constants(self, model) -> tuple:
        """What the objective's evaluation needs besides each batch (computed once)."""
        if self._eval_constants_found is None:
            self._eval_constants_found = self.trainer.objective.eval_constants(model, self.data.tokenizer)
        return self._eval_constants_found

    def _tags(self) -> dict[str, list[str]]:
        """Each ``tags`` entry of the data sources, with the sources that carry it."""
        tags: dict[str, list[str]] = {}
        for name, source in self.config.data.configs.items():
            for tag in source.tags or []:
                if tag != name:
                    tags.setdefault(tag, []).append(name)
        return tags

    def sample_texts(self, model) -> dict[str, str]:
        """``trainer.sample``'s prompts continued by ``model``, as text metrics."""
        import haliax as hax

        from levanter_core.trainer.samples import sample_texts

        with hax.partitioning.set_mesh(self.trainer.mesh):
            return sample_texts(model, self.data.tokenizer, self.trainer.config.sample, seq_len=model.config.seq_len)

    def draw_viz(self, model, step: int) -> None:
        """The token log-probability heatmap of ``trainer.viz`` for ``step``, written to the
        run directory and sent to the trackers."""
        import haliax as hax
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        from levanter_core.data.dataset import eval_batches
        from levanter_core.trainer.viz import token_log_probs, write_heatmap

        viz = self.trainer.config.viz
        if not self.data.validation:
            return
        dataset = next(iter(self.data.validation.values()))
        batch = next(eval_batches(dataset, self.trainer.plan.eval_batch_size, 1))
        with hax.partitioning.set_mesh(self.trainer.mesh):
            scores = token_log_probs(model, self.trainer.to_device(batch, self.trainer.EvalBatch))
        scores = np.asarray(multihost_utils.process_allgather(scores, tiled=True))  # every process computes a part
        if jax.process_index() != 0:
            return
        rows = slice(0, viz.num_sequences)
        path = write_heatmap(self.run_dir, step, self.data.tokenizer, batch.tokens[rows], scores[rows], viz.max_tokens)
        self.tracker.log_artifact(path, name=f"viz/step-{step}.html", type="viz")

    def data_metrics(self) -> dict[str, float]:
        """How far the training caches still being built have got
        (``data/<source>/train_documents_cached``), and the bad records skipped so far
        (``data/skipped/<source>/<split>``)."""
        building = self.data.building()
        metrics = {f"data/{name}/train_documents_cached": cache.num_documents for name, cache in building.items()}
        metrics.update({f"data/skipped/{where}": n for where, n in self.data.skipped().items()})
        return metrics

    def run(self, state, result: RunResult):
        import jax
        from tqdm.auto import tqdm

        from levanter_core.errors import DataExhausted
        from levanter_core.trainer.trainer import Prefetcher, Throughput

        start = int(state.step)
        if start >= self.num_steps:
            print(f"run already complete: step {start} of {self.num_steps}", flush=True)
            return state

        # The first batches are read (waiting for the cache where needed) while the step compiles.
        prefetch = Prefetcher(self._read_batch, start, self.num_steps)
        try:
            # A plugin's evaluator that cannot be built (an unknown task, say) stops the run
            # before the first step, not when it is first due.
            self._build_evaluators()
            first_size = self.batches.size_at(start)
            self.trainer.compile_ahead(state, self.data.train.template(first_size), first_size)
            self.reference = state.reference
            if start == 0:
                initial = self.evaluate(self.trainer.eval_model(state))
                if initial:
                    result.initial_eval_loss = initial["eval/loss"]
                    self.tracker.log(initial, step=0)
        except BaseException:
            prefetch.close()
            self._close_evaluators()
            raise
        throughput = Throughput(self.tokens_per_step)
        self.throughput = throughput
        bar = tqdm(
            total=self.num_steps,
            initial=start,
            unit="step",
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
        )
        pending: dict[str, Any] | None = None
        steps_per_eval = self.trainer.config.steps_per_eval
        try:
            carried: dict[str, Any] = {}  # logged with the next step
            for _ in range(start, self.num_steps):
                try:
                    index, batch = prefetch.get()
                except DataExhausted as e:
                    print(f"ending the run early: {e.message}", flush=True)
                    if pending is not None:
                        last = pending["step"]
                        if last % steps_per_eval and last != self.num_steps:  # not evaluated yet
                            evaluated = self.evaluate(self.trainer.eval_model(state))
                            pending.setdefault("host", {}).update(evaluated)
                            if evaluated:
                                result.final_eval_loss = evaluated["eval/loss"]
                    result.ended_early = e.message
                    break
                if index == start:
                    self._say_if_still_building()
                self.profile.before_step(index)
                state, metrics = self.trainer.train_step(state, batch, self.batches.size_at(index))
                self.reference = state.reference  # (the step takes the state's buffers, its reference's too)
                self.profile.after_step(index, metrics)
                if pending is not None:
                    self._finish(pending, throughput, bar, result)
                step = index + 1
                pending, carried = {"step": step, "device": metrics, **carried}, {}
                evaluating = step % steps_per_eval == 0 or step == self.num_steps
                saving = step < self.num_steps and self.checkpointer.due(step)  # the caller forces the final save
                viz = self.trainer.config.viz
                drawing = viz is not None and (step % viz.interval == 0 or step == self.num_steps)
                exporting = self.exporter is not None and step % self.config.hf_save_steps == 0
                samples = self.trainer.config.sample
                sampling = samples is not None and (step % samples.interval == 0 or step == self.num_steps)
                plugin_evals = self._evaluators_due(step, evaluating)
                if evaluating or saving or drawing or exporting or sampling or plugin_evals:
                    # Let the step finish first, so that its time is not mistaken for evaluation's.
                    jax.block_until_ready(metrics)
                throughput.pause()  # what follows is not training; its time is left out of the step's
                pending["host"] = self.data_metrics()
                if drawing:
                    self.draw_viz(self.trainer.eval_model(state), step)
                if sampling:
                    pending["host"].update(self.sample_texts(self.trainer.eval_model(state)))
                if evaluating:
                    evaluated = self.evaluate(self.trainer.eval_model(state))
                    pending["host"].update(evaluated)
                    if evaluated:
                        result.final_eval_loss = evaluated["eval/loss"]
                for evaluator in plugin_evals:
                    pending["host"].update(evaluator.evaluate(self.trainer.eval_model(state), step))
                if exporting:
                    self.exporter.export(self.trainer.eval_model(state), step)
                if saving:
                    # The step is logged before its checkpoint can exist, so that a run resumed
                    # from that checkpoint has logged every step it does not train again.
                    self._finish(pending, throughput, bar, result)
                    pending = None
                    self.run_directory.flush()  # and stored, for a run directory on an object store
                    self.checkpointer.on_step(state, step)
                    carried["checkpoint/save_blocked_seconds"] = self.checkpointer.last_save_blocked_seconds
                else:
                    self.checkpointer.check_for_errors()  # a background save that failed stops the run
                throughput.resume()
            if pending is not None:
                self._finish(pending, throughput, bar, result)
        finally:
            self.profile.stop()
            prefetch.close()
            bar.close()
            self._close_evaluators()
        if throughput.step_times:
            times = sorted(throughput.step_times)
            result.tokens_per_second = self.tokens_per_step / times[len(times) // 2]
        return state

    def _build_evaluators(self) -> None:
        """Build the plugins' evaluators (``evaluators``, ``eval_harness``) of the config."""
        from levanter_core.trainer.evaluators import EvaluatorContext

        plan = self.config.run_evaluators()
        if plan:
            context = EvaluatorContext(self.data.tokenizer, self.trainer, self.run_dir, self.config.model.seq_len)
            for cfg, every in plan:
                self._evaluators.append((cfg.build(context), every))

    def _close_evaluators(self) -> None:
        for evaluator, _ in self._evaluators:
            evaluator.close()
        self._evaluators = []

    def _evaluators_due(self, step: int, evaluating: bool) -> list:
        """The plugins' evaluators to run after ``step``."""
        from levanter_core.trainer.evaluators import due

        return [
            evaluator
            for evaluator, every in self._evaluators
            if (evaluating if every is None else due(step, every, self.num_steps))
        ]

    def _read_batch(self, step: int):
        """Step ``step``'s batch (this process's rows of it): the sequences after those of the
        steps before it, however many ``trainer.train_batch_size``'s schedule gave them."""
        size = self.batches.size_at(step)
        rows = self.trainer.local_rows(self.trainer.batch_axis(size))  # this process reads its share only
        return self.data.train.batch(step, size, rows, start=self.batches.offset_at(step))

    def _say_if_still_building(self) -> None:
        building = self.data.building()
        if building:
            ready = ", ".join(f"{name}: {c.num_documents:,} documents" for name, c in building.items())
            print(f"training starts while the training data is still being tokenized ({ready} so far)", flush=True)

    def _finish(self, pending: dict, throughput, bar, result: RunResult) -> None:
        from levanter_core.trainer.watch import host_value, is_watch_metric

        step = pending["step"]
        watch = self.trainer.config.watch
        watching = watch is not None and step % watch.interval == 0
        metrics = {
            name: host_value(value) if is_watch_metric(name) else float(value)
            for name, value in pending["device"].items()
            if watching or not is_watch_metric(name)
        }
        self.trainer.check_finite(metrics["train/loss"], step)
        metrics["optim/learning_rate"] = float(self.learning_rates[step - 1])
        throughput.tokens_per_step = self.batches.size_at(step - 1) * self.row_tokens
        rate = throughput.tick()
        if rate is not None:
            metrics["throughput/tokens_per_second"] = rate
            if self.flops_per_token:
                metrics["throughput/model_gflops_per_second"] = rate * self.flops_per_token / 1e9
        if len(self.batches.stages) > 1:
            metrics["train/batch_size"] = self.batches.size_at(step - 1)
        metrics.update(pending.get("host", {}))
        if "checkpoint/save_blocked_seconds" in pending:
            metrics["checkpoint/save_blocked_seconds"] = pending["checkpoint/save_blocked_seconds"]
        self.tracker.log(metrics, step=step)
        if result.first_loss is None:
            result.first_loss = metrics["train/loss"]
        result.last_loss = metrics["train/loss"]
        result.final_step = step
        postfix = {"loss": f"{metrics['train/loss']:.3f}"}
        if rate is not None:
            postfix["tok/s"] = f"{rate:,.0f}"
        if "eval/loss" in metrics:
            postfix["eval"] = f"{metrics['eval/loss']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - bar.n)
