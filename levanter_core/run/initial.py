"""The model a run trains and the state it starts from: the model config and vocabulary
(from the config, or a Hugging Face checkpoint's ``config.json``), the objective, LoRA
adapters, and the first state: this run's newest checkpoint, ``trainer.initialize_from``,
``initialize_from_checkpoint_path``, ``initialize_from_hf``, or fresh."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import equinox as eqx
import jax
from haliax import Axis

from levanter_core import lora
from levanter_core.checkpoint import discover_latest, load_checkpoint, read_metadata
from levanter_core.config.train import TrainConfig, objective_class
from levanter_core.errors import CheckpointError, ConfigError
from levanter_core.hf import load_hf_weights
from levanter_core.hf.bridge import check_tokenizer_fits, config_from_hf, read_hf_config, resize_vocab, resolve_source
from levanter_core.hf.checkpoint import HfCheckpoint
from levanter_core.models.token_rows import reinitialize_rows, token_ids


def row_lengths(model_config, config: TrainConfig | None = None) -> dict[str, int]:
    """What one batch row holds of a format's own arrays for this model (the objective's), at
    the run's training length (``train_seq_len``, when it is shorter than the model's context)."""
    if config is not None and config.train_seq_len is not None:
        model_config = model_config.model_copy(update={"seq_len": config.train_seq_len})
    return objective_class(model_config, config).row_lengths(model_config)


def build_objective(config: TrainConfig, model_config):
    """The training objective the model type names, built for this run."""
    wanted, planned = row_lengths(model_config, config), row_lengths(config.model, config)
    if wanted != planned:
        raise ConfigError(
            f"the model built ({model_config.type}) needs batch rows of {wanted}, but the data was set up for "
            f"{planned} from the model section; make the model section describe the model trained "
            "(use_hf_model_config changes it)"
        )
    return objective_class(model_config, config).from_config(config)


def initial_state(trainer, cfg, checkpointer, model_init, key, *, load_hf=None, trunk: str | None = None, adapt=None):
    """Loaded from this run's newest checkpoint that loads, else from ``initialize_from``,
    else from the whole state of ``trunk`` (``initialize_from_checkpoint_path``), else around the
    weights ``load_hf()`` returns (``initialize_from_hf``), else fresh. ``adapt`` puts a LoRA
    run's adapters onto weights loaded without them. Without a ``checkpointer``: the state a
    run without checkpoints of its own would start from (a LoRA run's base)."""
    partial = cfg.allow_partial_checkpoint
    lora_run = adapt is not None
    adapt = adapt or (lambda model: model)

    def template():
        # a partial load keeps the fresh values of what the checkpoint lacks, so it needs them
        return trainer.init_state(model_init, key) if partial else trainer.state_template(model_init, key)

    if checkpointer is not None and cfg.load_checkpoint is not False:
        where = cfg.load_checkpoint_path or checkpointer.path
        resumed = (
            checkpointer.resume(template(), where, allow_partial=True)
            if partial
            else checkpointer.resume(template(), where)
        )
        if resumed is not None:
            return resumed
        if cfg.load_checkpoint:
            raise CheckpointError(f"trainer.load_checkpoint is true but there is no complete checkpoint under {where}")
    if cfg.initialize_from:
        found = discover_latest(cfg.initialize_from)
        if found is None:
            raise CheckpointError(f"trainer.initialize_from: no complete checkpoint under {cfg.initialize_from}")
        stored = read_metadata(found)
        if "lora_base" in stored.get("metadata", {}):
            raise CheckpointError(
                f"trainer.initialize_from: {found} holds a LoRA run's adapters, not a model's weights; start "
                "from the base model it names (its config's initialize_from_hf or trainer.initialize_from), or "
                "export it merged first (levanter export-hf)"
            )
        weights_only = not any(leaf["name"].startswith("opt_state/") for leaf in stored["leaves"])
        if weights_only or lora_run:
            # weights alone (e.g. from `levanter import-hf`), or the base of a LoRA run: fresh
            # optimizer, step 0
            base = eqx.filter_eval_shape(lambda k: lora.base_model(model_init(k)), key)
            model = adapt(load_checkpoint(base, found, subtree="model"))
            return trainer.state_from_model(model, key), None
        return checkpointer.load_state(template(), found, allow_partial=partial), found
    if trunk and checkpointer is not None:
        found = discover_latest(trunk) or trunk
        state = checkpointer.load_state(template(), found, allow_partial=partial)
        print(f"initialized from the training state of {found} (step {int(state.step)})", flush=True)
        return state, None
    if load_hf is not None:
        return trainer.state_from_model(load_hf(), key), None
    return trainer.init_state(model_init, key), None


_LORA_STREAM = 0x10A0
"""Folded into the run's key (``trainer.seed``) for the LoRA adapters' initial values."""


def adapter_surgery(config: TrainConfig, key):
    """The function that puts the run's LoRA adapters onto a model (``lora``), None without."""
    if config.lora is None:
        return None
    adapter_key = jax.random.fold_in(key, _LORA_STREAM)
    return lambda model: lora.loraize(model, config.lora, key=adapter_key)


def lora_base(config: TrainConfig, hf_directory: str | None, Vocab) -> dict | None:
    """What a LoRA run's checkpoints point to for the base weights (stored in their metadata
    as ``lora_base``): the Hugging Face model of ``initialize_from_hf`` or the checkpoint of
    ``trainer.initialize_from``. None (the checkpoints then hold the whole model) without LoRA,
    or when the base cannot be read back from a source: a model initialized at random, or an
    imported one whose vocabulary the run resized."""
    if config.lora is None:
        return None
    if hf_directory is not None:
        if read_hf_config(hf_directory).get("vocab_size") != Vocab.size:
            return None
        return {"initialize_from_hf": config.hf_source}
    if config.trainer.initialize_from:
        found = discover_latest(config.trainer.initialize_from)
        return {"initialize_from": found} if found else None
    return None


def say_adapters(model, base: dict | None) -> None:
    total, trained = lora.count_parameters(model), lora.count_parameters(lora.adapter_params(model))
    where = "point to the base weights" if base else "hold the whole model (its base has no source to point to)"
    print(
        f"LoRA: training {trained:,} adapter parameters of {total:,} ({trained / total:.2%}); checkpoints {where}",
        flush=True,
    )


class FrozenAside:
    """The checkpointer of a run whose objective keeps a frozen model of its own (a distillation
    teacher, :meth:`~levanter_core.objective.Objective.frozen_model`): it saves the state without
    that model, which every start loads again from the objective's options. What it loads lacks it
    too (the trainer's templates do), and the run puts it back (``Trainer.with_frozen``).
    Everything else is the checkpointer's own."""

    def __init__(self, checkpointer: Any):
        self._inner = checkpointer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def on_step(self, state: Any, step: int, *, force: bool = False) -> bool:
        return self._inner.on_step(dataclasses.replace(state, reference=None), step, force=force)


def with_run_settings(hf_model, model):
    """``hf_model`` (the architecture read from ``config.json``) with ``model``'s run settings."""
    given = model.model_fields_set | {"seq_len"}
    settings = [name for name in type(model).run_settings if name in given and name in type(hf_model).model_fields]
    update = {name: getattr(model, name) for name in settings}
    return hf_model.model_copy(update=update)


def resolve_model(config: TrainConfig, tokenizer):
    """The model config to build, its vocabulary axis, and the Hugging Face directory to
    initialize from (None without ``initialize_from_hf``). The vocabulary is the
    tokenizer's, or that of the weights the run starts from, which may be larger.

    A tokenizer that does not fit the Hugging Face checkpoint stops the run here, before
    anything is built, unless ``resize_vocab_to_match_tokenizer`` asks for the checkpoint's
    vocabulary to be resized to the tokenizer's. A tokenizer grown by ``special_tokens`` (whose
    other ids must match the checkpoint's) makes the vocabulary the tokenizer's size."""
    model_config, vocab_size, directory, origin = config.model, tokenizer.vocab_size, None, None
    if config.initialize_from_hf:
        source = config.hf_source
        assert source is not None  # initialize_from_hf is set
        directory = resolve_source(source)
        hf_config = read_hf_config(directory)
        if config.use_hf_model_config:
            model_config = with_run_settings(config_from_hf(hf_config), config.model)
        vocab_size, origin = hf_config.get("vocab_size"), "initialize_from_hf"
        if not isinstance(vocab_size, int):
            raise CheckpointError(f"initialize_from_hf: {directory}/config.json has no integer vocab_size")
        if config.special_tokens.reinit_tokens:  # refused here, before anything is built
            token_ids(tokenizer, config.special_tokens.tokens_to_reinit(), field="special_tokens.reinit_tokens")
        if config.resize_vocab_to_match_tokenizer:
            return model_config, Axis("vocab", tokenizer.vocab_size), directory
        if getattr(tokenizer, "added_tokens", ()):
            # special_tokens added some: the model takes the tokenizer's size, as in Levanter's sft
            # (rows past the checkpoint's end are added, padding rows past the tokenizer's end dropped)
            check_tokenizer_fits(directory, max(vocab_size, tokenizer.vocab_size), tokenizer, source=source)
            return model_config, Axis("vocab", tokenizer.vocab_size), directory
        check_tokenizer_fits(directory, vocab_size, tokenizer, source=source)
    elif config.trainer.initialize_from and (found := discover_latest(config.trainer.initialize_from)):
        # the vocabulary of the weights we start from (an import keeps its model's padded size)
        vocab_size = read_metadata(found).get("metadata", {}).get("vocab_size", vocab_size)
        origin = "trainer.initialize_from"
    if not isinstance(vocab_size, int) or vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"{origin}: the model's vocabulary ({vocab_size}) is smaller than the tokenizer's "
            f"({tokenizer.vocab_size}, data.tokenizer: {tokenizer.name}); use the model's own tokenizer"
        )
    return model_config, Axis("vocab", vocab_size), directory


