"""Loading the model of one of our checkpoints (a training run's, or an import), built from the
config the checkpoint records: the trained or the averaged weights, and a LoRA run's adapters
over their base model.

It loads our checkpoints, not Hugging Face ones, and belongs with them: it is here until the
restructuring of :mod:`levanter_core.checkpoint` settles (then ``checkpoint/model.py``). Not in
:mod:`levanter_core.models`, whose modules are the plugins' strictly typed API; and a LoRA
checkpoint's base may be a Hugging Face model, which it reads through
:mod:`~levanter_core.hf.io.source`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import equinox as eqx
import jax
from haliax import Axis

from levanter_core import lora
from levanter_core.checkpoint import discover_latest, load_checkpoint, read_metadata
from levanter_core.config.base import validate_section
from levanter_core.errors import CheckpointError
from levanter_core.hf.checkpoint import HfCheckpoint
from levanter_core.hf.convert import load_hf_weights
from levanter_core.hf.io.source import read_hf_config, resolve_source
from levanter_core.hf.io.tokenizer_files import _run_tokenizer
from levanter_core.models.lm import LmConfig

# the name its log lines had before the split from levanter_core.hf.bridge (the CLI prints it)
logger = logging.getLogger("levanter_core.hf.bridge")

AVERAGED_MODEL = "model_averaging/model"
"""Where a training checkpoint keeps the model that ``trainer.model_averaging`` averages."""


@dataclass
class CheckpointModel:
    """A model loaded from one of our checkpoints (see :func:`load_checkpoint_model`)."""

    model: Any
    config: Any
    Vocab: Axis
    path: str
    """The complete ``step-N`` checkpoint it came from."""
    run_config: dict
    """The config of the run (or import) that wrote it."""
    stored: dict
    """The run's metadata stored with the checkpoint (``config``, ``vocab_size``, ``hf_config``...)."""
    tokenizer: Any = None
    """The run's tokenizer, when it had to be loaded to learn the vocabulary size."""
    lora: Any = None
    """The run's :class:`~levanter_core.lora.LoraConfig` when ``model`` has LoRA adapters."""


def load_checkpoint_model(checkpoint: str, *, averaged: bool = True) -> CheckpointModel:
    """The model of our checkpoint ``checkpoint`` (a ``step-N`` directory, a run's checkpoint
    directory, whose latest complete checkpoint is taken, or an import), built from the config
    the checkpoint records. A run with ``trainer.model_averaging`` keeps the running average
    beside the trained weights: ``averaged`` loads the average (what evaluation used)."""
    found = discover_latest(checkpoint)
    if found is None:
        raise CheckpointError(f"no complete checkpoint at {checkpoint}")
    described = read_metadata(found)
    stored = described.get("metadata", {})
    run_config = stored.get("config") or {}
    if "model" not in run_config:
        raise CheckpointError(f"{found} does not record its model config, so its model cannot be built")
    config = cast(LmConfig, validate_section("model", run_config["model"]))  # the model section's types are LmConfigs
    tokenizer = None
    vocab_size = stored.get("vocab_size")
    if vocab_size is None:  # checkpoints of training runs before vocab_size was recorded
        tokenizer = _run_tokenizer(run_config)
        vocab_size = tokenizer.vocab_size
    Vocab = Axis("vocab", int(vocab_size))

    key = jax.random.PRNGKey(0)
    adapters = _run_lora(run_config, found)
    base_template = jax.eval_shape(lambda: config.build(Vocab, key=key))
    template = base_template
    if adapters is not None:
        template = jax.eval_shape(lambda: lora.loraize(config.build(Vocab, key=key), adapters, key=key))
    base_pointer = stored.get("lora_base")
    if base_pointer is not None:
        template = lora.adapter_params(template)  # the checkpoint holds the adapters alone
    has_average = any(leaf["name"].startswith(f"{AVERAGED_MODEL}/") for leaf in described.get("leaves", []))
    if averaged and has_average:
        # the average of a TrainerState is saved as `model_averaging/model/...`
        owner, field = AVERAGED_MODEL.split("/")
        model = load_checkpoint({field: template}, found, subtree=owner)[field]
        logger.info("loaded the averaged weights of trainer.model_averaging (evaluation used them)")
    else:
        model = load_checkpoint(template, found, subtree="model")
        if has_average:
            logger.info("loaded the trained weights, not the average trainer.model_averaging kept")
    if base_pointer is not None:
        base = _load_lora_base(base_pointer, config, Vocab, base_template, found)
        model = eqx.combine(model, lora.loraize(base, adapters, key=key))
    return CheckpointModel(model, config, Vocab, found, run_config, stored, tokenizer, adapters)


def _run_lora(run_config: dict, found: str):
    """The ``lora`` section of the run that wrote the checkpoint ``found``, or None."""
    section = run_config.get("lora")
    if section is None:
        return None
    try:
        return lora.LoraConfig.model_validate(section)
    except ValueError as e:
        raise CheckpointError(f"{found}: its run's lora section does not load: {e}") from None


def _load_lora_base(pointer: dict, config: Any, Vocab: Axis, template: Any, found: str) -> Any:
    """The base weights a LoRA checkpoint points to (its metadata's ``lora_base``)."""
    if pointer.get("initialize_from_hf"):
        source = pointer["initialize_from_hf"]
        directory = resolve_source(source)
        hf_vocab = read_hf_config(directory).get("vocab_size")
        if hf_vocab != Vocab.size:
            raise CheckpointError(
                f"{found} holds LoRA adapters for the base model {source}, whose vocabulary is now {hf_vocab} "
                f"rather than {Vocab.size}: it is not the base the adapters were trained on"
            )
        logger.info("loading the base weights of the LoRA adapters from %s", source)
        return load_hf_weights(config, Vocab, HfCheckpoint(directory))
    if pointer.get("initialize_from"):
        base = discover_latest(pointer["initialize_from"])
        if base is None:
            raise CheckpointError(
                f"{found} holds LoRA adapters whose base weights were {pointer['initialize_from']}, "
                "where there is no complete checkpoint now"
            )
        return load_checkpoint(template, base, subtree="model")
    raise CheckpointError(f"{found}: its lora_base metadata names no base ({pointer})")


def read_metadata_of(checkpoint: str) -> dict:
    """The run metadata stored with the newest complete checkpoint at ``checkpoint`` ({} if none)."""
    found = discover_latest(checkpoint)
    return read_metadata(found).get("metadata", {}) if found else {}
