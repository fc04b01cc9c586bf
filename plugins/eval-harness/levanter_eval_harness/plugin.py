"""Entry point of the eval-harness plugin (see ``pyproject.toml``): adds ``levanter eval-harness``
and registers the ``eval_harness`` evaluator of training runs.

lm-eval, JAX and the model are imported when the command runs or a config names the evaluator,
so that loading the plugin (which every ``levanter`` command does) stays cheap."""

from __future__ import annotations

from typing import Annotated

import typer

from levanter_core.plugins import hookimpl
from levanter_core.plugins.commands import SOURCE_HELP_WITH_CONFIG


def eval_harness_command(
    ctx: typer.Context,
    source: Annotated[
        str | None,
        typer.Argument(
            help=SOURCE_HELP_WITH_CONFIG,
            metavar="SOURCE",
        ),
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated lm-eval task, group or tag names (or task YAML paths), e.g. hellaswag,arc_easy.",
            metavar="T[,T]",
        ),
    ] = None,
    include_path: Annotated[
        list[str] | None,
        typer.Option(help="A directory of task YAML files of your own (repeat for several).", metavar="DIR"),
    ] = None,
    num_fewshot: Annotated[
        int | None, typer.Option(help="Few-shot examples per prompt (default: each task's own, else 0).", min=0)
    ] = None,
    limit: Annotated[
        float | None,
        typer.Option(help="At most this many examples per task (a fraction below 1: that share of each task).", min=0),
    ] = None,
    apply_chat_template: Annotated[
        bool, typer.Option("--apply-chat-template", help="Render prompts with the tokenizer's chat template.")
    ] = False,
    fewshot_as_multiturn: Annotated[
        bool | None,
        typer.Option(
            "--fewshot-as-multiturn/--no-fewshot-as-multiturn",
            help="Few-shot examples as turns of the conversation (default: on with --apply-chat-template).",
        ),
    ] = None,
    log_samples: Annotated[
        bool, typer.Option("--log-samples", help="Also write every sample (prompt, answers, scores) per task.")
    ] = False,
    output_path: Annotated[
        str | None,
        typer.Option(
            help="Directory to write lm-eval's results JSON into (in a folder named after the model, as "
            "lm_eval does), or a file name ending in .json.",
            metavar="OUT",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            help="Distinct inputs per log-likelihood batch; sequences generated together [default: 16].", min=1
        ),
    ] = None,
    max_length: Annotated[
        int | None, typer.Option(help="Most tokens the model sees at once (default: its seq_len).", min=2)
    ] = None,
    max_gen_toks: Annotated[
        int | None, typer.Option(help="Generation length for tasks that set none [default: 256].", min=1)
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer to use instead of the model's own.")] = None,
    seed: Annotated[
        int | None,
        typer.Option(help="One seed for lm-eval's random choices (few-shot examples...); default: lm-eval's own."),
    ] = None,
    bootstrap_iters: Annotated[
        int | None,
        typer.Option(
            help="Bootstrap iterations for standard errors (0: none) [default: 100000, as lm_eval; a --config's "
            "eval_harness.bootstrap_iters, 0 in Levanter].",
            min=0,
        ),
    ] = None,
    confirm_run_unsafe_code: Annotated[
        bool,
        typer.Option("--confirm-run-unsafe-code", help="Allow tasks that execute code the model writes."),
    ] = False,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A harness config in Levanter's format (eval_harness: {task_spec, max_examples, "
            "max_eval_length, ...}, checkpoint_path, tokenizer, trainer); options given here override it, "
            "and so do dotted overrides (--eval_harness.max_examples 10).",
        ),
    ] = None,
    coordinator_address: Annotated[
        str | None,
        typer.Option(help="host:port of process 0, to run several processes together (jax.distributed)."),
    ] = None,
    num_processes: Annotated[int | None, typer.Option(help="How many processes run together.", min=1)] = None,
    process_id: Annotated[int | None, typer.Option(help="This process's index, 0 .. num-processes - 1.", min=0)] = None,
) -> None:
    """Evaluate a model on lm-eval-harness tasks; write lm-eval's results JSON.

    Runs EleutherAI's lm-evaluation-harness (the lm-eval package) over the model: its
    log-likelihood requests in compiled batches, its generation requests through the
    inference engine. Tasks by name come from lm-eval's registry (their data from the
    Hugging Face hub, or its cache offline); --include-path adds task YAML of your own.
    With several processes, process 0 runs lm-eval and writes the results; the others
    compute their share of each batch.
    """
    from levanter_eval_harness.cli import run_command, split_source

    # Options this command does not know (a config's dotted overrides) reach click as arguments,
    # so SOURCE holds the first of them: sort the words out again.
    source, overrides = split_source(([source] if source is not None else []) + list(ctx.args))
    run_command(
        source,
        args=overrides,
        tasks=tasks,
        include_path=include_path,
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        log_samples=log_samples,
        output_path=output_path,
        batch_size=batch_size,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
        tokenizer=tokenizer,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
        config=config,
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


@hookimpl
def register_commands(app):
    app.command("eval-harness", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        eval_harness_command
    )


@hookimpl
def register_evaluators(register):
    register("eval_harness", "levanter_eval_harness.config:HarnessConfig")
