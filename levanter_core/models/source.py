"""Loading a model to use it (``levanter sample``, ``serve``, ``eval``) from a SOURCE: one of our
checkpoints (a ``step-N`` directory, a run's checkpoint directory, an import), or a Hugging
Face model directory or hub name, with the tokenizer that belongs to it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from haliax import Axis

from levanter_core import lora
from levanter_core.checkpoint import discover_latest
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import HF_TOKENIZER_DIR, load_checkpoint_model, load_hf_model, resolve_source

if TYPE_CHECKING:
    from levanter_core.data.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready to run, and what a user of it needs to know."""

    model: Any
    config: Any
    """Our model config."""
    Vocab: Axis
    tokenizer: Tokenizer | None
    """A :class:`~levanter_core.data.tokenizer.Tokenizer`, or None when the source has none."""
    eos_ids: tuple[int, ...]
    """The tokens that end a generation: the tokenizer's end-of-text token and the model's
    ``eos_token_id`` (of ``config.json`` and ``generation_config.json``)."""
    source: str
    name: str
    """A short name for the model (``/v1/models``): the source's last path component."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The Hugging Face ``config.json`` the model came from (a Hugging Face source's, or the one an
    import recorded); empty for a model we trained from scratch."""
    generation_config: dict[str, Any] = field(default_factory=dict)
    """A Hugging Face source's ``generation_config.json`` (empty when it has none, and for our
    checkpoints)."""
    run_config: dict[str, Any] = field(default_factory=dict)
    """The resolved config of the run that wrote one of our checkpoints (empty for a Hugging Face
    source)."""


def load_model_source(source: str, *, tokenizer: str | None = None) -> LoadedModel:
    """The model of ``source`` (see the module docstring). ``tokenizer`` (a tokenizer spec, as
    ``data.tokenizer``) replaces the source's own."""
    name = os.path.basename(os.path.normpath(source)) or source
    hf_config: dict[str, Any] = {}
    generation_config: dict[str, Any] = {}
    run_config: dict[str, Any] = {}
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json")):
        directory = source
    elif os.path.exists(source):
        if discover_latest(source) is None:
            raise CheckpointError(
                f"{source} is neither one of our checkpoints (no complete step-N checkpoint in it) nor a "
                "Hugging Face model directory (no config.json)"
            )
        directory = None
    else:  # a hub name: the Hugging Face cache, or the hub when it is reachable
        directory = resolve_source(source)

    if directory is not None:
        loaded = load_hf_model(directory)
        model, config, Vocab, hf_config = loaded.model, loaded.config, loaded.Vocab, loaded.hf_config
        tokenizer_dir = directory
        generation = os.path.join(directory, "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                generation_config = json.load(f)
    else:
        found = load_checkpoint_model(source)
        model, config, Vocab = found.model, found.config, found.Vocab
        if lora.has_adapters(model):  # a LoRA run's: generate with the adapters merged (one matmul a layer)
            model = lora.merge(model)
        hf_config = found.stored.get("hf_config") or {}
        run_config = found.run_config or {}
        tokenizer_dir = os.path.join(found.path, HF_TOKENIZER_DIR)
        if tokenizer is None and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
            tokenizer = (run_config.get("data") or {}).get("tokenizer")

    loaded_tokenizer = _tokenizer(tokenizer, tokenizer_dir)
    eos: set[int] = set()
    for value in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id")):
        eos.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    if loaded_tokenizer is not None and loaded_tokenizer.eos_id is not None:
        eos.add(loaded_tokenizer.eos_id)
    return LoadedModel(
        model,
        config,
        Vocab,
        loaded_tokenizer,
        tuple(sorted(eos)),
        source,
        name,
        hf_config,
        generation_config,
        run_config,
    )


def _tokenizer(spec: str | None, directory: str) -> Tokenizer | None:
    if spec is not None:
        return load_tokenizer(spec)
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return load_tokenizer(directory)
    return None
