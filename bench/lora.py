"""LoRA beside full fine-tuning (issue 24): parameters trained, optimizer state and step time,
on the same model, batch and optimizer.

The model is a preset of ``reference_gpt2.py`` (default ``llama``: the Llama of the reference
GPT-2's size, hidden 256, 4 layers, 4 heads, ``intermediate_dim`` 704, tied embeddings, 8,192
tokens, 5.31 M parameters), built at random by its plugin and taken as the base to fine-tune.
Each variant is a :class:`~levanter_core.trainer.trainer.Trainer` state made with
``state_from_model`` around that base, trained with AdamW (the reference run's section: lr 1e-3,
weight decay 0.1) on one fixed batch of random tokens (the preset's batch and ``seq_len``):

* ``full``: every weight trained;
* ``lora-rN``: ``lora.loraize(base, LoraConfig(r=N, alpha=2N))`` on every linear layer but the
  output head (the default ``target_modules``), only the adapters trained.

Sizes are the sums of the arrays' bytes: the optimizer state (``state.opt_state``), the whole
training state (model, optimizer state, step, key) and what a checkpoint holds (the whole state
for ``full``; ``lora.strip_base`` of it, the adapters and their optimizer state, for LoRA).
Step time: after ``--warmup`` steps (compilation), the variants take turns, ``--rounds`` times,
each round ``--steps`` steps whose mean is taken; each variant's best round is kept, so that a
burst of another process lands on no variant alone (as ``optimizers.py timing`` does). Freed
host memory is kept for reuse, as ``levanter train`` keeps it (``trainer.keep_host_memory``).

    .venv/bin/python bench/lora.py [--model llama] [--ranks 8 16] [--steps 10] [--rounds 3]
                                   [--warmup 3] [--out bench/lora.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_gpt2

OPTIMIZER = {"learning_rate": 1e-3, "weight_decay": 0.1}
"""The reference run's ``optimizer:`` section (type ``adam``: AdamW)."""


def array_bytes(tree) -> int:
    """The bytes of every array in ``tree``."""
    import equinox as eqx
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def measure(model: str, ranks: list[int], *, steps: int, rounds: int, warmup: int) -> dict:
    """Every figure of full fine-tuning and of LoRA at each of ``ranks`` on the ``model``
    preset, as JSON-able data (see the module docstring)."""
    import haliax as hax
    import jax
    import numpy as np

    from levanter_core import lora
    from levanter_core.objective import LmObjective
    from levanter_core.plugins import registry
    from levanter_core.trainer.config import TrainerConfig
    from levanter_core.trainer.mesh import make_mesh
    from levanter_core.trainer.trainer import Trainer, trainable

    load_before = os.getloadavg()
    preset = reference_gpt2.PRESETS[model]
    fields = {k: v for k, v in preset["model"].items() if k != "type"}
    model_config = registry("model").get(preset["model"]["type"]).config_cls.model_validate(fields)
    trainer_config = TrainerConfig(num_train_steps=1000, **preset["trainer"])
    optimizer = registry("optimizer").get("adam").config_cls.model_validate(OPTIMIZER)
    trainer = Trainer(trainer_config, optimizer.build_for_trainer(1000), LmObjective(), mesh=make_mesh(trainer_config))
    Vocab = hax.Axis("vocab", reference_gpt2.VOCAB_SIZE)
    base = model_config.build(Vocab, key=jax.random.PRNGKey(0))
    shape = (trainer_config.train_batch_size, model_config.seq_len)
    tokens = np.random.default_rng(0).integers(0, Vocab.size, shape).astype(np.int32)

    variants = {"full": (base, None)}
    for r in ranks:
        config = lora.LoraConfig(r=r, alpha=2 * r)
        variants[f"lora-r{r}"] = (lora.loraize(base, config, key=jax.random.PRNGKey(r)), config)

    runs = {}
    for name, (start, config) in variants.items():
        state = trainer.state_from_model(start, jax.random.PRNGKey(1))
        saved = lora.strip_base(state) if config is not None else state
        figures = {
            "lora": config.model_dump() if config is not None else None,
            "adapted_layers": lora.target_layers(base, config) if config is not None else None,
            "parameters": lora.count_parameters(state.model),
            "trained_parameters": lora.count_parameters(trainable(state.model)),
            "optimizer_state_bytes": array_bytes(state.opt_state),
            "model_bytes": array_bytes(state.model),
            "state_bytes": array_bytes(state),
            "checkpoint_bytes": array_bytes(saved),
        }
        losses = []
        for _ in range(warmup):
            state, metrics = trainer.train_step(state, tokens)
            losses.append(float(metrics["train/loss"]))
        runs[name] = {"state": jax.block_until_ready(state), "figures": figures, "times": [], "losses": losses}

    for _ in range(rounds):
        for run in runs.values():
            state = run["state"]
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = trainer.train_step(state, tokens)
            run["state"] = jax.block_until_ready(state)
            run["times"].append((time.perf_counter() - start) / steps)
            run["losses"].append(float(metrics["train/loss"]))

    results = {
        name: {**run["figures"], "step_seconds": min(run["times"]), "rounds_seconds": run["times"],
               "loss_first_last": [run["losses"][0], run["losses"][-1]]}
        for name, run in runs.items()
    }  # fmt: skip
    compared = ("trained_parameters", "optimizer_state_bytes", "state_bytes", "checkpoint_bytes", "step_seconds")
    for figures in results.values():
        figures["vs_full"] = {key: figures[key] / results["full"][key] for key in compared}
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": reference_gpt2.machine(),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "model": {"preset": model, **preset},
        "optimizer": {"type": "adam", **OPTIMIZER},
        "batch": {"sequences": shape[0], "seq_len": shape[1]},
        "timing": {"warmup_steps": warmup, "steps_per_round": steps, "rounds": rounds},
        "variants": results,
    }


