"""The path of one training run, from a validated config to the final checkpoint.

``run_training`` is what ``levanter train`` calls; each step below is a function of its own
module in :mod:`levanter_core.run`:

    preflight, JAX and processes (setup) -> run id, lock and run directory (record)
    -> data (tokenized caches, built in the background) -> mesh, model config, objective,
    optimizer (initial) -> fresh or resumed state (initial) -> trackers (setup)
    -> the train loop and its step callbacks (loop, callbacks) -> final checkpoint,
    export (export) and summary
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax

from levanter_core import distributed, lora
from levanter_core.checkpoint.lock import hold_run_lock
from levanter_core.config.train import TrainConfig
from levanter_core.data.pipeline import build_lm_data, caches_complete
from levanter_core.distributed.ray_cluster import ray_for_run
from levanter_core.errors import DataError
from levanter_core.fileio import is_local
from levanter_core.layers.pipeline import bubble_fraction, default_microbatches
from levanter_core.plan.estimate import check_fits
from levanter_core.plugins import get_manager
from levanter_core.run.export import HfExporter
from levanter_core.run.initial import (
    FrozenAside,
    adapter_surgery,
    build_objective,
    check_model_takes_packed_data,
    hf_loader,
    initial_state,
    lora_base,
    resolve_model,
    row_lengths,
    say_adapters,
)
from levanter_core.run.loop import TrainLoop
from levanter_core.run.record import agreed_run_id, resolved_config, write_run_record
from levanter_core.run.result import RunFiles, RunResult
from levanter_core.run.setup import (
    batch_for_devices,
    configure_jax,
    describe_processes,
    levanter_differences,
    make_tracker,
    preflight,
    remove_untrained_run,
)
from levanter_core.tracker.base import RunInfo, RunStatus, finish_tracker
from levanter_core.trainer.batch_plan import BatchPlan
from levanter_core.trainer.checks import (
    check_batch_sizes,
    check_context_split,
    check_expert_split,
    check_pipeline_split,
)
from levanter_core.trainer.extend import warn_if_restarting
from levanter_core.trainer.mesh import data_axis_size, make_mesh
from levanter_core.trainer.mesh_config import STAGE_AXIS
from levanter_core.trainer.run_sync import SYNC_INTERVAL_SECONDS, RunDirectory
from levanter_core.trainer.trainer import Trainer

logger = logging.getLogger("levanter_core.trainer.run")


def run_training(config: TrainConfig, *, config_path: str | None = None, progress: bool = True) -> RunResult:
    """Train as ``config`` says; resume if this run already has a checkpoint.

    In a multi-process run every process calls this with the same config: process 0 writes
    the run record, logs to the trackers, shows progress and builds the data caches; every
    process reads its share of each batch and writes its part of each checkpoint."""
    preflight(config)
    configure_jax(config)
    config = batch_for_devices(config)

    mesh = make_mesh(config.trainer)
    check_batch_sizes(config.trainer, data_axis_size(mesh))  # on this run's devices
    check_context_split(config.trainer, config.train_length, dict(mesh.shape))
    check_expert_split(config.trainer, config.model, dict(mesh.shape))
    check_pipeline_split(config.trainer, config.model, dict(mesh.shape), data_axis_size(mesh))
    describe_pipeline(config, mesh)

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
            print(describe_processes(), flush=True)
        run = RunFiles(run_id, directory, resolved, plugins, record_files, wall_start)

        # A multi-process run tokenizes on a Ray cluster over its hosts (trainer.ray), unless its
        # caches are already built (a resumed run); the caches build in the background while the
        # model is set up, and batches wait for them.
        with ray_for_run(trainer_cfg.ray, tokenizes=lambda: not caches_complete(config.data)) as ray_config:
            data = build_lm_data(
                config.data,
                seq_len=config.train_length,
                seed=trainer_cfg.seed if config.data_seed is None else config.data_seed,
                initial_batch_size=trainer_cfg.batch_schedule.size_at(0),
                max_epochs=config.epoch,
                offsets=trainer_cfg.batch_schedule.offset_at,
                ray=ray_config,
                progress=progress,
                build=leader,
                field_lengths=row_lengths(config.model, config),
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
            remove_untrained_run(config, run_id)


def _train(config: TrainConfig, run: RunFiles, data, progress: bool) -> RunResult:
    trainer_cfg = config.trainer
    run_id, run_dir, resolved, plugins = run.run_id, run.directory.path, run.resolved, run.plugins
    model_config, Vocab, hf_directory = resolve_model(config, data.tokenizer)

    mesh = make_mesh(trainer_cfg)
    num_steps = trainer_cfg.num_train_steps
    optimizer = config.optimizer.build_for_trainer(num_steps)
    trainer = Trainer(
        trainer_cfg,
        optimizer,
        build_objective(config, model_config),
        mesh=mesh,
        eval_params=config.optimizer.params_for_evaluation,
    )

    key = jax.random.PRNGKey(trainer_cfg.seed)
    adapt = adapter_surgery(config, key)
    if trainer_cfg.plan_check:  # before anything of the model is allocated
        check_fits(config, model_config=model_config, Vocab=Vocab, objective=trainer.objective, adapt=adapt)

    def base_init(key):
        return model_config.build(Vocab, key=key)

    def model_init(key):
        model = base_init(key)
        return model if adapt is None else adapt(model)

    # The checkpoint describes itself: the architecture actually built (which differs from
    # the config file's under use_hf_model_config) and its vocabulary size.
    checkpoint_config = {**resolved, "model": model_config.model_dump(mode="json")}
    metadata = {"config": checkpoint_config, "plugins": plugins, "run_id": run_id, "vocab_size": Vocab.size}
    base = lora_base(config, hf_directory, Vocab)
    if base is not None:
        metadata["lora_base"] = base
    checkpointer = trainer_cfg.checkpointer.create(run_id, metadata=metadata)
    load_hf = None
    if hf_directory is not None:
        load_hf = hf_loader(config, model_config, Vocab, hf_directory, data.tokenizer, key, adapt)

    trainer.check_sharding(model_init, key)  # a mapping that does not fit the model fails here, before compiling
    trunk = config.initialize_from_checkpoint_path
    if base is not None:
        # A LoRA run's checkpoints hold its adapters; loading one puts them onto the base weights.
        checkpointer = lora.AdapterCheckpoints(
            checkpointer,
            lambda: initial_state(trainer, trainer_cfg, None, model_init, key, load_hf=load_hf, adapt=adapt)[0],
            base,
        )
    frozen = trainer.load_frozen(Vocab)  # the objective's own frozen model (a teacher), never checkpointed
    if frozen is not None:
        checkpointer = FrozenAside(checkpointer)
    state, resumed_from = initial_state(
        trainer, trainer_cfg, checkpointer, model_init, key, load_hf=load_hf, trunk=trunk, adapt=adapt
    )
    if frozen is not None:
        state = trainer.with_frozen(state, frozen)
    if config.lora is not None:
        say_adapters(state.model, base)
    check_model_takes_packed_data(state.model, config)
    start_step = int(state.step)
    if resumed_from:
        print(f"resumed from {resumed_from} at step {start_step}", flush=True)

    run_info = RunInfo(
        run_id=run_id, run_dir=run_dir, config=resolved, resume_step=start_step if resumed_from else None
    )
    tracker = make_tracker(config, run_info)
    result = RunResult(run_id, run.directory.location, start_step, start_step)
    status: RunStatus = "success"  # what the trackers are told at the end
    try:
        tracker.log_hyperparameters(resolved)
        for path in run.record_files:
            tracker.log_artifact(path, name=os.path.basename(path), type="run_record")
        # None: a model that does not count them. Attention's cost is that of the trained length.
        trained = (
            model_config
            if config.train_seq_len is None
            else model_config.model_copy(update={"seq_len": config.train_length})
        )
        flops = trained.flops_per_token(Vocab.size)
        if flops is not None:
            flops *= trainer.objective.flops_scale
        exporter = None
        if config.hf_save_path or config.peft_save_path:
            exporter = HfExporter(config, run_id, model_config, Vocab, data.tokenizer, resolved, hf_directory)
            exporter.check(state.model)
        loop = TrainLoop(
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


def describe_pipeline(config: TrainConfig, mesh) -> None:
    """Log a pipeline's shape and its bubble, where ``trainer.mesh`` splits the layers into stages."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages == 1 or config.trainer.resolved_mesh.compute_axis_mapping().get("layers") != STAGE_AXIS:
        return
    data_parallel = data_axis_size(mesh)
    batch = config.trainer.batch_schedule.sizes[0]
    rows = BatchPlan.from_config(config.trainer, data_parallel, batch).microbatch_size // data_parallel
    count = config.trainer.pipeline_microbatches or default_microbatches(stages, rows)
    repeats = config.trainer.pipeline_repeats
    circular, formula = (f", circular in {repeats} rounds", "R M") if repeats > 1 else ("", "M")
    logger.info(
        "pipeline parallelism: %d stages, %d microbatch(es) of %d row(s) per data-parallel group%s: the stages idle "
        "%.0f%% of each step (the bubble, (S - 1) / (%s + S - 1))",
        stages, count, rows // count, circular, 100 * bubble_fraction(stages, count, repeats), formula,
    )  # fmt: skip