def check_model_takes_packed_data(model, config: TrainConfig) -> None:
    """Packed data (chat, supervised) needs a model whose ``activations`` accept an
    ``attn_mask``, or examples would attend to each other: say so before compiling."""
    packed = [name for name, source in config.data.configs.items() if source.format.packed]
    if packed and "attn_mask" not in inspect.signature(model.activations).parameters:
        raise ConfigError(
            f"model.type {config.model.type!r} cannot train on packed data ({config.data.field_of(packed[0])}.format "
            f"is {config.data.configs[packed[0]].format.type!r}): its activations() takes no attn_mask, so the "
            "examples packed into a sequence would attend to each other"
        )


def hf_loader(config: TrainConfig, model_config, Vocab: Axis, hf_directory: str, tokenizer, key, adapt=None):
    """The function that builds the run's first model from the Hugging Face checkpoint in
    ``hf_directory`` (``initialize_from_hf``): its weights, the vocabulary resized to the
    tokenizer's where the run asks for it (or special tokens were added), the rows of
    ``special_tokens.reinit_tokens`` drawn again, and the run's LoRA adapters put on."""

    def load_hf():
        hf_Vocab = Axis("vocab", read_hf_config(hf_directory)["vocab_size"])
        model = load_hf_weights(model_config, hf_Vocab, HfCheckpoint(hf_directory))
        print(f"initialized from Hugging Face model {config.hf_source}", flush=True)
        if hf_Vocab != Vocab and config.resize_vocab_to_match_tokenizer:
            model = resize_vocab(model, model_config, Vocab, key=jax.random.fold_in(key, 1))
            print(
                f"resized its vocabulary from {hf_Vocab.size} to the tokenizer's {Vocab.size} "
                "(resize_vocab_to_match_tokenizer)",
                flush=True,
            )
        elif hf_Vocab != Vocab:  # special tokens were added (resolve_model refuses any other misfit)
            # as Levanter's sft: the tokenizer's size, new rows at the mean of the existing ones
            model = resize_vocab(model, model_config, Vocab, key=None)
            added = ", ".join(tokenizer.added_tokens)
            print(
                f"added special tokens {added}: the vocabulary goes from {hf_Vocab.size} to {Vocab.size} "
                "tokens, new embedding and output rows at the mean of the existing rows",
                flush=True,
            )
        reinit = config.special_tokens.tokens_to_reinit()
        if reinit:
            ids = token_ids(tokenizer, reinit, field="special_tokens.reinit_tokens")
            model = reinitialize_rows(
                model, ids, jax.random.fold_in(key, 2),
                embeddings=config.special_tokens.reinit_embeddings, lm_head=config.special_tokens.reinit_lm_head,
            )  # fmt: skip
            print(f"re-drew the embedding and output rows of {', '.join(reinit)} (reinit_tokens)", flush=True)
        return model if adapt is None else adapt(model)

    return load_hf
