"""What ``levanter eval-harness`` does (its options are in :mod:`levanter_eval_harness.plugin`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from levanter_core.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16


def split_source(words: Sequence[str]) -> tuple[str | None, list[str]]:
    """SOURCE (the first word that is neither an option nor an option's value) and the rest, in
    order: ``["--checkpoint_path", "m", "s"]`` -> ``("s", ["--checkpoint_path", "m"])``."""
    source, rest, i = None, [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            rest.append(word)
            if "=" not in word and i + 1 < len(words):
                rest.append(words[i + 1])
                i += 1
        elif source is None:
            source = word
        else:
            rest.append(word)
        i += 1
    return source, rest


def run_command(
    source: str | None,
    *,
    args: Sequence[str] = (),
    tasks: str | None = None,
    include_path: Sequence[str] | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool | None = None,
    log_samples: bool = False,
    output_path: str | None = None,
    batch_size: int | None = None,
    max_length: int | None = None,
    max_gen_toks: int | None = None,
    tokenizer: str | None = None,
    seed: int | None = None,
    bootstrap_iters: int | None = None,
    confirm_run_unsafe_code: bool = False,
    config: str | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    out=print,
) -> dict | None:
    """Evaluate and write the results (see the command's help). Every process of a multi-process
    run calls it; process 0 returns lm-eval's results, the others None."""
    from levanter_core.trainer.config import DistributedConfig, TrainerConfig
    from levanter_eval_harness.config import load_main_config
    from levanter_eval_harness.harness import HarnessRun

    main = None
    if config is not None:
        main = load_main_config(config, list(args))
    elif args:
        raise ConfigError(f"unknown option {args[0]!r} (dotted overrides need --config); see --help")
    harness = main.eval_harness if main is not None else None

    source = source or (main.checkpoint_path if main is not None else None)
    if source is None:
        raise ConfigError("name the model to evaluate: SOURCE (or checkpoint_path in the --config file)")
    if tasks is not None:
        task_specs: list = [t.strip() for t in tasks.split(",") if t.strip()]
        if not task_specs:
            raise ConfigError("--tasks names no task")
    elif harness is not None:
        task_specs = list(harness.task_spec)
    else:
        raise ConfigError("name the tasks to run: --tasks T[,T] (or eval_harness.task_spec in a --config file)")
    if output_path is None:
        raise ConfigError("name where to write the results: --output-path OUT")
    if limit is not None and limit >= 1 and limit != int(limit):
        raise ConfigError(f"--limit {limit}: a number of examples must be whole (or a fraction below 1)")

    run = HarnessRun(
        tasks=task_specs,
        include_path=list(include_path or []) or (harness.include_path if harness else None),
        num_fewshot=num_fewshot,
        limit=(harness.max_examples if harness else None) if limit is None else (int(limit) if limit >= 1 else limit),
        apply_chat_template=apply_chat_template
        or bool(harness and harness.apply_chat_template)
        or bool(main and main.apply_chat_template),
        fewshot_as_multiturn=fewshot_as_multiturn
        if fewshot_as_multiturn is not None
        else (bool(harness.fewshot_as_multiturn or main.fewshot_as_multiturn) if harness else None),
        log_samples=log_samples or bool(harness and (harness.log_samples or harness.sample_logging.should_log())),
        bootstrap_iters=bootstrap_iters
        if bootstrap_iters is not None
        else (harness.bootstrap_iters if harness else 100000),
        confirm_run_unsafe_code=confirm_run_unsafe_code or bool(harness and harness.confirm_run_unsafe_code),
        gen_kwargs=None,
        seed=seed,
    )
    trainer = main.trainer if main is not None else TrainerConfig()
    distributed = trainer.distributed
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        distributed = DistributedConfig(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    return _run(
        source,
        run,
        trainer=trainer,
        distributed=distributed,
        tokenizer=tokenizer or (main.tokenizer if main is not None else None),
        output_path=output_path,
        batch_size=batch_size or (harness.batch_size if harness and harness.batch_size else DEFAULT_BATCH_SIZE),
        max_length=max_length or (harness.max_eval_length if harness else None),
        max_gen_toks=max_gen_toks,
        generation_defaults=harness.generation_defaults() if harness else {},
        max_samples=harness.max_samples() if harness and not log_samples else None,
        cast=main is not None,
        out=out,
    )


def _run(
    source, run, *, trainer, distributed, tokenizer, output_path, batch_size, max_length, max_gen_toks,
    generation_defaults, max_samples, cast, out,
):  # fmt: skip
    import jax
    import jmp

    from levanter_core import distributed as dist
    from levanter_core.models.source import load_model_source
    from levanter_core.trainer.mesh import make_mesh
    from levanter_eval_harness.compute import Leader, Scorer, follow, replicate
    from levanter_eval_harness.harness import evaluate, prepare_tasks
    from levanter_eval_harness.lm import DEFAULT_MAX_GEN_TOKS, LevanterLM

    dist.initialize(distributed)
    leader_process = jax.process_index() == 0
    # Unknown tasks and unreadable task data stop the run before the model is loaded (with
    # several processes, once the others have been told to stop).
    prepared = failed = None
    if leader_process:
        try:
            prepared = prepare_tasks(run)
        except Exception as e:
            if jax.process_count() == 1:
                raise
            failed = e

    loaded = load_model_source(source, tokenizer=tokenizer)
    policy = jmp.get_policy(trainer.mp) if cast else None
    model = loaded.model
    mesh = compute_mapping = None
    if jax.device_count() > 1:
        # Each batch's rows are split over every device (of every process), which hold the
        # weights whole.
        mesh = make_mesh(trainer)
        compute_mapping = trainer.compute_axis_mapping()
        model = replicate(model, mesh)
    scorer = Scorer(model, mesh=mesh, compute_mapping=compute_mapping, cast=policy.cast_to_compute if policy else None)
    if not leader_process:
        follow(scorer)
        return None

    leader = Leader(scorer)
    if failed is not None:
        leader.stop()
        raise failed
    lm = LevanterLM(
        model,
        loaded.tokenizer,
        eos_ids=loaded.eos_ids,
        max_length=max_length,
        batch_size=batch_size,
        max_gen_toks=max_gen_toks or int(generation_defaults.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS),
        generation_defaults=generation_defaults,
        name=loaded.name,
        leader=leader,
    )
    try:
        results = evaluate(
            lm, run, model_name=source, output_path=output_path, prepared=prepared, max_samples=max_samples
        )
    finally:
        leader.stop()
        lm.close()
    _report(results, output_path, out)
    return results


def _report(results: dict, output_path: str, out) -> None:
    """Each task's (and group's) metrics, one per line, then where the files are."""
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if (
                "_stderr" in key
                or key == "sample_len"
                or not isinstance(value, (int, float))
                or isinstance(value, bool)
            ):
                continue
            metric, _, filter_name = key.partition(",")
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            spread = f" ± {stderr:.4f}" if isinstance(stderr, float) else ""
            shown = f"{task} {metric}" + (f" ({filter_name})" if filter_name not in ("", "none") else "")
            out(f"{shown}: {value:.4f}{spread}")
    out(f"results written under {os.path.abspath(output_path)}")
