"""``levanter plan``, for the command line: the plan runs in a child process whose JAX has as many
simulated CPU devices as the plan is for (a process's device count is fixed when JAX starts),
and comes back as JSON; this module formats it.

    python -m levanter_core.plan.command CONFIG --devices N --device KIND --out FILE [--vocab-size V] [overrides]

is the child (what ``levanter plan`` runs); its exit status is the CLI's: 2 for a config the plan
refuses, with the message on standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import yaml
from haliax import Axis

from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import TrainConfig, load_train_config
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import ConfigError, LevanterError
from levanter_core.plan.estimate import plan_step
from levanter_core.plan.hardware import Accelerator, accelerator
from levanter_core.run.initial import adapter_surgery, build_objective, resolve_model
from levanter_core.run.setup import batch_for_devices
from levanter_core.testing import simulated_devices


def run_plan(
    config: str,
    overrides: list[str],
    *,
    devices: int,
    device: str,
    vocab_size: int | None = None,
    search: bool = False,
    first_fit: bool = False,
) -> dict:
    """The plan of ``config`` (with ``overrides``) on ``devices`` accelerators of kind ``device``,
    computed in a child process with that many simulated devices; with ``search``, the plans of
    every candidate layout (:func:`candidates`) as ``{"plans": [...]}``. Raises
    :class:`ConfigError` with the child's message when the plan refuses the config."""
    if devices < 1:
        raise ConfigError(f"--devices {devices}: a plan needs at least one device")
    accelerator(device)  # an unknown kind fails here, before the child starts
    with tempfile.TemporaryDirectory(prefix="levanter-plan-") as work:
        out = os.path.join(work, "plan.json")
        argv = [sys.executable, "-m", "levanter_core.plan.command", config, "--devices", str(devices)]
        argv += ["--device", device, "--out", out]
        if vocab_size is not None:
            argv += ["--vocab-size", str(vocab_size)]
        if search:
            argv.append("--search")
        if first_fit:
            argv.append("--first-fit")
        env = {**os.environ, **simulated_devices(devices)}
        done = subprocess.run([*argv, *overrides], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not os.path.exists(out):
            message = done.stderr.strip().splitlines()
            last = next((line for line in reversed(message) if line.startswith("error: ")), None)
            if done.returncode == 2 and last:
                raise ConfigError(last[len("error: ") :])
            raise LevanterError(f"the plan failed (exit {done.returncode}):\n" + "\n".join(message[-30:]))
        with open(out, encoding="utf-8") as f:
            return json.load(f)


POLICIES: tuple[bool | str, ...] = (True, False, "recompute")
"""The gradient-checkpointing policies a search tries (besides the config's own)."""
TENSOR_SIZES = (1, 2, 4, 8)
"""Tensor-parallel sizes a search tries (the ``model`` mesh axis), where they divide the devices."""
MICROBATCHES = (1, 2, 4)
"""Microbatch counts a search tries (gradient accumulation), where they divide the batch."""


def candidates(config: TrainConfig, devices: int) -> list[list[str]]:
    """The overrides of each layout a search plans: tensor parallelism over 1 to 8 devices (FSDP
    over the rest), each gradient-checkpointing policy, and 1, 2 or 4 microbatches. Layouts the
    run would refuse (heads the tensor axis does not divide...) are planned too, and refused
    there with the run's own message."""
    policies = [config.model.gradient_checkpointing] if hasattr(config.model, "gradient_checkpointing") else []
    policies += [p for p in POLICIES if p not in policies]
    batch = config.trainer.batch_schedule.sizes[0]  # the first stage of a schedule
    found = []
    for tensor in TENSOR_SIZES:
        if devices % tensor:
            continue
        data = devices // tensor
        for policy in policies:
            for micro in MICROBATCHES:
                if micro > 1 and (batch < 0 or batch % (data * micro)):
                    continue
                overrides = []
                if tensor > 1:
                    overrides += ["--trainer.mesh.axes.model", str(tensor)]
                if policies:
                    overrides += ["--model.gradient_checkpointing", str(policy).lower()]
                if micro > 1:
                    overrides += ["--trainer.per_device_parallelism", str(batch // (data * micro))]
                found.append(overrides)
    return found


def search_plans(
    path: str, overrides: list[str], hardware: Accelerator, *, vocab_size: int | None, first_fit: bool = False
) -> list[dict]:
    """Every candidate's plan (or why the run would refuse it), fastest fitting first; with
    ``first_fit``, only up to the first candidate that fits."""
    base, _ = load_train_config(path, overrides)
    plans = []
    for extra in candidates(base, jax.device_count()):
        try:
            config, _ = load_train_config(path, [*overrides, *extra])
            plan = plan_config(config, hardware, vocab_size=vocab_size)
        except LevanterError as e:
            plans.append({"overrides": extra, "refused": str(e)})
            continue
        except Exception as e:  # a layout XLA cannot compile: one candidate fewer, not the search
            plans.append({"overrides": extra, "refused": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
            continue
        plans.append({"overrides": extra, **plan})
        if first_fit and plan["fits"]:
            break
    return sorted(plans, key=lambda p: (not p.get("fits", False), p.get("timing", {}).get("step_s", float("inf"))))


def plan_config(config: TrainConfig, hardware: Accelerator, *, vocab_size: int | None = None) -> dict:
    """The plan of ``config`` on this process's devices, as ``levanter train`` would resolve the
    run: the batch size for the devices, the model and vocabulary (the tokenizer's, or
    ``vocab_size`` where given), the objective and LoRA's adapters."""
    config = batch_for_devices(config)
    if vocab_size is not None:
        model_config, Vocab = config.model, Axis("vocab", vocab_size)
    else:
        try:
            tokenizer = load_tokenizer(config.data.tokenizer)
        except Exception as e:  # offline and not cached, a path that is not there
            raise ConfigError(
                f"data.tokenizer: {config.data.tokenizer!r} cannot be loaded here ({e}); give the vocabulary's "
                "size with --vocab-size"
            ) from None
        model_config, Vocab, _ = resolve_model(config, tokenizer)
    objective = build_objective(config, model_config)
    adapt = adapter_surgery(config, jax.random.PRNGKey(config.trainer.seed))
    return plan_step(config, hardware, model_config=model_config, Vocab=Vocab, objective=objective, adapt=adapt)


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:,.1f} µs"
    return f"{s * 1000:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def format_plan(plan: dict) -> str:
    """The plan as a person reads it."""
    m, t, comm = plan["memory"], plan["timing"], plan["communication"]
    mesh = " x ".join(f"{name} {size}" for name, size in plan["mesh"].items())
    fits = "fits" if plan["fits"] else "DOES NOT FIT"
    lines = [
        f"{plan['model']} ({plan['parameters'] / 1e6:,.1f} M parameters, {plan['trainable_parameters'] / 1e6:,.1f} M "
        f"trained) on {plan['devices']} x {plan['device']}: mesh {mesh}",
        f"batch {plan['batch_size']} x {plan['seq_len']} tokens in {plan['microbatches']} microbatch(es); "
        f"gradient checkpointing {plan['gradient_checkpointing']}",
        "",
        "memory per device",
        f"  parameters          {_size(m['parameters'])}",
        f"  optimizer state     {_size(m['optimizer'])}",
        f"  gradients           {_size(m['gradients'])}",
    ]
    if m["reference"]:
        lines.append(f"  reference model     {_size(m['reference'])}")
    if m["other_state"]:
        lines.append(f"  averaged model      {_size(m['other_state'])}")
    lines += [
        f"  activations         {_size(m['activations'])} (kept for the backward pass; estimated)",
        f"  temporaries         {_size(m['temporaries'])} (the compiled step's: activations, gradients, workspace)",
        f"  peak                {_size(m['peak'])} of {_size(plan['usable_memory_bytes'])} usable: {fits}",
        "",
        f"model FLOPs per step  {plan['model_flops_per_step']:.3e} ({plan['model_flops_per_step'] / plan['devices']:.3e} "
        "per device)",
        "communication per device per step: "
        + (
            ", ".join(f"{kind} {_size(b)}" for kind, b in sorted(comm["by_kind"].items()))
            if comm["by_kind"]
            else "none"
        ),
        f"  over the node's links {_size(comm['link_bytes'])}, across nodes {_size(comm['network_bytes'])}",
        "",
        f"predicted step        {_seconds(t['step_s'])} (compute {_seconds(t['compute_s'])}, communication "
        f"{_seconds(t['communication_s'])} of which exposed {_seconds(t['exposed_communication_s'])}, optimizer "
        f"{_seconds(t['optimizer_s'])})",
        f"predicted throughput  {t['tokens_per_second_per_device']:,.0f} tokens/s per device, MFU {t['mfu']:.1%}",
        f"(compiled for {plan['devices']} simulated devices in {plan['compile_seconds']:.1f} s)",
    ]
    return "\n".join(lines)


def format_search(result: dict, top: int = 5) -> str:
    """The fastest plans that fit, as the overrides that give them."""
    plans = result["plans"]
    fitting = [p for p in plans if p.get("fits")]
    refused = [p for p in plans if "refused" in p]
    lines = [
        f"searched {len(plans)} layouts on {result['devices']} x {result['device']}: {len(fitting)} fit, "
        f"{len(plans) - len(fitting) - len(refused)} do not fit, {len(refused)} refused by the run's checks",
    ]
    for rank, p in enumerate(fitting[:top], 1):
        t, mesh = p["timing"], " x ".join(f"{k} {v}" for k, v in p["mesh"].items())
        lines += [
            f"{rank}. {_seconds(t['step_s'])} a step, {t['tokens_per_second_per_device']:,.0f} tokens/s per device, "
            f"MFU {t['mfu']:.1%}, peak {_size(p['memory']['peak'])} (mesh {mesh}, {p['microbatches']} microbatch(es))",
            "   " + (" ".join(p["overrides"]) or "(the config as it is)"),
        ]
    if not fitting:
        lines.append("no layout fits")
    return "\n".join(lines)


def apply_plan(config: str, overrides: list[str], plan: dict, destination: str) -> None:
    """Write ``config`` with the command's ``overrides`` and ``plan``'s into ``destination`` (YAML,
    the includes merged)."""
    raw, _ = load_config_dict(config, [*overrides, *plan["overrides"]])
    with open(destination, "w", encoding="utf-8") as f:
        f.write(f"# {config} as `levanter plan --search` chose it: {' '.join(plan['overrides']) or 'unchanged'}\n")
        yaml.safe_dump(raw, f, sort_keys=False)


def smallest_fitting(
    config: str, overrides: list[str], *, devices: int, device: str, vocab_size: int | None, limit: int = 1024
) -> tuple[int, dict] | None:
    """The smallest device count, doubling from ``2 devices``, at which some searched layout fits,
    with the layouts tried there up to the first that fits; None up to ``limit``."""
    n = devices * 2
    while n <= limit:
        result = run_plan(
            config, overrides, devices=n, device=device, vocab_size=vocab_size, search=True, first_fit=True
        )
        if any(p.get("fits") for p in result["plans"]):
            return n, result
        n *= 2
    return None


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m levanter_core.plan.command")
    parser.add_argument("config")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--search", action="store_true")
    parser.add_argument("--first-fit", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    try:
        if jax.device_count() != args.devices:
            raise ConfigError(f"the plan's process has {jax.device_count()} devices, not {args.devices}")
        if args.search:
            plans = search_plans(
                args.config, overrides, accelerator(args.device), vocab_size=args.vocab_size, first_fit=args.first_fit
            )
            plan = {"devices": args.devices, "device": accelerator(args.device).name, "plans": plans}
        else:
            config, _ = load_train_config(args.config, overrides)
            plan = plan_config(config, accelerator(args.device), vocab_size=args.vocab_size)
    except LevanterError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
