"""Exporting our model as a Hugging Face model directory (``levanter export-hf``): ``config.json``,
sharded safetensors with their index and the tokenizer files, written locally or sent to an
object store; a LoRA run's adapters merged into the weights, or as a PEFT adapter directory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from haliax import Axis

from levanter_core import lora
from levanter_core.config.types import parse_size as parse
from levanter_core.errors import CheckpointError, ConfigError
from levanter_core.fileio import is_local, join, list_names, write_text_atomically
from levanter_core.hf.checkpoint import upload_hf_directory, write_hf_checkpoint
from levanter_core.hf.convert import HfConvertible, to_hf_state_dict
from levanter_core.hf.io.checkpoint_model import CheckpointModel, load_checkpoint_model, read_metadata_of
from levanter_core.hf.io.special_tokens import _special_token_ids
from levanter_core.hf.io.tokenizer_files import HF_TOKENIZER_DIR, _write_tokenizer
from levanter_core.hf.peft import task_type_of, write_peft_adapter

# the name its log lines had before the split from levanter_core.hf.bridge (the CLI prints it)
logger = logging.getLogger("levanter_core.hf.bridge")

# config.json keys that describe the file, not the model, and legacy spellings that the
# plugin's config supersedes (transformers would prefer a stale `rope_scaling` over the
# `rope_parameters` we write)
_DROPPED_HF_KEYS = (
    "architectures",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "rope_scaling",
    "rope_theta",
    "rope_local_base_freq",
    "sliding_window_pattern",
)


def export_hf(
    checkpoint: str,
    output: str,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 1024**3,
    averaged: bool = True,
    peft: bool = False,
    overwrite: bool = False,
) -> str:
    """Write our checkpoint (a training checkpoint, a run's checkpoint directory, or an
    import; local or in a bucket) as a Hugging Face model directory: ``config.json``, sharded
    safetensors with their index, and the tokenizer files. Returns ``output``, a local
    directory or an object-store URL (see :func:`local_output`).

    ``output`` must not exist or be empty, as for :func:`~levanter_core.hf.io.importer.import_hf`,
    unless ``overwrite``: then an earlier export there is replaced (its weights removed first, so
    that no shard of it is left beside the new ones).

    A LoRA run's checkpoint is written with its adapters merged into the weights, or, with
    ``peft``, as a PEFT adapter directory for its base model (:mod:`levanter_core.hf.peft`).

    A run with ``trainer.model_averaging`` keeps the running average beside the trained
    weights; evaluation uses the average, and so does the export unless ``averaged`` is
    false (then the trained weights themselves are written).

    ``config.json`` carries the special token ids (``pad_token_id``, ``bos_token_id``,
    ``eos_token_id``) of the exported tokenizer; an id it does not define is the imported
    ``config.json``'s, else null, and never one outside the vocabulary."""
    _check_output(output, overwrite=overwrite)
    loaded = load_checkpoint_model(checkpoint, averaged=averaged)
    model, config, Vocab, found, run_config = loaded.model, loaded.config, loaded.Vocab, loaded.path, loaded.run_config
    if peft:
        return _export_peft(loaded, output)
    if not isinstance(config, HfConvertible):
        raise CheckpointError(f"model type {config.type!r} has no Hugging Face equivalent to export to")
    try:
        translated = config.to_hf_config(Vocab.size)
    except ValueError as e:  # a setting the Hugging Face architecture does not have
        raise CheckpointError(f"{found} cannot be exported: {e}") from None
    with local_output(output) as directory:
        write_hf_model(
            model,
            config,
            Vocab,
            directory,
            run_config=run_config,
            imported_hf_config=loaded.stored.get("hf_config"),
            tokenizer_dirs=(join(found, HF_TOKENIZER_DIR),),
            tokenizer=loaded.tokenizer,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            translated=translated,
        )
        if not is_local(output):
            upload_hf_directory(directory, output)
    logger.info("exported %s to %s", found, output)
    return output


