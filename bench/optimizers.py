"""Optimizers side by side on the reference GPT-2: loss after the same steps, and step time.

Every run is the reference work of ``reference_gpt2.py`` (GPT-2 hidden 256, 4 layers, batch
16 x 256 tokens, the standard library's ``.py`` files tokenized by an 8,192-token BPE) with only
the ``optimizer:`` section changed, trained through the real path (``run_training``). The
tokenizer and the cache are built once and shared; the order of the batches is the same in
every run, so the runs see the same tokens.

    # the learning-rate sweep: each optimizer at each of its rates, short runs
    .venv/bin/python bench/optimizers.py sweep --steps 150 --out bench/optimizers-sweep.json
    # the table: each optimizer at its best rate of the sweep, longer runs, AdamW among them
    .venv/bin/python bench/optimizers.py table --sweep bench/optimizers-sweep.json --steps 300 --out bench/optimizers-table.json
    # seconds per step of each, taking turns in one process (the table's step-time column)
    .venv/bin/python bench/optimizers.py timing --sweep bench/optimizers-sweep.json --out bench/optimizers-timing.json
    # two curves in one plot (PNG)
    .venv/bin/python bench/optimizers.py curves --runs adam=1e-3 sophia-h=1e-3 --steps 600 \\
        --out bench/sophia-h-vs-adamw.json --plot bench/sophia-h-vs-adamw.png

A run's loss is the held-out loss after its last step (``eval/loss`` on ``EVAL_BATCHES``
batches of the validation split) and the mean training loss of its last 20 steps; its step
time is the median over the steps after the first ``WARMUP_STEPS`` (compilation and settling
left out) of batch tokens / ``throughput/tokens_per_second``. Each result is appended to the
``--out`` JSON as soon as its run ends, so an interrupted sweep keeps what it measured and a
rerun skips what is there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_gpt2

WARMUP_STEPS = 5
EVAL_BATCHES = 16

RATES: dict[str, list[float]] = {
    "adam": [3e-4, 1e-3, 3e-3],
    "lion": [1e-4, 3e-4, 1e-3],
    "adopt": [3e-4, 1e-3, 3e-3, 1e-2],
    "rmsprop": [3e-4, 1e-3, 3e-3],
    "cautious": [3e-4, 1e-3, 3e-3, 1e-2],
    "schedule_free_adamw": [3e-4, 1e-3, 3e-3, 1e-2],
    "sophia-h": [3e-4, 1e-3, 3e-3, 1e-2],
    "sophia-g": [3e-4, 1e-3, 3e-3, 1e-2],
    "muon": [3e-3, 1e-2, 3e-2, 1e-1],
    "scion": [3e-3, 1e-2, 3e-2],
    "soap": [1e-3, 3e-3, 1e-2],
    "kron": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2],
    "mars": [3e-4, 1e-3, 3e-3, 1e-2],
    "mini": [3e-4, 1e-3, 3e-3, 1e-2],
}
"""The learning rates each optimizer is swept over: around what its authors (or Levanter's
configs) use, a factor of about 3 apart, extended by one where a first sweep found the best
rate at an end of the range."""

COMMON = {"weight_decay": 0.1, "warmup": 0.05, "min_lr_ratio": 0.1}
"""What every run's ``optimizer:`` section holds besides its type and learning rate: the
reference run's weight decay, and a short warmup (Sophia needs one)."""


def section(name: str, learning_rate: float) -> dict:
    return {"type": name, "learning_rate": learning_rate, **COMMON}


