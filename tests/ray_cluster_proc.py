"""One process of a two-process run that tokenizes on the run's Ray cluster: it enters
``ray_for_run``, process 0 builds the cache of DATA_DIR at CACHE_DIR on that cluster, and
every process records the processes it started (the Ray node and everything under it).
Writes a JSON report to OUT. Usage: ray_cluster_proc.py PORT PROCESS_ID DATA_DIR CACHE_DIR OUT [ADDRESS]"""

import json
import logging
import os
import sys

from levanter_core import distributed
from levanter_core.data.cache import open_cache
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.distributed.ray_cluster import ray_for_run
from levanter_core.errors import LevanterError
from levanter_core.trainer.config import DistributedConfig, RayConfig

port, process_id = int(sys.argv[1]), int(sys.argv[2])
data_dir, cache_dir, out = sys.argv[3:6]
address = sys.argv[6] if len(sys.argv) > 6 else None


def descendants(root: int) -> list[tuple[int, str]]:
    """The processes under ``root``, as (pid, start time): a pid with its start time names one process."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            parents[int(entry)] = (int(fields[1]), fields[19])  # ppid, start time
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent:
                found.append((pid, started))
                frontier.append(pid)
    return found


class KeepSpread(logging.Handler):
    """Keeps the shards-per-node count the Ray build logs."""

    shards_by_node: dict = {}

    def emit(self, record):
        if hasattr(record, "shards_by_node"):
            KeepSpread.shards_by_node = record.shards_by_node


logging.basicConfig(level=logging.INFO)
logging.getLogger("levanter_core").addHandler(KeepSpread())
distributed.initialize(
    DistributedConfig(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id, heartbeat_timeout_seconds=10
    )
)
report = {}
try:
    with ray_for_run(RayConfig(address=address)) as effective:
        report["address"] = effective.address
        if distributed.is_leader():
            source = UrlSourceConfig(train_urls=[f"{data_dir}/part*.jsonl"])
            cache = open_cache(
                cache_dir,
                source,
                "train",
                ByteTokenizer(),
                enforce_eos=True,
                skip_bad_data=False,
                background=False,
                ray=effective,
            )
            report["documents"] = cache.num_documents
        distributed.barrier("test/built")
        report["started"] = descendants(os.getpid())
        with open(out, "w") as f:  # now, so the test can end them should this process hang
            json.dump(report, f)
    report["shards_by_node"] = KeepSpread.shards_by_node
except LevanterError as e:
    report["error"] = str(e)
with open(out, "w") as f:
    json.dump(report, f)
