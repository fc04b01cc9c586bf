"""Moving models between Hugging Face checkpoints and ours: ``levanter import-hf``,
``levanter export-hf`` and the ``initialize_from_hf`` training option.

Which of our model types reads a Hugging Face ``config.json`` is decided by the
``model_type_for_hf_config`` hook (two plugins that claim it for different types are a clash:
see :meth:`levanter_core.plugins.PluginManager.model_type_for_hf_config`); the per-model
translation is the plugin's :class:`~levanter_core.hf.convert.HfConvertible` config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from haliax import Axis

from levanter_core import lora
from levanter_core.errors import CheckpointError, ConfigError, PluginError
from levanter_core.fileio import is_local, join, list_names, normalize, read_bytes, write_bytes, write_text_atomically
from levanter_core.hf.checkpoint import HfCheckpoint, upload_hf_directory, write_hf_checkpoint
from levanter_core.hf.convert import HfConvertible, load_hf_weights, to_hf_state_dict
from levanter_core.plugins import get_manager, registry

logger = logging.getLogger(__name__)

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


@dataclass
class HfModel:
    """A model loaded from a Hugging Face checkpoint."""

    model: Any
    config: Any
    """Our model config (an :class:`HfConvertible` LmConfig)."""
    Vocab: Axis
    directory: str
    hf_config: dict


def resolve_source(source: str) -> str:
    """A local directory holding ``source``: ``source`` itself, or a download of the hub
    repository of that name (needs ``huggingface_hub`` and network access)."""
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise CheckpointError(f"{source} is a file; expected a Hugging Face model directory (with config.json)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{source!r} is not a local directory, and huggingface_hub is not installed to fetch it from the hub"
        ) from None
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
        from huggingface_hub import hf_hub_download

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
        config = entry.config_cls.from_hf_config(hf_config)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    # A clashed name is recorded qualified, so that the config saved with an import or a run
    # selects the same type again.
    return config.model_copy(update={"type": name}) if name != entry.name else config


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


def check_tokenizer_fits(directory: str, vocab_size: int, tokenizer, *, source: str) -> None:
    """Raise :class:`ConfigError` unless ``tokenizer`` (the run's ``data.tokenizer``) fits the
    Hugging Face checkpoint in ``directory`` (``source``: what ``initialize_from_hf`` names),
    whose embeddings have ``vocab_size`` rows: it may not have more tokens than that, and where
    the checkpoint ships a ``tokenizer.json``, each id both know must be the same token in both
    (a checkpoint's vocabulary padded past its tokenizer's end, or tokens added after it, fit)."""
    remedy = (
        f"Use the checkpoint's own tokenizer (data.tokenizer: {source}), or set "
        f"resize_vocab_to_match_tokenizer: true to resize its embeddings and output head to "
        f"the tokenizer's {tokenizer.vocab_size} tokens."
    )
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"initialize_from_hf: data.tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens, but the "
            f"checkpoint {source} has embeddings for {vocab_size} (vocab_size in its config.json): ids from "
            f"{vocab_size} on would have none. {remedy}"
        )
    shipped = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(shipped):
        return
    from tokenizers import Tokenizer as RustTokenizer

    theirs = _tokens_by_id(RustTokenizer.from_file(shipped))
    ours = _tokens_by_id(RustTokenizer.from_str(tokenizer.to_tokenizer_json()))
    differing = [i for i in sorted(theirs.keys() & ours.keys()) if theirs[i] != ours[i]]
    if differing:
        i = differing[0]
        raise ConfigError(
            f"initialize_from_hf: data.tokenizer ({tokenizer.name}, {tokenizer.vocab_size} tokens) is not the "
            f"tokenizer of the checkpoint {source} ({len(theirs)} tokens, vocab_size {vocab_size}): "
            f"{len(differing)} ids mean other tokens, e.g. id {i} is {ours[i]!r} here and {theirs[i]!r} there, "
            f"so the embeddings would be read as the wrong tokens. {remedy}"
        )


def _tokens_by_id(tokenizer) -> dict[int, str]:
    return {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}


def resize_vocab(model: Any, config: Any, Vocab: Axis, *, key) -> Any:
    """``model`` (built from ``config``) with every array along its ``vocab`` axis (the token
    embeddings, an untied output head) cut or grown to ``Vocab``: as Levanter's
    ``resize_vocab_to_match_tokenizer``, new rows are drawn from a truncated normal
    distribution with the mean and standard deviation of the existing ones."""
    import equinox as eqx
    import haliax as hax

    resized = hax.tree_util.resize_axis(model, "vocab", Vocab.size, key=key)
    # the modules also record the axis itself (static fields): take them from a model of the new size
    template = eqx.filter_eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(resized))


# -- import ----------------------------------------------------------------------------------


def import_hf(source: str, output: str, *, seq_len: int | None = None) -> str:
    """Write the Hugging Face model ``source`` as our checkpoint at ``output`` (a model-only
    checkpoint at step 0, with its config, the original ``config.json`` and the tokenizer
    files). Returns ``output``."""
    from levanter_core.checkpoint import COMMIT_MARKER, write_checkpoint

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


def _copy_tokenizer_files(source: str, target: str) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``source`` has into ``target`` (each a local
    directory or a URL: an import in a bucket keeps them in its ``hf_tokenizer``); returns
    their names."""
    present = [f for f in TOKENIZER_FILES if f in set(list_names(source))]
    for f in present:
        write_bytes(join(target, f), read_bytes(join(source, f)))
    return present


# -- export ----------------------------------------------------------------------------------


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

    ``output`` must not exist or be empty, as for :func:`import_hf`, unless ``overwrite``: then
    an earlier export there is replaced (its weights removed first, so that no shard of it
    is left beside the new ones).

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
    from levanter_core.hf.peft import task_type_of, write_peft_adapter

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


def read_metadata_of(checkpoint: str) -> dict:
    """The run metadata stored with the newest complete checkpoint at ``checkpoint`` ({} if none)."""
    from levanter_core.checkpoint import discover_latest, read_metadata

    found = discover_latest(checkpoint)
    return read_metadata(found).get("metadata", {}) if found else {}


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
    from levanter_core.checkpoint import discover_latest, load_checkpoint, read_metadata
    from levanter_core.config.base import validate_section

    found = discover_latest(checkpoint)
    if found is None:
        raise CheckpointError(f"no complete checkpoint at {checkpoint}")
    described = read_metadata(found)
    stored = described.get("metadata", {})
    run_config = stored.get("config") or {}
    if "model" not in run_config:
        raise CheckpointError(f"{found} does not record its model config, so its model cannot be built")
    config = validate_section("model", run_config["model"])
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
    from levanter_core.checkpoint import discover_latest, load_checkpoint

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


AVERAGED_MODEL = "model_averaging/model"
"""Where a training checkpoint keeps the model that ``trainer.model_averaging`` averages."""

SPECIAL_TOKENS = {"pad_token_id": "pad_token", "bos_token_id": "bos_token", "eos_token_id": "eos_token"}
"""The ``config.json`` keys of the special token ids, and the ``tokenizer_config.json`` keys
that name those tokens."""


def _special_token_ids(directory: str, hf_config: dict, vocab_size: int) -> dict[str, int | list[int] | None]:
    """The special token ids for the ``config.json`` of an export in ``directory``: those of
    the tokenizer written there, else those of ``hf_config`` (an imported model's), else None,
    written explicitly so that ``transformers`` does not fall back to its family's defaults
    (GPT-2's 50256, say), which need not exist in this vocabulary. An id outside
    ``0 .. vocab_size - 1`` is never written."""
    from_tokenizer = _tokenizer_special_ids(directory)
    ids = {}
    for key in SPECIAL_TOKENS:
        ours, theirs = from_tokenizer.get(key), hf_config.get(key)
        # keep an imported list of end ids (chat models stop on several) when it has ours
        value = theirs if ours is None or (isinstance(theirs, list) and ours in theirs) else ours
        if value is not None and not in_vocabulary(value, vocab_size):
            logger.warning("not writing %s %s: the vocabulary has %d tokens", key, value, vocab_size)
            value = None
        ids[key] = value
    return ids


def in_vocabulary(value, vocab_size: int) -> bool:
    """Whether ``value`` (a token id, or a list of them) names tokens of a ``vocab_size``-token vocabulary."""
    values = value if isinstance(value, list) else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values)


