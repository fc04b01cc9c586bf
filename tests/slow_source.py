"""A data source that reads JSON-lines files slowly, for tests of training that starts
before its cache is complete. Importable by the tokenizing worker processes (they
unpickle the source config), so it lives in a module, not in a test function."""

import time
from typing import Iterator

from levanter_core.data.source import Record, UrlSourceConfig
from levanter_core.plugins import hookimpl


class SlowUrlSourceConfig(UrlSourceConfig):
    """``type: slow_url``: a ``url`` source that waits ``seconds_per_shard`` before each file."""

    type: str = "slow_url"
    seconds_per_shard: float = 1.0

    def records(self, split: str, shard: str, start: int = 0) -> Iterator[Record]:
        time.sleep(self.seconds_per_shard)
        yield from super().records(split, shard, start)


class SlowSourcePlugin:
    @hookimpl
    def register_data_sources(self, register):
        register("slow_url", SlowUrlSourceConfig)
