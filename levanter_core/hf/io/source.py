"""Finding a Hugging Face model source (a local model directory, or a hub name fetched through
the Hugging Face cache) and reading its ``config.json`` into our model config.

Which of our model types reads a Hugging Face ``config.json`` is decided by the
``model_type_for_hf_config`` hook (two plugins that claim it for different types are a clash:
see :meth:`levanter_core.plugins.PluginManager.model_type_for_hf_config`); the per-model
translation is the plugin's :class:`~levanter_core.hf.convert.HfConvertible` config.
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

from huggingface_hub import hf_hub_download, snapshot_download

from levanter_core.errors import CheckpointError
from levanter_core.hf.convert import HfConvertible
from levanter_core.hf.io.tokenizer_files import TOKENIZER_FILES
from levanter_core.models.lm import LmConfig
from levanter_core.plugins import get_manager, registry


def resolve_source(source: str) -> str:
    """A local directory holding ``source``: ``source`` itself, or a download of the hub
    repository of that name (through the Hugging Face cache; a download needs network access)."""
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise CheckpointError(f"{source} is a file; expected a Hugging Face model directory (with config.json)")
    try:
        return snapshot_download(source, allow_patterns=["*.json", "*.safetensors", *TOKENIZER_FILES])
    except Exception as e:  # offline, unknown repository, gated model...
        raise CheckpointError(
            f"{source!r} is not a local directory and could not be fetched from the Hugging Face hub: {e}"
        ) from None


def read_source_hf_config(source: str) -> dict:
    """The ``config.json`` of ``source`` (a Hugging Face model directory, or a hub name: from
    the local Hugging Face cache, or downloaded when the hub is reachable), without fetching
    the weights."""
    if os.path.isdir(source):
        return read_hf_config(source)
    if os.path.exists(source):
        raise CheckpointError(f"{source} is a file; expected a Hugging Face model directory (with config.json)")
    try:
        path = hf_hub_download(source, "config.json")
    except Exception as e:  # offline and not cached, unknown repository, gated model...
        raise CheckpointError(
            f"{source!r} is not a local directory, and its config.json is neither in the local Hugging Face "
            f"cache nor reachable on the hub: {e}"
        ) from None
    return read_hf_config(os.path.dirname(path))


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a Hugging Face model directory: it has no config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return config


def config_from_hf(hf_config: dict, *, source: str = "config.json") -> Any:
    """Our model config for a Hugging Face config, through the plugin that claims it."""
    entry = get_manager().model_type_for_hf_config(hf_config)
    models = registry("model")
    if entry is None:
        convertible = [e for e in models if issubclass(e.config_cls, HfConvertible)]
        choices = ", ".join(f"{e.name} ({e.provider})" for e in convertible) or "none"
        raise CheckpointError(
            f"no installed model plugin handles {source} (model_type {hf_config.get('model_type')!r}, "
            f"architectures {hf_config.get('architectures')}). Types with Hugging Face support: {choices}"
        )
    name = models.name_of(entry)
    if not issubclass(entry.config_cls, HfConvertible):
        raise CheckpointError(f"model type {name!r} ({entry.provider}) cannot be converted from Hugging Face")
    try:
        # a model type's config is an LmConfig; HfConvertible is the mixin that reads Hugging Face configs
        config = cast(LmConfig, entry.config_cls.from_hf_config(hf_config))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    # A clashed name is recorded qualified, so that the config saved with an import or a run
    # selects the same type again.
    return config.model_copy(update={"type": name}) if name != entry.name else config
