"""Importing a Hugging Face model: loading its checkpoint (a directory or a hub name) as our
model, and writing it as our checkpoint (``levanter import-hf``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from haliax import Axis

from levanter_core.checkpoint import COMMIT_MARKER, write_checkpoint
from levanter_core.errors import CheckpointError
from levanter_core.fileio import join, list_names, normalize
from levanter_core.hf.checkpoint import HfCheckpoint
from levanter_core.hf.convert import load_hf_weights
from levanter_core.hf.io.source import config_from_hf, read_hf_config, resolve_source
from levanter_core.hf.io.tokenizer_files import HF_TOKENIZER_DIR, _copy_tokenizer_files
from levanter_core.plugins import get_manager


@dataclass
class HfModel:
    """A model loaded from a Hugging Face checkpoint."""

    model: Any
    config: Any
    """Our model config (an :class:`~levanter_core.hf.convert.HfConvertible` LmConfig)."""
    Vocab: Axis
    directory: str
    hf_config: dict


def load_hf_model(source: str, *, config: Any | None = None) -> HfModel:
    """Load a Hugging Face checkpoint (directory or hub name) as our model.

    With ``config`` (ours), the weights must fit that config exactly; without, the
    config is derived from the checkpoint's ``config.json``."""
    directory = resolve_source(source)
    hf_config = read_hf_config(directory)
    if config is None:
        config = config_from_hf(hf_config, source=os.path.join(directory, "config.json"))
    vocab_size = hf_config.get("vocab_size")
    if not isinstance(vocab_size, int):
        raise CheckpointError(f"{directory}/config.json has no integer vocab_size")
    Vocab = Axis("vocab", vocab_size)
    model = load_hf_weights(config, Vocab, HfCheckpoint(directory))
    return HfModel(model, config, Vocab, directory, hf_config)


def import_hf(source: str, output: str, *, seq_len: int | None = None) -> str:
    """Write the Hugging Face model ``source`` as our checkpoint at ``output`` (a model-only
    checkpoint at step 0, with its config, the original ``config.json`` and the tokenizer
    files). Returns ``output``."""
    output = normalize(output)
    present = list_names(output)
    if COMMIT_MARKER in present:
        raise CheckpointError(f"{output} already holds a checkpoint; choose another output directory")
    if present:
        raise CheckpointError(f"{output} exists and is not empty; choose another output directory")
    loaded = load_hf_model(source)
    config = loaded.config if seq_len is None else loaded.config.model_copy(update={"seq_len": seq_len})
    metadata = {
        "config": {"model": config.model_dump(mode="json")},
        "vocab_size": loaded.Vocab.size,
        "hf_config": loaded.hf_config,
        "imported_from": source,
        "plugins": get_manager().versions(),
    }
    write_checkpoint({"model": loaded.model}, output, step=0, metadata=metadata)
    _copy_tokenizer_files(loaded.directory, join(output, HF_TOKENIZER_DIR))
    return output
