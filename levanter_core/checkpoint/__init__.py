"""Checkpoints: the ``trainer.checkpointer`` section, the save policy, and the
built-in TensorStore checkpointer (``type: tensorstore``)."""

from levanter_core.checkpoint.base import Checkpointer, CheckpointerConfig, CheckpointInterval
from levanter_core.checkpoint.tensorstore import (
    COMMIT_MARKER,
    METADATA_FILE,
    TensorStoreCheckpointer,
    TensorStoreCheckpointerConfig,
    discover_latest,
    load_checkpoint,
    read_metadata,
    write_checkpoint,
)

__all__ = [
    "COMMIT_MARKER",
    "METADATA_FILE",
    "CheckpointInterval",
    "Checkpointer",
    "CheckpointerConfig",
    "TensorStoreCheckpointer",
    "TensorStoreCheckpointerConfig",
    "discover_latest",
    "load_checkpoint",
    "read_metadata",
    "write_checkpoint",
]
