"""The ``levanter`` command line.

Exit status: 0 on success, 2 on a bad config or bad input (the message says
what and where; no traceback), 1 on any other failure.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Annotated, Any

import click
import typer
import typer.core

from levanter_core.errors import LevanterError, UserError
from levanter_core.plugins.commands import SOURCE_HELP, SOURCE_HELP_WITH_CONFIG

app = typer.Typer(
    name="levanter",
    help="Train language models in JAX. Architectures, trackers, data sources, optimizers and "
    "checkpointers come from plugins: see `levanter plugins`.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class _TrainCommand(typer.core.TyperCommand):
    """`levanter train --help` ends with the reference of every config field."""

    def format_epilog(self, ctx: Any, formatter: Any) -> None:  # typer's own click types
        from levanter_core.config.reference import field_reference
        from levanter_core.config.train import TrainConfig

        formatter.write_paragraph()
        formatter.write("Config fields (YAML sections; override any with --section.field VALUE):\n\n")
        formatter.write(field_reference(TrainConfig) + "\n")


@app.command(
    cls=_TrainCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def train(
    ctx: typer.Context,
    config: Annotated[
        str,
        typer.Argument(
            help="Path of the run's YAML config, or the name of a config a plugin ships (see `levanter configs`).",
            metavar="CONFIG",
        ),
    ],
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check the config as the run checks it before it starts (every plugin type, the "
            "tokenizer, the data files found, batch sizes that divide over the replicas and "
            "microbatches) and print it resolved, as YAML, then stop: no data read, no device used, "
            "no cache or run directory made. Exit 0 if the config is good, 2 if not. (The number of "
            "devices is known only when the run starts, which checks the batch sizes against it "
            "before it reads any data. A hub tokenizer missing from the Hugging Face cache is "
            "downloaded into it, when the hub is reachable.)",
        ),
    ] = False,
) -> None:
    """Train a model from a YAML config, resuming the run if it already has a checkpoint.

    Any config field can be overridden after the file name, with its dotted
    path: --trainer.num_train_steps 100, --data.train_urls '["a.jsonl"]'.
    The run directory ({trainer.log_dir}/{run id}) is printed at start; it gets
    metrics.jsonl, the resolved config.yaml, run.json and requirements.txt. A log_dir
    in a bucket (s3://, gs://) is written locally and uploaded as the run goes.
    With --dry-run, only check the config and print it with every default filled in.
    """
    if not dry_run:
        from levanter_core.trainer.host_memory import keep_freed_memory

        keep_freed_memory()  # before any other thread allocates; undone by trainer.keep_host_memory: false

    from levanter_core.config.train import load_train_config
    from levanter_core.plugins.configs import resolve_config_path
    from levanter_core.run import preflight, resolved_config, run_training

    config = resolve_config_path(config)
    train_config, _ = load_train_config(config, list(ctx.args))
    # What the environment cannot provide (a hub tokenizer offline and not cached, a checkpoint
    # location out of the checkpointer's reach) stops the run here, before JAX starts and
    # before any data is read.
    preflight(train_config)
    if dry_run:
        import yaml

        print(yaml.safe_dump(resolved_config(train_config), sort_keys=False), end="")
        return
    result = run_training(train_config, config_path=config, progress=progress)
    parts = [f"done: step {result.final_step}"]
    if result.last_loss is not None:
        parts.append(f"train loss {result.last_loss:.4f}")
    if result.final_eval_loss is not None:
        parts.append(f"eval loss {result.final_eval_loss:.4f}")
    if result.tokens_per_second:
        parts.append(f"{result.tokens_per_second:,.0f} tokens/s")
    parts.append(f"{result.wall_seconds:.1f} s")
    print(", ".join(parts))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def plan(
    ctx: typer.Context,
    config: Annotated[str, typer.Argument(help="Path of the run's YAML config.", metavar="CONFIG")],
    devices: Annotated[int, typer.Option("--devices", help="How many accelerators the run would have.")] = 8,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="The kind of accelerator: a100-40gb, a100-80gb, h100-80gb, h200, b200, tpu-v4, tpu-v5e, "
            "tpu-v5p or tpu-v6e.",
        ),
    ] = "h100-80gb",
    vocab_size: Annotated[
        int | None,
        typer.Option(
            "--vocab-size",
            help="The vocabulary's size, where the config's tokenizer cannot be loaded here (offline, not cached).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON, for tools.")] = False,
    search: Annotated[
        bool,
        typer.Option(
            "--search",
            help="Plan every layout the run allows (tensor parallelism over 1 to 8 devices with FSDP over the rest, "
            "each gradient-checkpointing policy, 1, 2 or 4 microbatches) and print the fastest that fit, as "
            "overrides. When none fits, also find the smallest device count (doubling) at which one does.",
        ),
    ] = False,
    apply: Annotated[
        str | None,
        typer.Option(
            "--apply",
            help="With --search: write the config, with the fastest plan's overrides applied, to this YAML file.",
            metavar="FILE",
        ),
    ] = None,
) -> None:
    """Plan a training run for hardware this machine does not have.

    Compiles the config's real training step ahead of time for --devices simulated devices
    (nothing of the model is allocated) and reports, per device: parameters, optimizer state,
    gradients, activations and temporaries in bytes, and whether the peak fits the
    accelerator's memory; the model FLOPs per step; the bytes each kind of collective moves,
    read from the compiled program; and the step time, throughput and MFU a roofline of
    compute, communication and memory predicts. Overrides work as for train, e.g.
    --trainer.train_batch_size 64 --trainer.mesh.axes '{model: 2}'.
    """
    from levanter_core.plan.command import apply_plan, format_plan, format_search, run_plan, smallest_fitting

    overrides = list(ctx.args)
    if apply and not search:
        raise UserError("--apply FILE writes the plan a search chose: add --search")
    result = run_plan(config, overrides, devices=devices, device=device, vocab_size=vocab_size, search=search)
    if not search:
        print(json.dumps(result, indent=2) if as_json else format_plan(result))
        if not result["fits"] and not as_json:
            print(f"\nthis layout does not fit on {devices} devices: --search tries the others, and more devices")
        return
    fitting = [p for p in result["plans"] if p.get("fits")]
    smallest = None
    if not fitting:
        smallest = smallest_fitting(config, overrides, devices=devices, device=device, vocab_size=vocab_size)
        if smallest is not None:
            result["smallest_devices"] = smallest[0]
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(format_search(result))
        if not fitting:
            where = f"{smallest[0]} devices" if smallest else "up to 1,024 devices"
            print(f"\nno layout fits on {devices} devices; the smallest count that fits: {where}")
            if smallest is not None:
                print(format_search(smallest[1]))
    if apply:
        if not fitting:
            raise UserError(f"--apply {apply}: no layout fits on {devices} devices, so there is no plan to write")
        apply_plan(config, overrides, fitting[0], apply)
        print(f"wrote {apply}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def cache(
    ctx: typer.Context,
    config: Annotated[str, typer.Argument(help="Path of the run's YAML config.", metavar="CONFIG")],
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Tokenize the data of a training config ahead of training, into its cache.

    Builds (or finishes, after an interruption) the cache of every split of every
    source of the data section, with data.num_workers processes or on the
    trainer.ray cluster, and prints what each holds. A later `levanter train`
    with the same data settings reuses it. Overrides work as for train, e.g.
    --data.num_workers 4.
    """
    from levanter_core.config.train import load_train_config
    from levanter_core.data.pipeline import build_caches
    from levanter_core.distributed.ray_cluster import require_ray

    train_config, _ = load_train_config(config, list(ctx.args))
    require_ray(train_config.trainer.ray)  # an address with no Ray installed: say so, not an import error
    for name, split, cache in build_caches(train_config.data, ray=train_config.trainer.ray, progress=progress):
        skipped = sum(cache.skipped().values())
        note = f", {skipped:,} bad records skipped" if skipped else ""
        label = split if name == "main" else f"{name}/{split}"
        print(f"{label}: {cache.num_documents:,} documents, {cache.num_tokens:,} tokens in {cache.path}{note}")


@app.command()
def configs(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List the configs installed plugins ship; `levanter train NAME` runs one by name
    (DISTRIBUTION:NAME when two plugins ship the same name)."""
    from levanter_core.plugins.configs import packaged_configs

    found = packaged_configs()
    if as_json:
        print(json.dumps([{"name": c.name, "distribution": c.distribution, "path": c.path} for c in found], indent=1))
        return
    if not found:
        print("no installed plugin ships configs")
    for c in found:
        print(f"{c.name:<24} {c.distribution:<28} {c.path}")


@app.command()
def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List installed plugins: distribution, version, hooks, and the type names each registers.

    A type name that several distributions register (a clash) is shown with the qualified
    names, DISTRIBUTION:NAME, that select each of them; other types are not affected."""
    from levanter_core.plugins import get_manager

    manager = get_manager()
    registry_error = None
    clashes: list[dict] = []
    try:
        clashes = manager.clashes()
    except UserError as e:  # e.g. a badly registered type: still show what is installed
        registry_error = str(e)
    infos = list(manager.plugins.values())
    if as_json:
        payload = {"plugins": [i.as_dict() for i in infos], "clashes": clashes, "error": registry_error}
        print(json.dumps(payload, indent=2))
    else:
        clashed = {(c["kind"], c["name"]) for c in clashes}
        for info in infos:
            where = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
            print(f"{info.name}  [{where}]")
            if info.error:
                print(f"    FAILED: {info.error}")
                continue
            print(f"    hooks: {', '.join(info.hooks) or '-'}")
            for kind, names in sorted(info.types.items()):
                shown = [f"{n} (clash)" if (kind, n) in clashed else n for n in names]
                print(f"    {kind}: {', '.join(shown)}")
        for clash in clashes:
            print(f"clash: {clash['message']}")
        if registry_error:
            print(f"error: {registry_error}", file=sys.stderr)
    if registry_error or any(i.error for i in infos):
        raise typer.Exit(code=1)


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def eval_command(
    ctx: typer.Context,
    source: Annotated[
        str | None,
        typer.Argument(
            help=SOURCE_HELP + " Optional with a --config that names the model (Levanter's eval_lm configs: "
            "checkpoint_path or hf_checkpoint).",
            metavar="[SOURCE]",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A training config whose validation sets (and their tags) to evaluate on, tokenized into its "
            "cache as training would; dotted overrides after it apply (--data.cache_dir DIR). Levanter's eval_lm "
            "configs too: their checkpoint_path or hf_checkpoint is the model, max_eval_length the length of "
            "the evaluated sequences.",
        ),
    ] = None,
    data: Annotated[
        list[str] | None,
        typer.Option(
            "--data",
            help="A file to evaluate on (repeat for several), read in the data format the model trains on with "
            "the model's tokenizer: for a language model .jsonl (a 'text' field), .txt (a document per line), .json "
            "or .parquet, compressed or not; for a speech model (Whisper) a manifest, .jsonl with 'audio' (a path "
            "relative to the manifest) and 'text' on each line.",
            metavar="FILE",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the results as JSON: the metrics (loss, bpb or wer) overall, per set and per tag."
        ),
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Sequences (or utterances) per evaluation batch.", min=1)] = 8,
    max_batches: Annotated[
        int | None, typer.Option(help="Evaluate at most this many batches of each set [default: all].", min=1)
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer to use instead of the model's own.")] = None,
    cache_dir: Annotated[
        str | None,
        typer.Option(
            help="Keep the tokenized --data files here (reused next time) rather than in a temporary directory."
        ),
    ] = None,
) -> None:
    """Evaluate a model on a config's validation sets or on files, as its training evaluates.

    The metrics are those of the model's training objective. A language model's: the loss and
    bits per byte, every sequence of each set once (documents joined with the end-of-text
    token, cut into sequences of the model's seq_len); bits per byte divides the loss by the
    bytes of text the predicted tokens stand for, so it compares models with different
    tokenizers. A speech model's (Whisper): the loss of each utterance's transcript and the
    word error rate (wer) of its greedy transcripts against the references.
    """
    import json as json_module

    from levanter_core.evaluate import run_eval

    overrides = list(ctx.args)
    if overrides and not config:
        raise UserError(f"unexpected arguments {' '.join(overrides)} (dotted overrides go with --config)")
    report = run_eval(
        source, config=config, overrides=overrides, data=data or (), tokenizer=tokenizer, batch_size=batch_size,
        max_batches=max_batches, cache_dir=cache_dir, progress=sys.stderr.isatty(),
    )  # fmt: skip
    if as_json:
        print(json_module.dumps(report.as_json(), indent=1))
    else:
        print(report.table())


@app.command("import-hf")
def import_hf(
    source: Annotated[
        str,
        typer.Argument(
            help="A Hugging Face model directory, or a hub name (downloaded when the hub is reachable).",
            metavar="SOURCE",
        ),
    ],
    output: Annotated[
        str,
        typer.Argument(
            help="Directory or bucket URL (s3://, gs://) to write our checkpoint into (must not exist or be empty).",
            metavar="OUTPUT",
        ),
    ],
    seq_len: Annotated[
        int | None,
        typer.Option(help="Training sequence length to record (default: max_position_embeddings).", min=1),
    ] = None,
) -> None:
    """Convert a Hugging Face causal LM into a levanter checkpoint.

    The architecture is chosen by the installed model plugins from config.json. Every
    tensor is checked against the model before anything is written; the tokenizer files
    are kept beside the weights. Train from the result with trainer.initialize_from.
    """
    from levanter_core.hf.bridge import import_hf as do_import

    print(f"imported {source} into {do_import(source, output, seq_len=seq_len)}")


@app.command("export-hf")
def export_hf(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="A checkpoint (step-N directory, a run's checkpoint directory, or an import), local or in a "
            "bucket (s3://, gs://).",
            metavar="CHECKPOINT",
        ),
    ],
    output: Annotated[
        str,
        typer.Argument(
            help="Directory to write the Hugging Face model into (must not exist or be empty, unless "
            "--overwrite), or an s3:// or gs:// URL to upload it to.",
            metavar="OUTPUT",
        ),
    ],
    dtype: Annotated[
        str, typer.Option(help="Data type of the saved weights: float32, bfloat16 or float16.")
    ] = "float32",
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 2GB or 500MB.")] = "2GB",
    raw_weights: Annotated[
        bool,
        typer.Option(
            "--raw-weights",
            help="For a run with trainer.model_averaging: export the trained weights themselves, "
            "not their running average (which evaluation used, and which is exported by default).",
        ),
    ] = False,
    peft: Annotated[
        bool,
        typer.Option(
            "--peft",
            help="For a LoRA run: write its adapters as a PEFT adapter directory (adapter_model.safetensors, "
            "adapter_config.json) for peft.PeftModel.from_pretrained on the base model, instead of merged weights.",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace what OUTPUT holds (an earlier export). Without it, an OUTPUT that exists and is not "
            "empty is refused, as import-hf refuses one.",
        ),
    ] = False,
) -> None:
    """Write a levanter checkpoint as a Hugging Face model directory.

    Produces config.json (with the tokenizer's pad, bos and eos token ids),
    model-0000i-of-0000n.safetensors shards with their index, and the tokenizer files,
    loadable with transformers.AutoModelForCausalLM.from_pretrained. A run with
    trainer.model_averaging exports the averaged weights, as evaluation used them.
    A LoRA run's checkpoint is exported with its adapters merged into the weights, or
    with --peft as a PEFT adapter for its base model.
    An OUTPUT in a bucket is written to a temporary local directory, then uploaded,
    its safetensors index last. Object stores are reached with the usual environment
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID..., GOOGLE_APPLICATION_CREDENTIALS).
    """
    from levanter_core.errors import ConfigError
    from levanter_core.hf.bridge import export_hf as do_export
    from levanter_core.hf.bridge import parse_size

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16, not {dtype!r}")
    for argument, path in (("CHECKPOINT", checkpoint), ("OUTPUT", output)):
        _check_reachable(argument, path)
    written = do_export(
        checkpoint,
        output,
        dtype=dtype,
        max_shard_bytes=parse_size(max_shard_size),
        averaged=not raw_weights,
        peft=peft,
        overwrite=overwrite,
    )
    print(f"exported {checkpoint} to {written}")


def _check_reachable(argument: str, path: str) -> None:
    """Raise :class:`ConfigError` naming ``argument`` if ``path`` is a URL this environment
    cannot reach (its filesystem package missing; no credentials for its object store)."""
    from levanter_core.config.storage import storage_problem
    from levanter_core.errors import ConfigError
    from levanter_core.fileio import OBJECT_STORES, protocol_of, require_filesystem

    try:
        require_filesystem(path)
    except ValueError as e:
        raise ConfigError(f"{argument} {path}: {e}") from None
    if protocol_of(path) in OBJECT_STORES and (problem := storage_problem(path)):
        raise ConfigError(f"{argument} {path}: {problem}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sample(
    ctx: typer.Context,
    source: Annotated[
        str | None,
        typer.Argument(
            help=SOURCE_HELP_WITH_CONFIG,
            metavar="SOURCE",
        ),
    ] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeat for several).")] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help='A JSONL file of prompts: per line a string, {"prompt": TEXT} or {"messages": [...]} '
            "(a conversation, through the chat template).",
            metavar="FILE.jsonl",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Most tokens to generate per sample [default: 128].")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="Softmax temperature; 0 is greedy [default: 1.0].")] = None,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens; 0: all.")] = 0,
    top_p: Annotated[
        float, typer.Option(help="Sample among the most likely tokens holding this much probability.")
    ] = 1.0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the random draws (64 bits, signed); the same seed gives the same text [default: 0]."
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop",
            help="A string that ends a sample (repeat for several). Backslash escapes are read as in Python: "
            "--stop '\\n\\n' stops at a blank line; write \\\\ for a backslash.",
        ),
    ] = None,
    n: Annotated[int | None, typer.Option("-n", help="Samples per prompt [default: 1].", min=1, max=10_000)] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Put each --prompt through the tokenizer's chat template as a user message.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON line per sample: text, token ids, log-probabilities, finish reason."
        ),
    ] = False,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer to use instead of the model's own.")] = None,
    max_seqs: Annotated[int | None, typer.Option(help="Sequences decoded together [default: 16].", min=1)] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(help="Longest prompt plus generation [default: the model's seq_len].", min=2)
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A sampler config in Levanter's sample_lm format (hf_checkpoint or checkpoint_path, prompts, "
            "max_new_tokens, temperature, engine, ...); options given here override it, and so do dotted "
            "overrides (--engine.max_seqs 4).",
        ),
    ] = None,
) -> None:
    """Generate text from a model, batching all prompts through the inference engine.

    Prints each prompt with its continuation, or with --json one JSON line per sample.
    Greedy at --temperature 0; otherwise the same --seed gives the same text.
    """
    from levanter_core.errors import ConfigError
    from levanter_core.inference.sample import (
        EngineConfig,
        SampleConfig,
        interpret_escapes,
        load_sample_config,
        read_prompts_file,
        run_sample,
    )
    from levanter_core.inference.sampling import SamplingParams

    if config is not None:
        settings = load_sample_config(config, list(ctx.args))
    elif ctx.args:
        raise ConfigError(f"unknown option {ctx.args[0]!r} (dotted overrides need --config)")
    else:
        settings = SampleConfig(prompts=[], temperature=1.0, seed=0, max_new_tokens=128)
    source = source or settings.source
    if source is None:
        raise ConfigError("name a SOURCE (or a --config with hf_checkpoint or checkpoint_path)")
    chosen = [{"prompt": p} for p in (prompt or [])] + (read_prompts_file(prompts) if prompts else [])
    if not chosen:
        chosen = [{"prompt": p} for p in settings.prompts]
    if not chosen:
        raise ConfigError("give at least one --prompt or a --prompts file")
    stops = tuple(interpret_escapes(s, "--stop") for s in stop) if stop else ()
    stops = stops or ((settings.stop_sequence,) if settings.stop_sequence else ())
    params = SamplingParams(
        max_new_tokens=max_new_tokens if max_new_tokens is not None else settings.max_new_tokens,
        temperature=temperature if temperature is not None else settings.temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed if seed is not None else settings.seed,
        stop=stops,
    )
    problems = params.field_problems()
    if problems:  # named as the options that set them
        options = {"max_new_tokens": "--max-new-tokens", "top_logprobs": "--top-logprobs"}
        raise ConfigError("; ".join(f"{options.get(f, '--' + f.replace('_', '-'))}: {m}" for f, m in problems))
    engine = settings.engine
    if max_seqs is not None or max_seq_len is not None:
        update = {"max_seqs": max_seqs or engine.max_seqs}
        if max_seq_len is not None:
            update.update(page_size=max_seq_len, max_pages_per_seq=1)
        engine = EngineConfig(**{**engine.model_dump(), **update})
    run_sample(
        source,
        chosen,
        params,
        n=n if n is not None else settings.n_generations,
        chat=chat,
        as_json=as_json,
        tokenizer=tokenizer or settings.tokenizer,
        engine=engine,
        rounds=settings.n_rounds,
    )


def _setup_logging() -> None:
    level = os.environ.get("LEVANTER_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("levanter_core").setLevel(level)


def _usage_error(error) -> str:
    """A usage error of click or typer as one line: what is wrong, and where to read more."""
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    if ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning errors into messages and exit codes."""
    _setup_logging()
    from levanter_core.plugins import get_manager

    try:
        get_manager().hook().register_commands(app=app)
    except Exception as e:  # a broken command plugin must not break the CLI
        print(f"warning: a plugin's register_commands failed: {e}", file=sys.stderr)
    try:
        # Without standalone mode click returns the exit code of typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False)
    except LevanterError as e:  # raised on purpose with a message for people: no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 1))
    except (click.exceptions.Exit, typer.Exit) as e:
        sys.exit(e.exit_code)
    except (click.ClickException, typer.TyperException) as e:
        # a usage error (an unknown option, a value out of range): one line, no usage text
        print(f"error: {_usage_error(e)}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, typer.Abort):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
