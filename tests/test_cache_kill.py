"""A cache build killed with SIGKILL at several moments resumes to the same cache as a build
that was never interrupted.

Each kind of moment once or twice (before any shard finished, at a shard boundary, mid-shard, on
a build that had itself resumed): every kill costs a build process and its two worker processes,
each of which imports the framework, so the corpus is as small as leaves room for them."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_cache import assert_same_cache, build, source, write_corpus

SHARDS = 12
LINES = 2500  # about three flushes (progress reports) per shard: kills land mid-shard too

BUILD = """
import sys
from levanter_core.data.cache import open_cache
from levanter_core.data.config import CacheOptions
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import load_tokenizer
src = UrlSourceConfig(train_urls=[sys.argv[1] + "/part*.jsonl"])
open_cache(sys.argv[2], src, "train", load_tokenizer("byte"), enforce_eos=True, skip_bad_data=False,
           num_workers=2, cache_options=CacheOptions(batch_size=100, target_size_per_flush="50KB", in_process_below=0), background=False)
"""


def read_ledger(path):
    try:
        with open(os.path.join(path, "ledger.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def finished(ledger) -> int:
    return sum(s["finished"] for s in ledger["shards"]) if ledger else 0


def mid_shard(ledger) -> bool:
    return bool(ledger) and any(0 < s["records"] < LINES and not s["finished"] for s in ledger["shards"])


# When to kill, judged from the ledger on disk.
KILL_POINTS = [
    ("the ledger first appears", lambda ledger: ledger is not None),
    ("2 shards finished", lambda ledger: finished(ledger) >= 2),
    ("a shard half done", mid_shard),
    ("5 shards finished", lambda ledger: finished(ledger) >= 5),
    ("a shard half done again", lambda ledger: finished(ledger) >= 7 and mid_shard(ledger)),
]


@pytest.mark.slow
def test_killed_build_resumes_to_the_same_cache(tmp_path):
    data, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_corpus(data, files=SHARDS, lines=LINES)
    kills = []
    for name, condition in KILL_POINTS:
        process = subprocess.Popen([sys.executable, "-c", BUILD, data, cache], stderr=subprocess.PIPE, text=True)
        while process.poll() is None and not condition(read_ledger(cache)):
            time.sleep(0.005)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            ledger = read_ledger(cache)
            kills.append((name, finished(ledger), ledger["num_documents"] if ledger else None))
        process.wait()
        time.sleep(0.3)  # let the orphaned workers notice their coordinator is gone
        if read_ledger(cache) and read_ledger(cache)["complete"]:
            break
    assert len(kills) >= 4, f"too few kills landed: {kills}"

    last = subprocess.run([sys.executable, "-c", BUILD, data, cache], capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr
    assert read_ledger(cache)["complete"]

    build(tmp_path / "whole", source(tmp_path / "data"))
    assert_same_cache(cache, tmp_path / "whole")
    print("kills:", kills)
