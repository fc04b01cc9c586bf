"""Sophia against AdamW over a longer run: tokens to reach AdamW's final loss (issue 34, item 13).

Levanter's README says Sophia "can be 2x as fast as Adam". The 600-step curves of
``optimizers.py`` (a 5 M-parameter model, 5% warmup) are far from the regime where that claim
was made. This run comes closer, as far as two CPU cores allow:

- a GPT-2 of about 23 M parameters (hidden 512, 6 layers, 8 heads, 256 positions), batch 4 x 256
  tokens, on the standard library's ``.py`` files with the reference 8,192-token BPE;
- each optimizer as Levanter's own paired configs set it: AdamW as ``gpt2_small_fast.yaml``
  (learning rate 1e-3, weight decay 0.1, warmup 1% of the run), Sophia-H as
  ``gpt2_small_fast_sophia_h.yaml`` (0.85e-3) with the ``optim/sophia-h_*.yaml`` settings
  (weight decay 0.2, gamma 0.01, minimum learning rate 0.1 x, and their 2,000 warmup steps);
  cosine decay for both;
- held-out loss every ``EVAL_EVERY`` steps on the same ``EVAL_BATCHES`` batches.

The result is the ratio of tokens: how many Sophia needs to reach the held-out loss AdamW ends
with (interpolated between evaluations), over the tokens AdamW spent. Below 1 is faster than
AdamW; 0.5 would be the README's "2x". Whatever it shows is recorded.

Every run checkpoints every ``SAVE_MINUTES`` minutes under ``--workdir`` and has a fixed id, so an
interrupted run (a session's end, ``kill``) resumes where it stopped when the command is run
again; the JSON summary is written when all runs are done.

    nice -n 19 .venv/bin/python bench/sophia_long.py --runs adamw,sophia-h,sophia-h-short-warmup \\
        --out bench/sophia-long.json --plot bench/sophia-long.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_gpt2

STEPS = 4000
EVAL_EVERY = 100
EVAL_BATCHES = 8
SAVE_MINUTES = 5
BATCH = 4

MODEL = {"type": "gpt2", "hidden_dim": 512, "num_layers": 6, "num_heads": 8, "seq_len": 256,
         "gradient_checkpointing": False, "unroll_layers": True}  # fmt: skip

RUNS: dict[str, dict] = {
    # gpt2_small_fast.yaml's optimizer (Levanter's AdamW against which its Sophia configs ran).
    "adamw": {"type": "adam", "learning_rate": 1e-3, "weight_decay": 0.1, "warmup": 0.01, "min_lr_ratio": 0.1},
    # gpt2_small_fast_sophia_h.yaml's rate, optim/sophia-h_small.yaml's other settings.
    "sophia-h": {"type": "sophia-h", "learning_rate": 0.85e-3, "weight_decay": 0.2, "gamma": 0.01,
                 "min_lr_ratio": 0.1, "warmup": 2000},
    # gpt2_small_fast_sophiah.yaml: Levanter's other small Sophia-H config, warmup 1% of the run.
    "sophia-h-short-warmup": {"type": "sophia-h", "learning_rate": 0.8e-3, "weight_decay": 0.2, "gamma": 0.01,
                              "min_lr_ratio": 0.1, "warmup": 0.01},
    # Sophia-G with the same settings (Levanter ships no Sophia-G config).
    "sophia-g": {"type": "sophia-g", "learning_rate": 0.85e-3, "weight_decay": 0.2, "gamma": 0.01,
                 "min_lr_ratio": 0.1, "warmup": 2000},
}  # fmt: skip


def config(workdir: str, tokenizer: str, name: str, steps: int) -> dict:
    raw = reference_gpt2.train_config(workdir, tokenizer, steps, f"long-{name}-{steps}")
    raw["model"] = dict(MODEL)
    raw["optimizer"] = dict(RUNS[name])
    raw["trainer"].update(
        train_batch_size=BATCH,
        mp="p=f32",
        steps_per_eval=EVAL_EVERY,
        max_eval_batches=EVAL_BATCHES,
    )
    # One temporary checkpoint at a time, replaced every SAVE_MINUTES, so that a stopped run
    # resumes; none kept at the end (280 MB each, and nothing reads them).
    raw["trainer"]["checkpointer"]["keep"] = []
    raw["trainer"]["checkpointer"]["save_interval"] = f"{SAVE_MINUTES}m"
    return raw


def metrics_of(workdir: str, run_id: str) -> list[dict]:
    """The run's logged steps, the last record of each step winning (a resumed run logs again
    the steps after its checkpoint)."""
    by_step: dict[int, dict] = {}
    with open(os.path.join(workdir, "logs", run_id, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "step" in record:
                by_step.setdefault(record["step"], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def run(workdir: str, tokenizer: str, name: str, steps: int) -> dict:
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config
    from levanter_core.run import run_training

    raw = config(workdir, tokenizer, name, steps)
    cfg = validate_train_config(raw, Sources("bench"))
    run_training(cfg, progress=False)
    metrics = metrics_of(workdir, raw["trainer"]["id"])
    tokens_per_step = BATCH * MODEL["seq_len"]
    evals = [(m["step"], m["eval/loss"]) for m in metrics if "eval/loss" in m]
    train = [(m["step"], m["train/loss"]) for m in metrics if "train/loss" in m]
    return {
        "optimizer": RUNS[name],
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "eval_curve": evals,
        "train_curve": train,
        "final_eval_loss": evals[-1][1],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which ``curve`` (step, loss) falls to ``target``, linearly
    interpolated between its points; None if it never does."""
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def compare(results: dict) -> dict:
    """Each run's tokens to reach AdamW's final held-out loss, as a ratio of AdamW's tokens."""
    reference = results["adamw"]
    target = reference["final_eval_loss"]
    reference_tokens = reference["steps"] * reference["tokens_per_step"]
    out = {"target_loss": target, "adamw_tokens": reference_tokens}
    for name, r in results.items():
        step = steps_to_reach(r["eval_curve"], target)
        out[name] = {
            "final_eval_loss": r["final_eval_loss"],
            "step_reaching_target": step,
            "tokens_ratio": None if step is None else step * r["tokens_per_step"] / reference_tokens,
        }
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        steps, losses = zip(*r["eval_curve"])
        ax.plot([s * r["tokens_per_step"] / 1e6 for s in steps], losses, marker=".", label=name)
    ax.axhline(results["adamw"]["final_eval_loss"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title("GPT-2, 23 M parameters: Sophia against AdamW (Levanter's settings)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workdir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sophia-long-work")
    )
    parser.add_argument("--runs", default="adamw,sophia-h", help=f"comma-separated, of {sorted(RUNS)}")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", required=True, help="the JSON summary")
    parser.add_argument("--plot", help="a PNG of the held-out curves")
    args = parser.parse_args(argv)

    from levanter_core.data.source import PythonStdlibSourceConfig

    os.makedirs(args.workdir, exist_ok=True)
    tokenizer = os.path.join(args.workdir, "tokenizer.json")
    if not os.path.exists(tokenizer):
        reference_gpt2.train_tokenizer(PythonStdlibSourceConfig(), tokenizer)
    names = args.runs.split(",")
    if "adamw" not in names:
        parser.error("--runs must include adamw (the reference)")
    results = {}
    for name in names:
        print(f"-- {name}: {args.steps} steps", flush=True)
        results[name] = run(args.workdir, tokenizer, name, args.steps)
        print(f"   final held-out loss {results[name]['final_eval_loss']:.4f}", flush=True)
    summary = {"runs": results, "comparison": compare(results), "machine": reference_gpt2.machine()}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["comparison"], indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
