"""The ``trainer.checkpointer`` section, by its old import path: the base class and save policy
live in :mod:`levanter_core.checkpoint.base`, the TensorStore checkpointer's config beside its
implementation in :mod:`levanter_core.checkpoint.tensorstore`. Every name is re-exported here,
so ``levanter_core.checkpoint.config:TensorStoreCheckpointerConfig`` (the built-in plugin's
registration) and ``levanter_core.checkpoint.config:CheckpointerConfig`` keep working."""

from levanter_core.checkpoint.base import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointInterval,
    _all_processes_agree,
    _process_zero_decides,
    _reason,
)
from levanter_core.checkpoint.tensorstore import TensorStoreCheckpointerConfig

__all__ = [
    "CheckpointInterval",
    "Checkpointer",
    "CheckpointerConfig",
    "TensorStoreCheckpointerConfig",
    "_all_processes_agree",
    "_process_zero_decides",
    "_reason",
]
