"""Fitting a Hugging Face checkpoint's vocabulary to a run's tokenizer (``initialize_from_hf``):
the check that the tokenizer is the checkpoint's, and the resizing of the embeddings and output
head to it (``resize_vocab_to_match_tokenizer``)."""

from __future__ import annotations

import os
from typing import Any

import equinox as eqx
import haliax as hax
import jax
from haliax import Axis
from tokenizers import Tokenizer as RustTokenizer

from levanter_core.errors import ConfigError


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
    resized = hax.tree_util.resize_axis(model, "vocab", Vocab.size, key=key)
    # the modules also record the axis itself (static fields): take them from a model of the new size
    template = eqx.filter_eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(resized))