def _check_output(output: str, *, overwrite: bool) -> None:
    """Refuse an ``output`` that holds anything unless ``overwrite``; with it, remove the weights
    of an earlier export in a local ``output`` (the rest is written over)."""
    present = list_names(output)
    if present and not overwrite:
        raise CheckpointError(
            f"{output} exists and is not empty; choose another output directory, or pass --overwrite to "
            "replace what is there"
        )
    if present and is_local(output):
        for name in present:
            if name.endswith((".safetensors", ".safetensors.index.json")):
                os.remove(os.path.join(output, name))


def _export_peft(loaded: CheckpointModel, output: str) -> str:
    if loaded.lora is None:
        raise CheckpointError(
            f"{loaded.path} was not trained with LoRA (no lora section): it has no adapters to export"
        )
    base = loaded.stored.get("lora_base") or {}
    source = base.get("initialize_from_hf")
    if source is None:
        found_import = base.get("initialize_from")
        imported = read_metadata_of(found_import).get("imported_from") if found_import else None
        source = imported
    with local_output(output) as directory:
        task = task_type_of(loaded.config, loaded.Vocab.size)
        modules = write_peft_adapter(
            loaded.model, loaded.lora, directory, base_model_name_or_path=source, task_type=task
        )
        _write_tokenizer((join(loaded.path, HF_TOKENIZER_DIR),), loaded.run_config, directory, loaded.tokenizer)
        if not is_local(output):
            upload_hf_directory(directory, output)
    logger.info("exported the LoRA adapters of %s (%d modules) to %s", loaded.path, len(modules), output)
    return output


@contextlib.contextmanager
def local_output(output: str) -> Iterator[str]:
    """The local directory to write an export for ``output`` into: ``output`` itself when it
    is local; for an object-store URL (``s3://``, ``gs://``), a new temporary directory, removed
    when the block ends, whose contents the caller sends to ``output`` with
    :func:`~levanter_core.hf.checkpoint.upload_hf_directory` once they are complete (the
    export is written whole before any of it is uploaded, so it needs the local space)."""
    if is_local(output):
        yield output
        return
    with tempfile.TemporaryDirectory(prefix="levanter-export-") as directory:
        yield directory


def write_hf_model(
    model: Any,
    config: Any,
    Vocab: Axis,
    output: str,
    *,
    run_config: dict,
    imported_hf_config: dict | None = None,
    tokenizer_dirs: tuple[str, ...] = (),
    tokenizer=None,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 1024**3,
    translated: dict | None = None,
) -> list[str]:
    """Write ``model`` (of the :class:`HfConvertible` ``config``, arrays this process can read)
    as a Hugging Face model directory ``output``: ``config.json`` (the translated config over
    ``imported_hf_config``, with the tokenizer's special token ids), sharded safetensors, and
    the tokenizer files (from the first of ``tokenizer_dirs`` that has them, else the run's
    ``data.tokenizer``). Returns the safetensors files written."""
    if translated is None:
        try:
            translated = config.to_hf_config(Vocab.size)
        except ValueError as e:  # a setting the Hugging Face architecture does not have
            raise CheckpointError(f"the model cannot be exported: {e}") from None
    if lora.has_adapters(model):  # a LoRA model is written with its adapters merged into its weights
        model = lora.merge(model)
    # every parameter is floating point; jnp.dtype knows bfloat16, NumPy alone does not
    tensors = {name: array.astype(jnp.dtype(dtype)) for name, array in to_hf_state_dict(model).items()}

    os.makedirs(output, exist_ok=True)
    _write_tokenizer(tokenizer_dirs, run_config, output, tokenizer)
    hf_config = {k: v for k, v in (imported_hf_config or {}).items() if k not in _DROPPED_HF_KEYS}
    hf_config.update(translated)
    hf_config.update(_special_token_ids(output, hf_config, Vocab.size))
    hf_config["architectures"] = [config.hf_architecture]
    hf_config["torch_dtype"] = dtype
    write_text_atomically(os.path.join(output, "config.json"), json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return write_hf_checkpoint(output, tensors, max_shard_bytes=max_shard_bytes)


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"1024"`` -> bytes (``--max-shard-size``)."""
    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
