"""Data sources that misbehave on purpose, for tests: one reads slowly (training that
starts before its cache is complete), one kills the worker process reading it. Importable
by the tokenizing worker processes (they unpickle the source config), so they live in a
module, not in a test function."""

import os
import time
from collections.abc import Iterator

from levanter_core.data.source import Record, UrlSourceConfig
from levanter_core.plugins import hookimpl


class SlowUrlSourceConfig(UrlSourceConfig):
    """``type: slow_url``: a ``url`` source that waits ``seconds_per_shard`` before each file."""

    type: str = "slow_url"
    seconds_per_shard: float = 1.0

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        time.sleep(self.seconds_per_shard)
        yield from super().records(split, shard, start)


class DyingUrlSourceConfig(UrlSourceConfig):
    """``type: dying_url``: a ``url`` source whose worker process exits abruptly (as if
    killed, or out of memory) when it starts reading a file named ``*die*``."""

    type: str = "dying_url"

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        if "die" in os.path.basename(shard):
            os._exit(9)
        yield from super().records(split, shard, start)


class SlowSourcePlugin:
    @hookimpl
    def register_data_sources(self, register):
        register("slow_url", SlowUrlSourceConfig)