class Workspace:
    """The tokenizer and caches, built once in ``workdir``, and one run after another."""

    def __init__(self, workdir: str):
        from levanter_core.data.source import PythonStdlibSourceConfig

        self.workdir = workdir
        self.tokenizer = os.path.join(workdir, "tokenizer.json")
        if not os.path.exists(self.tokenizer):
            reference_gpt2.train_tokenizer(PythonStdlibSourceConfig(), self.tokenizer)

    def run(self, optimizer: dict, steps: int, eval_every: int | None = None) -> dict:
        from levanter_core.config.loader import Sources
        from levanter_core.config.train import validate_train_config
        from levanter_core.run import run_training

        run_id = f"{optimizer['type']}-{optimizer['learning_rate']:g}-{steps}-" + datetime.datetime.now().strftime(
            "%H%M%S"
        )
        raw = reference_gpt2.train_config(self.workdir, self.tokenizer, steps, run_id)
        raw["optimizer"] = optimizer
        raw["trainer"]["max_eval_batches"] = EVAL_BATCHES
        raw["trainer"]["steps_per_eval"] = eval_every or steps
        raw["trainer"]["checkpointer"]["keep"] = []
        config = validate_train_config(raw, Sources("bench"))
        result = run_training(config, progress=False)
        if result.checkpoint:  # 60 MB a run, and nothing reads it
            shutil.rmtree(os.path.dirname(result.checkpoint), ignore_errors=True)
        with open(os.path.join(config.trainer.log_dir, run_id, "metrics.jsonl"), encoding="utf-8") as f:
            metrics = [json.loads(line) for line in f]
        train = [m for m in metrics if "train/loss" in m]
        steady = [
            m for m in train
            if m["step"] > WARMUP_STEPS and "throughput/tokens_per_second" in m and "eval/loss" not in m
        ]  # fmt: skip
        tokens_per_step = config.trainer.train_batch_size * config.model.seq_len
        evals = {m["step"]: m["eval/loss"] for m in metrics if "eval/loss" in m}
        return {
            "optimizer": optimizer,
            "steps": len(train),
            "tokens": len(train) * tokens_per_step,
            "eval_loss": evals.get(train[-1]["step"]),
            "train_loss_last_20": statistics.mean(m["train/loss"] for m in train[-20:]),
            "step_seconds": statistics.median(tokens_per_step / m["throughput/tokens_per_second"] for m in steady),
            "curve": [(m["step"], m["train/loss"]) for m in train],
            "eval_curve": sorted(evals.items()),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": reference_gpt2.machine(),
            "load_average_1min": os.getloadavg()[0],
        }


def _key(optimizer: dict, steps: int) -> str:
    return f"{optimizer['type']}@{optimizer['learning_rate']:g}x{steps}"


def run_all(workspace: Workspace, sections: list[dict], steps: int, out: str, eval_every: int | None = None) -> dict:
    """Run each section for ``steps`` steps unless ``out`` has it already; ``out`` is rewritten
    after every run."""
    results = json.load(open(out)) if os.path.exists(out) else {}
    for optimizer in sections:
        key = _key(optimizer, steps)
        if key in results:
            continue
        print(f"-- {key}", flush=True)
        results[key] = workspace.run(optimizer, steps, eval_every)
        r = results[key]
        print(
            f"   eval loss {r['eval_loss']:.4f}, train loss (last 20) {r['train_loss_last_20']:.4f}, "
            f"step {r['step_seconds']:.3f} s",
            flush=True,
        )
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return results


def best_rates(sweep: dict) -> dict[str, float]:
    """Each optimizer's learning rate with the lowest held-out loss in a sweep."""
    best: dict[str, tuple[float, float]] = {}
    for r in sweep.values():
        name, lr, loss = r["optimizer"]["type"], r["optimizer"]["learning_rate"], r["eval_loss"]
        if loss == loss and (name not in best or loss < best[name][1]):  # NaN never wins
            best[name] = (lr, loss)
    return {name: lr for name, (lr, _) in best.items()}