def _tokenizer_special_ids(directory: str) -> dict[str, int]:
    """The ids of the special tokens that the tokenizer files in ``directory`` define (its
    ``tokenizer_config.json`` or ``special_tokens_map.json`` names them; the end-of-text token
    is found as training found it, see :func:`levanter_core.data.tokenizer.load_tokenizer`)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return {}
    from tokenizers import Tokenizer as RustTokenizer

    from levanter_core.data.tokenizer import load_tokenizer

    vocabulary = RustTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    named = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(directory, file)
        if os.path.isfile(path):
            with open(path) as f:
                contents = json.load(f)
            if isinstance(contents, dict):
                named.update({k: contents[k] for k in SPECIAL_TOKENS.values() if contents.get(k) is not None})
    ids = {}
    for key, name in SPECIAL_TOKENS.items():
        token = named.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and vocabulary.token_to_id(token) is not None:
            ids[key] = vocabulary.token_to_id(token)
    eos = load_tokenizer(directory).eos_id
    if eos is not None:
        ids["eos_token_id"] = eos
    return ids


def _run_tokenizer(run_config: dict):
    from levanter_core.data.tokenizer import load_tokenizer

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
    from levanter_core.data.tokenizer import find_tokenizer_json
    from levanter_core.errors import DataError

    try:
        fs, path = find_tokenizer_json(spec)
    except DataError:
        return None
    if os.path.isfile(spec) or "file" not in fs.protocol:  # a lone tokenizer.json, or a remote one
        return None
    return os.path.dirname(path)


def _trained_chat_template(run_config: dict, tokenizer) -> str | None:
    """The chat template a run's chat data was rendered with when it is not the tokenizer's
    own (the format's ``chat_template``, or the built-in template for a tokenizer without one):
    written with the export, so that ``transformers`` and ``levanter sample --chat`` prompt the
    model as it was trained. None for a run without chat data, or one the tokenizer's own
    template rendered. Chat data is a source whose format renders conversations: ``chat``,
    or any format with a ``chat_template`` setting (preference pairs)."""
    from levanter_core.data.formats import BUILTIN_CHAT_TEMPLATE

    fmt = _chat_format(run_config)
    if fmt is None:
        return None
    return fmt.get("chat_template") or (None if tokenizer.chat_template else BUILTIN_CHAT_TEMPLATE)


def _chat_format(run_config: dict) -> dict | None:
    """The ``format`` section of the first of a run's sources whose format renders
    conversations with a chat template, or None."""
    data = run_config.get("data") or {}
    sources = list((data.get("configs") or {}).values()) or [data]
    for source in sources:
        fmt = source.get("format") if isinstance(source, dict) else None
        if not isinstance(fmt, dict):
            continue
        if fmt.get("type") == "chat" or "chat_template" in fmt:
            return fmt
        try:
            if "chat_template" in registry("data_format").get(str(fmt.get("type"))).config_cls.model_fields:
                return fmt
        except (KeyError, PluginError):  # a format no longer installed: it cannot say
            continue
    return None


def _write_trained_chat_template(run_config: dict, output: str) -> None:
    """Give the tokenizer files written to ``output`` the chat template the run trained with,
    when it is not theirs already (see :func:`_trained_chat_template`): in
    ``chat_template.jinja`` if they have one (``transformers`` prefers it), else as
    ``chat_template`` in ``tokenizer_config.json``."""
    from levanter_core.data.tokenizer import load_tokenizer

    if _chat_format(run_config) is None or not os.path.isfile(os.path.join(output, "tokenizer.json")):
        return
    template = _trained_chat_template(run_config, load_tokenizer(output))
    if template is None:
        return
    jinja = os.path.join(output, "chat_template.jinja")
    if os.path.isfile(jinja):
        write_text_atomically(jinja, template)
        return
    path = os.path.join(output, "tokenizer_config.json")
    tokenizer_config = {}
    if os.path.isfile(path):
        with open(path) as f:
            tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = template
    write_text_atomically(path, json.dumps(tokenizer_config, indent=2) + "\n")


def _write_tokenizer(tokenizer_dirs: tuple[str, ...], run_config: dict, output: str, tokenizer=None) -> None:
    """Tokenizer files for the export: the run's tokenizer grown by ``special_tokens`` (its
    ``tokenizer.json``, and a ``tokenizer_config.json`` naming the added tokens); else those an
    import brought along (``tokenizer_dirs``, local or in a bucket), else the run's tokenizer (its
    directory's files, or its hub snapshot's, or its ``tokenizer.json`` rebuilt)."""
    spec = (run_config.get("data") or {}).get("tokenizer")
    from levanter_core.data.tokenizer import split_tokenizer_spec

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


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"1024"`` -> bytes (``--max-shard-size``)."""
    from levanter_core.config.types import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
