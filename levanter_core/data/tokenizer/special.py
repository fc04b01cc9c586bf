"""Special tokens added to a tokenizer through its spec: ``BASE+{JSON}`` names tokenizer
``BASE`` with the special tokens of the JSON object added (as ``transformers``'
``add_special_tokens`` adds them), so that every reader of a run's tokenizer gets the same
tokens."""

from __future__ import annotations

import json

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from levanter_core.data.tokenizer.base import EOS_TEXT, SPECIAL_TOKEN_ROLES, ByteTokenizer, HfTokenizer, Tokenizer
from levanter_core.data.tokenizer.files import _token_text
from levanter_core.errors import DataError

LEVANTER_SFT_DEFAULTS = {"pad_token": "[PAD]", "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}
"""What Levanter's ``sft`` and ``sft_mixture`` give a tokenizer that lacks a role."""

_ADDED = "+{"


def split_tokenizer_spec(spec: str) -> tuple[str, dict]:
    """The tokenizer a spec names and the special tokens added to it: ``BASE+{JSON}`` (as
    :func:`tokenizer_spec_with` writes it) gives ``BASE`` and the JSON object; any other spec,
    itself and {}."""
    at = spec.find(_ADDED)
    if at < 0 or not spec.endswith("}"):
        return spec, {}
    try:
        recipe = json.loads(spec[at + 1 :])
    except json.JSONDecodeError as e:
        raise DataError(
            f"data.tokenizer {spec!r}: the added special tokens after '+' are not a JSON object ({e})"
        ) from None
    problem = _recipe_problem(recipe)
    if problem:
        raise DataError(f"data.tokenizer {spec!r}: {problem}")
    return spec[:at], recipe


def tokenizer_spec_with(spec: str, recipe: dict) -> str:
    """The spec of tokenizer ``spec`` with the special tokens of ``recipe`` added: role names
    (``pad_token``...) -> token text, ``additional_special_tokens`` -> texts, and
    ``add_missing_defaults`` (Levanter's sft: :data:`LEVANTER_SFT_DEFAULTS` for the roles the
    tokenizer lacks). Written into ``data.tokenizer`` so that every reader of the run's tokenizer
    (the cache workers, exports, sampling from a checkpoint) gets the same tokens, and the cache is
    keyed by them. Additions already in ``spec`` are kept; a role given two texts is an error."""
    base, merged = split_tokenizer_spec(spec)
    merged = dict(merged)
    for key, value in recipe.items():
        if not value:
            continue
        if key == "additional_special_tokens":
            merged[key] = list(dict.fromkeys([*merged.get(key, []), *value]))
        elif key in merged and merged[key] != value:
            raise DataError(f"data.tokenizer {spec!r} already sets {key} to {merged[key]!r}, not {value!r}")
        else:
            merged[key] = value
    problem = _recipe_problem(merged)
    if problem:
        raise DataError(problem)
    return f"{base}+{json.dumps(merged, sort_keys=True, ensure_ascii=False)}" if merged else base


def _recipe_problem(recipe) -> str | None:
    if not isinstance(recipe, dict):
        return "the added special tokens must be a JSON object"
    for key, value in recipe.items():
        if key in SPECIAL_TOKEN_ROLES:
            ok = isinstance(value, str) and bool(value)
        elif key == "additional_special_tokens":
            ok = isinstance(value, list) and all(isinstance(t, str) and t for t in value)
        elif key == "add_missing_defaults":
            ok = isinstance(value, bool)
        else:
            return f"unknown key {key!r} among the added special tokens"
        if not ok:
            return f"{key} of the added special tokens has the wrong type: {value!r}"
    return None


def add_special_tokens(base: Tokenizer, recipe: dict, name: str) -> HfTokenizer:
    """``base`` with the special tokens of ``recipe`` (see :func:`tokenizer_spec_with`), as
    ``transformers``' ``add_special_tokens`` adds them: each text missing from the vocabulary gets
    the next id (roles in the order of :data:`SPECIAL_TOKEN_ROLES`, then the additional tokens),
    matched whole in text and never split; one already there is only marked special. A role given
    a token becomes that token (``eos_token`` is then the end of text)."""
    if isinstance(base, ByteTokenizer):
        base = HfTokenizer(base.name, base.to_tokenizer_json(), EOS_TEXT)
    assert isinstance(base, HfTokenizer)
    named = base.named_special_tokens()
    roles = {role: recipe[role] for role in SPECIAL_TOKEN_ROLES if recipe.get(role)}
    if recipe.get("add_missing_defaults"):
        for role, default in LEVANTER_SFT_DEFAULTS.items():
            if role not in named and role not in roles:
                roles[role] = default
    wanted = list(
        dict.fromkeys(
            [*(roles[r] for r in SPECIAL_TOKEN_ROLES if r in roles), *recipe.get("additional_special_tokens", [])]
        )
    )
    tok = RustTokenizer.from_str(base.to_tokenizer_json())
    new = [t for t in wanted if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in wanted])
    config = {**base.config, **roles}
    if recipe.get("additional_special_tokens"):
        known = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        config["additional_special_tokens"] = list(dict.fromkeys([*known, *recipe["additional_special_tokens"]]))
    return HfTokenizer(
        name,
        tok.to_str(),
        roles.get("eos_token") or base.eos_token,
        bos_token=roles.get("bos_token") or base.bos_token,
        chat_template=base.chat_template,
        config=config,
        added_tokens=(*base.added_tokens, *new),
    )
