"""How long the commands that only list plugins take, with every plugin of the repository
installed: ``levanter plugins``, ``levanter configs`` and ``levanter --help`` (wall time of the
whole process, median of ``--repeats`` runs after one warm-up).

    .venv/bin/python bench/discovery.py [--repeats 7] [--out FILE.json]

They import no model code and no JAX (types are registered by import path; tests/test_plugins.py
checks that), so they stay fast however many plugins are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {"levanter plugins": ["plugins"], "levanter configs": ["configs"], "levanter --help": ["--help"]}


def time_command(args: list[str], repeats: int) -> dict:
    levanter = os.path.join(os.path.dirname(sys.executable), "levanter")
    subprocess.run([levanter, *args], capture_output=True, check=True)  # warm the file cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([levanter, *args], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    listed = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "levanter"), "plugins", "--json"], capture_output=True, text=True
    )
    plugins = json.loads(listed.stdout)["plugins"]
    figures = {"plugins_installed": len(plugins), "types": sum(len(v) for p in plugins for v in p["types"].values())}
    for label, command in COMMANDS.items():
        figures[label] = time_command(command, args.repeats)
        print(
            f"{label:<20} median {figures[label]['median_s']:.3f} s  (min {figures[label]['min_s']:.3f}, "
            f"max {figures[label]['max_s']:.3f})"
        )
    print(f"{figures['plugins_installed']} plugins, {figures['types']} types installed")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