def print_table(results: dict) -> None:
    machine = results["machine"]
    load = results["load_average_1_5_15min"]
    print(f"{machine['nproc']} x {machine['cpu']}, jax {machine['jax']} ({machine['jax_backend']}); "
          f"load (1 min) {load['before'][0]:.2f} -> {load['after'][0]:.2f}")  # fmt: skip
    batch, timing = results["batch"], results["timing"]
    print(f"model {results['model']['preset']}, batch {batch['sequences']} x {batch['seq_len']}, AdamW; "
          f"best of {timing['rounds']} rounds of {timing['steps_per_round']} steps")  # fmt: skip
    header = ("variant", "trained params", "optimizer state", "whole state", "checkpoint", "step time")
    rows = []
    for name, v in results["variants"].items():
        ratio = v["vs_full"]
        rows.append((
            name,
            f"{v['trained_parameters']:,} ({ratio['trained_parameters']:.2%})",
            f"{v['optimizer_state_bytes'] / 2**20:.2f} MiB ({ratio['optimizer_state_bytes']:.3f}x)",
            f"{v['state_bytes'] / 2**20:.2f} MiB ({ratio['state_bytes']:.3f}x)",
            f"{v['checkpoint_bytes'] / 2**20:.2f} MiB ({ratio['checkpoint_bytes']:.3f}x)",
            f"{v['step_seconds']:.3f} s ({ratio['step_seconds']:.2f}x)",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="llama",
        choices=sorted(reference_gpt2.PRESETS),
        help="the model preset of reference_gpt2.py (default llama)",
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="LoRA ranks (default 8 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    from levanter_core.trainer.host_memory import keep_freed_memory

    keep_freed_memory()  # as `levanter train` does first (trainer.keep_host_memory), before JAX's threads
    results = measure(args.model, args.ranks, steps=args.steps, rounds=args.rounds, warmup=args.warmup)
    print_table(results)
    if args.out:
        reference_gpt2.write_json(args.out, results)


if __name__ == "__main__":
    main()
