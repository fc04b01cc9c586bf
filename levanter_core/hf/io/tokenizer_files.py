"""The tokenizer files that travel with a model: copied from a Hugging Face model into an import
(its ``hf_tokenizer``), and written with an export (the run's tokenizer, or the files an import
brought along)."""

from __future__ import annotations

import json
import logging
import os

from levanter_core.data.tokenizer import find_tokenizer_json, load_tokenizer, split_tokenizer_spec
from levanter_core.errors import CheckpointError, DataError
from levanter_core.fileio import join, list_names, read_bytes, write_bytes, write_text_atomically
from levanter_core.hf.io.chat_template import _trained_chat_template, _write_trained_chat_template

# the name its log lines had before the split from levanter_core.hf.bridge (the CLI prints it)
logger = logging.getLogger("levanter_core.hf.bridge")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Files of a Hugging Face tokenizer that travel with a model."""

HF_TOKENIZER_DIR = "hf_tokenizer"
"""Where an imported checkpoint keeps the tokenizer files it came with."""


def _copy_tokenizer_files(source: str, target: str) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``source`` has into ``target`` (each a local
    directory or a URL: an import in a bucket keeps them in its ``hf_tokenizer``); returns
    their names."""
    present = [f for f in TOKENIZER_FILES if f in set(list_names(source))]
    for f in present:
        write_bytes(join(target, f), read_bytes(join(source, f)))
    return present


def _run_tokenizer(run_config: dict):
    spec = (run_config.get("data") or {}).get("tokenizer")
    if not spec:
        raise CheckpointError("the checkpoint's config names no data.tokenizer, so its vocabulary size is unknown")
    return load_tokenizer(spec)


def _tokenizer_directory(spec: str | None) -> str | None:
    """The local directory holding the files of the tokenizer ``spec`` names: a directory
    itself, or a hub name's snapshot in the Hugging Face cache (None for ``byte``, a lone
    ``tokenizer.json``, or a remote location)."""
    if not spec or spec == "byte":
        return None
    if os.path.isdir(spec):
        return spec
    try:
        fs, path = find_tokenizer_json(spec)
    except DataError:
        return None
    if os.path.isfile(spec) or "file" not in fs.protocol:  # a lone tokenizer.json, or a remote one
        return None
    return os.path.dirname(path)


def _write_tokenizer(tokenizer_dirs: tuple[str, ...], run_config: dict, output: str, tokenizer=None) -> None:
    """Tokenizer files for the export: the run's tokenizer grown by ``special_tokens`` (its
    ``tokenizer.json``, and a ``tokenizer_config.json`` naming the added tokens); else those an
    import brought along (``tokenizer_dirs``, local or in a bucket), else the run's tokenizer (its
    directory's files, or its hub snapshot's, or its ``tokenizer.json`` rebuilt)."""
    spec = (run_config.get("data") or {}).get("tokenizer")
    if spec and split_tokenizer_spec(spec)[1]:  # special tokens added to a tokenizer: write the grown one
        tokenizer = tokenizer or _run_tokenizer(run_config)
        template = _trained_chat_template(run_config, tokenizer)
        for name, text in tokenizer.hf_files(chat_template=template).items():
            write_text_atomically(os.path.join(output, name), text)
        return
    for directory in (*tokenizer_dirs, _tokenizer_directory(spec)):
        if directory and "tokenizer.json" in _copy_tokenizer_files(directory, output):
            break
    else:
        if not spec:
            logger.warning("the checkpoint names no tokenizer; the export has none")
            return
        tokenizer = tokenizer or _run_tokenizer(run_config)
        write_text_atomically(os.path.join(output, "tokenizer.json"), tokenizer.to_tokenizer_json())
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if tokenizer.eos_token is not None:
            tokenizer_config["eos_token"] = tokenizer.eos_token
        write_text_atomically(
            os.path.join(output, "tokenizer_config.json"), json.dumps(tokenizer_config, indent=2) + "\n"
        )
    # whichever files were written, a run trained on chat data exports the template it used
    _write_trained_chat_template(run_config, output)
