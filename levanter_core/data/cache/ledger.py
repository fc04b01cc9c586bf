"""The ledger (``ledger.json``): what a cache was built from and what of it is finished. A new
cache's ledger, the check that a stored one was built from the same settings and inputs (and
what to continue from), and the *ready prefix* it describes. Only the coordinator
(:mod:`~levanter_core.data.cache.build`) writes it."""

from __future__ import annotations

import collections
import copy
import logging

from levanter_core.data.source import DataSourceConfig
from levanter_core.data.tokenizer import Tokenizer
from levanter_core.errors import DataError

# The package's logger, as before the split: log lines still name levanter_core.data.cache.
logger = logging.getLogger(__package__)

CACHE_FORMAT = 2
MAX_PROBLEMS = 10
"""Messages of skipped records kept in the ledger (all are counted)."""


def _identity(tokenizer: Tokenizer, source: DataSourceConfig, enforce_eos: bool) -> dict:
    return {
        "tokenizer": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "format": source.format.fingerprint(),
        "enforce_eos": enforce_eos,
    }


def _new_ledger(split: str, identity: dict, tokenizer: Tokenizer, source: DataSourceConfig, fingerprint: dict) -> dict:
    return {
        "format": CACHE_FORMAT,
        "split": split,
        "identity": identity,
        "tokenizer_name": tokenizer.name,
        "source": {k: v for k, v in fingerprint.items() if k != "shards"},
        "shards": [_new_shard(name, fp) for name, fp in fingerprint["shards"].items()],
        "complete": False,
        "num_documents": 0,
        "num_tokens": 0,
        "token_dtype": "uint16" if tokenizer.vocab_size <= 1 << 16 else "int32",
        "target_mask": source.format.packed,
        "fields": source.format.document_fields(),
        "problems": [],
        "updated": None,
    }


def _new_shard(name: str, fingerprint) -> dict:
    return {
        "name": name,
        "fingerprint": fingerprint,
        "records": 0,
        "documents": 0,
        "tokens": 0,
        "finished": False,
        "skipped": {},
    }


def _reconcile(path: str, old: dict, new: dict) -> dict:
    """The ledger to continue from: ``old`` (what is stored) checked against ``new`` (what the
    configuration asks for). Raises :class:`DataError` saying what differs if the stored data
    cannot be reused; a changed unfinished shard simply starts again."""
    remedy = f"remove {path} to build it again, or choose another data.cache_dir"
    if old.get("format") != CACHE_FORMAT:
        raise DataError(f"{path}: cache format {old.get('format')!r}, this version reads {CACHE_FORMAT}; {remedy}")
    differences = [
        f"{key} (cached: {old['identity'].get(key)!r}, now: {value!r})"
        for key, value in new["identity"].items()
        if old["identity"].get(key) != value
    ]
    if old["source"] != new["source"]:
        differences.append(f"source (cached: {old['source']!r}, now: {new['source']!r})")
    old_names, new_names = [s["name"] for s in old["shards"]], [s["name"] for s in new["shards"]]
    if old_names != new_names:
        added = [n for n in new_names if n not in old_names]
        removed = [n for n in old_names if n not in new_names]
        differences.append(
            f"inputs (added: {added or 'none'}, removed: {removed or 'none'}{'' if added or removed else ', reordered'})"
        )
    else:
        for stored, wanted in zip(old["shards"], new["shards"]):
            if stored["finished"] and stored["fingerprint"] != wanted["fingerprint"]:
                differences.append(
                    f"input {wanted['name']} changed after it was cached (cached: {stored['fingerprint']!r}, now: {wanted['fingerprint']!r})"
                )
    if differences:
        tokenizer_note = (
            f" (tokenizer {old.get('tokenizer_name')!r})" if any(d.startswith("tokenizer") for d in differences) else ""
        )
        raise DataError(
            f"{path}: this cache was built from other settings{tokenizer_note}: {'; '.join(differences)}; {remedy}"
        )
    ledger = copy.deepcopy(old)
    for i, (stored, wanted) in enumerate(zip(old["shards"], new["shards"])):
        if stored["fingerprint"] != wanted["fingerprint"]:
            logger.warning("%s: input %s changed before it was finished; tokenizing it again", path, wanted["name"])
            ledger["shards"][i] = wanted
    return ledger


def _ready(ledger: dict) -> tuple[list[dict], int, int]:
    """The shards of the ready prefix (finished ones and the committed part of the first
    unfinished one), with its document and token counts."""
    ready = []
    for shard in ledger["shards"]:
        ready.append(shard)
        if not shard["finished"]:
            break
    return ready, sum(s["documents"] for s in ready), sum(s["tokens"] for s in ready)


def _no_documents(path: str, split: str, ledger: dict) -> DataError:
    names = [s["name"] for s in ledger["shards"]]
    listing = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    skipped: collections.Counter[str] = collections.Counter()
    for shard in ledger["shards"]:
        skipped.update(shard["skipped"])
    note = f" ({sum(skipped.values())} records skipped: {dict(skipped)})" if skipped else ""
    return DataError(
        f"the {split} split has no documents{note}: its inputs {listing} hold no usable records (cache {path})"
    )
