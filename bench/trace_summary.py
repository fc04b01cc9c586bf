"""Where a profiled step's device time goes: a JAX profiler trace summed by kind of work.

    python bench/trace_summary.py TRACE.json.gz [--steps N] [--top 25] [--json OUT.json]

Reads the Perfetto trace that ``trainer.profiler_perfetto_link`` writes (``reference_gpt2.py
--profile``). On a GPU it takes the kernels of the ``/device:GPU:N`` streams; on a CPU, the XLA
operations of the runtime's threads. Each kernel is put in one kind by its name (matrix products,
fused attention, collectives, copies, other fusions) and the kinds are given as time per step and
as a share of the device's busy time; the busy time (kernels' union over all streams) against the
traced span says how long the device sat idle, waiting on the host. ``--steps`` divides the totals
by the number of profiled steps.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

KINDS: list[tuple[str, re.Pattern]] = [
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all", re.I)),
    ("attention", re.compile(r"cudnn|fmha|flash|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma|matmul|dot|sm\d+_", re.I)),
    ("copy", re.compile(r"memcpy|memset|^copy|^transpose|^dynamic[-_]update[-_]slice", re.I)),
    ("reduction", re.compile(r"reduce|softmax|norm", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|elementwise|convert|add|multiply", re.I)),
]
"""Kinds of device work by the kernel's (or HLO operation's) name, first match wins."""


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def device_events(trace: dict) -> tuple[list[dict], str]:
    """The complete events of the device's work, and where they came from."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    gpu = {pid for pid, name in processes.items() if name.startswith("/device:GPU")}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if gpu:
        # a GPU process has its streams and, beside them, summary lines (XLA modules, XLA ops) that
        # repeat the kernels' time: keep the streams' kernels
        def on_stream(e):
            thread = threads.get((e["pid"], e.get("tid")), "")
            return "stream" in thread.lower() and "xla" not in thread.lower()

        kernels = [e for e in complete if e["pid"] in gpu and on_stream(e)]
        if not kernels:
            kernels = [e for e in complete if e["pid"] in gpu]
        return kernels, "GPU kernels"
    runtime = {key for key, name in threads.items() if name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient"))}
    ops = [
        e
        for e in complete
        if (e["pid"], e.get("tid")) in runtime and not e["name"].startswith(("end: ", "ThunkExecutor"))
    ]
    return ops, "CPU XLA operations"


def busy_time(events: list[dict]) -> float:
    """The union of the events' intervals, in microseconds."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(trace: dict, steps: int = 1, top: int = 25) -> dict:
    events, source = device_events(trace)
    if not events:
        raise SystemExit("the trace holds no device work (was the profiled step on the device?)")
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy = busy_time(events)
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        name = e["name"]
        op = (e.get("args") or {}).get("hlo_op")
        by_kind[kind_of(name if op is None else f"{name} {op}")] += e["dur"]
        entry = by_name[name]
        entry[0] += e["dur"]
        entry[1] += 1
    summed = sum(by_kind.values())
    ms = 1e-3 / steps
    return {
        "source": source,
        "events": len(events),
        "steps": steps,
        "span_ms_per_step": span * ms,
        "busy_ms_per_step": busy * ms,
        "idle_share": 1 - busy / span if span else 0.0,
        "kinds": {
            k: {"ms_per_step": v * ms, "share": v / summed} for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {"name": n, "kind": kind_of(n), "ms_per_step": t * ms, "calls_per_step": c / steps, "share": t / summed}
            for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def markdown(summary: dict) -> str:
    lines = [
        f"{summary['source']}: {summary['events']} over {summary['steps']} step(s); "
        f"{summary['busy_ms_per_step']:.1f} ms busy of {summary['span_ms_per_step']:.1f} ms a step "
        f"({100 * summary['idle_share']:.1f}% idle)",
        "",
        "| kind | ms a step | share of kernel time |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['ms_per_step']:.2f} | {100 * v['share']:.1f}% |" for k, v in summary["kinds"].items()]
    lines += ["", "| kernel | kind | ms a step | calls a step | share |", "|---|---|---|---|---|"]
    for t in summary["top"]:
        name = t["name"] if len(t["name"]) <= 90 else t["name"][:87] + "..."
        lines.append(
            f"| `{name}` | {t['kind']} | {t['ms_per_step']:.2f} | {t['calls_per_step']:.0f} | {100 * t['share']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Perfetto trace (.json or .json.gz) of jax.profiler")
    parser.add_argument("--steps", type=int, default=1, help="how many steps the trace holds (default 1)")
    parser.add_argument("--top", type=int, default=25, help="how many kernels to list (default 25)")
    parser.add_argument("--json", default=None, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    summary = summarize(load(args.trace), args.steps, args.top)
    print(markdown(summary), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