def time_steps(names: list[str], rates: dict[str, float], *, steps: int = 20, rounds: int = 2) -> dict:
    """Seconds per step of each optimizer on the reference GPT-2, measured in this one process
    on a fixed batch: after 3 warm-up steps (compilation), ``steps`` steps are timed, the mean
    taken so that work done every few steps (Sophia's Hessian estimate every 10) counts for
    its share; the optimizers take turns, ``rounds`` times, and each one's best round is kept,
    so that another process's burst on the machine does not land on one optimizer alone."""
    import time

    import haliax as hax
    import jax
    import numpy as np

    from levanter_core.objective import LmObjective
    from levanter_core.plugins import registry
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer

    preset = reference_gpt2.PRESETS["gpt2"]
    model = (
        registry("model")
        .get("gpt2")
        .config_cls.model_validate({k: v for k, v in preset["model"].items() if k != "type"})
    )
    config = TrainerConfig(num_train_steps=1000, **preset["trainer"])
    tokens = np.random.default_rng(0).integers(0, reference_gpt2.VOCAB_SIZE, (config.train_batch_size, model.seq_len))
    runs = {}
    for name in names:
        fields = {k: v for k, v in section(name, rates.get(name, RATES[name][0])).items() if k != "type"}
        optimizer = registry("optimizer").get(name).config_cls.model_validate(fields)
        trainer = Trainer(config, optimizer.build_for_trainer(1000), LmObjective(), mesh=make_mesh(config))
        state = trainer.init_state(
            lambda k: model.build(hax.Axis("vocab", reference_gpt2.VOCAB_SIZE), key=k), jax.random.PRNGKey(0)
        )
        for _ in range(3):
            state, _ = trainer.train_step(state, tokens)
        runs[name] = [trainer, jax.block_until_ready(state), []]
    for _ in range(rounds):
        for run in runs.values():
            trainer, state, times = run
            start = time.perf_counter()
            for _ in range(steps):
                state, _ = trainer.train_step(state, tokens)
            run[1] = jax.block_until_ready(state)
            times.append((time.perf_counter() - start) / steps)
    return {name: {"step_seconds": min(times), "rounds": times} for name, (_, _, times) in runs.items()}


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        label = f"{r['optimizer']['type']} (lr {r['optimizer']['learning_rate']:g})"
        steps, losses = zip(*r["curve"])
        window = 20  # a moving average: batch-to-batch noise hides the curves' difference
        smooth = [statistics.mean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
        (line,) = ax.plot(steps, smooth, label=f"{label}, train (mean of {window} steps)")
        if r["eval_curve"]:
            es, el = zip(*r["eval_curve"])
            ax.plot(es, el, "o--", color=line.get_color(), label=f"{label}, held out")
    ax.set_xlabel("step (16 x 256 tokens each)")
    ax.set_ylabel("loss (nats per token)")
    # from the loss most runs reach after a tenth of the steps: the start dwarfs the rest
    tops = sorted(
        statistics.mean(loss for _, loss in r["curve"][len(r["curve"]) // 10 : len(r["curve"]) // 10 + 20])
        for r in results
    )
    ax.set_ylim(top=tops[len(tops) // 2] + 0.5)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["sweep", "table", "curves", "timing"])
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (timing: timed steps per round)")
    parser.add_argument("--out", required=True, help="JSON results (appended to, run by run)")
    parser.add_argument("--optimizers", default=",".join(RATES), help="comma-separated types (sweep, table)")
    parser.add_argument("--sweep", help="table: the sweep JSON whose best rates to use")
    parser.add_argument("--runs", nargs="*", default=[], help="curves: TYPE=LEARNING_RATE ...")
    parser.add_argument("--plot", help="curves: the PNG to draw")
    parser.add_argument("--eval-every", type=int, default=None, help="curves: evaluate every N steps")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "levanter-bench-optimizers"))
    args = parser.parse_args(argv)

    names = [n for n in args.optimizers.split(",") if n]
    if args.mode == "timing":
        rates = best_rates(json.load(open(args.sweep))) if args.sweep else {}
        timed = time_steps(names, rates, steps=args.steps)
        adam = timed.get("adam")
        for name, t in timed.items():
            ratio = f"{t['step_seconds'] / adam['step_seconds']:.2f}x" if adam else "-"
            print(f"{name:<22}{t['step_seconds']:>9.3f} s{ratio:>10}  rounds {[f'{x:.3f}' for x in t['rounds']]}")
        record = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": reference_gpt2.machine(),
            "load_average_1min": os.getloadavg()[0],
            "steps": timed,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        return
    os.makedirs(args.workdir, exist_ok=True)
    workspace = Workspace(args.workdir)
    if args.mode == "sweep":
        sections = [section(n, lr) for n in names for lr in RATES[n]]
    elif args.mode == "table":
        rates = best_rates(json.load(open(args.sweep)))
        sections = [section(n, rates[n]) for n in names if n in rates]
    else:
        sections = [section(n, float(lr)) for n, lr in (r.split("=") for r in args.runs)]
    results = run_all(workspace, sections, args.steps, args.out, args.eval_every)
    chosen = [results[_key(s, args.steps)] for s in sections]
    adam = next((r for r in chosen if r["optimizer"]["type"] == "adam"), None)
    print(f"\n{'optimizer':<22}{'lr':>8}{'eval loss':>11}{'train loss':>12}{'step s':>9}{'vs AdamW':>10}")
    for r in chosen:
        ratio = f"{r['step_seconds'] / adam['step_seconds']:.2f}x" if adam else "-"
        print(
            f"{r['optimizer']['type']:<22}{r['optimizer']['learning_rate']:>8g}{r['eval_loss']:>11.4f}"
            f"{r['train_loss_last_20']:>12.4f}{r['step_seconds']:>9.3f}{ratio:>10}"
        )
    if args.plot:
        plot(chosen, args.plot, f"Reference GPT-2, {args.steps} steps of {16 * 256} tokens")


if __name__ == "__main__":
    main()
