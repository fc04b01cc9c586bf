"""``levanter eval``: the loss and bits per byte of a model on evaluation sets, outside training.

The sets are a training config's validation sets (``--config``, tokenized into that config's
cache as training would) or given files (``--data``, tokenized with the model's tokenizer into a
temporary cache, or ``--cache-dir``). Each set is read as training reads its validation data:
the documents, each followed by the end-of-text token, cut into sequences of the model's
``seq_len``; the metrics are those training logs (:func:`~levanter_core.trainer.evaluators.eval_metrics`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Sequence

import numpy as np

from levanter_core.errors import DataError, UserError


@dataclasses.dataclass
class EvalSet:
    name: str
    dataset: object  # a SequenceDataset
    tags: tuple[str, ...] = ()
    origin: str = ""
    """Where the set comes from, for messages (a file, a config's source)."""


@dataclasses.dataclass
class EvalReport:
    """Each set's ``[nats, tokens, bytes]`` and the metrics made of them."""

    source: str
    totals: dict[str, np.ndarray]
    metrics: dict[str, float]
    tags: dict[str, list[str]]

    def as_json(self) -> dict:
        """``loss``/``bpb`` over everything, their macro averages, then per set and per tag."""

        def pick(prefix: str) -> dict:
            found = {k[len(prefix) + 1 :]: v for k, v in self.metrics.items() if k.startswith(prefix + "/")}
            return {k: v for k, v in found.items() if "/" not in k and k != "micro_loss"}

        sets = {}
        for name, (nats, tokens, nbytes) in self.totals.items():
            sets[name] = {
                "loss": nats / max(tokens, 1.0),
                "bpb": nats / (math.log(2) * nbytes) if nbytes else None,
                "tokens": int(tokens),
                "bytes": int(nbytes),
            }
        return {"source": self.source, **pick("eval"), "eval_sets": sets, "tags": {t: pick(f"eval/{t}") for t in self.tags}}

    def table(self) -> str:
        """The report as a text table: one row per set, then per tag, then all together."""
        rows = [("set", "loss", "bpb", "tokens", "bytes")]
        for name, entry in self.as_json()["eval_sets"].items():
            bpb = "-" if entry["bpb"] is None else f"{entry['bpb']:.4f}"
            rows.append((name, f"{entry['loss']:.4f}", bpb, f"{entry['tokens']:,}", f"{entry['bytes']:,}"))
        for tag, names in self.tags.items():
            entry = self.metrics
            rows.append((f"tag {tag} ({len(names)} sets)", f"{entry[f'eval/{tag}/loss']:.4f}", _fmt(entry.get(f"eval/{tag}/bpb")), "", ""))
        if len(self.totals) > 1:
            tokens = sum(t[1] for t in self.totals.values())
            nbytes = sum(t[2] for t in self.totals.values())
            rows.append(("all (micro)", f"{self.metrics['eval/loss']:.4f}", _fmt(self.metrics.get("eval/bpb")), f"{int(tokens):,}", f"{int(nbytes):,}"))
            rows.append(("all (macro)", f"{self.metrics['eval/macro_loss']:.4f}", _fmt(self.metrics.get("eval/macro_bpb")), "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def sets_from_config(path: str, overrides: Sequence[str], seq_len: int, *, progress: bool = True):
    """The validation sets of the training config at ``path`` (its tokenizer, the sets, and
    each tag's sets), their caches built where that config keeps them."""
    from levanter_core.config.train import load_train_config
    from levanter_core.data.dataset import held_out, sequence_dataset
    from levanter_core.data.pipeline import _open
    from levanter_core.data.tokenizer import load_tokenizer

    config, _ = load_train_config(path, list(overrides))
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer)
    sets = []
    held = data.num_validation_sequences or {}
    for name, source in data.configs.items():
        if name in held:
            cache = _open(data, name, "train", tokenizer, ray=None, background=False, progress=progress, build=True)
            dataset = held_out(sequence_dataset(cache, seq_len, packed=source.format.packed), name, held[name])[1]
        elif source.has_split("validation"):
            cache = _open(data, name, "validation", tokenizer, ray=None, background=False, progress=progress, build=True)
            dataset = sequence_dataset(cache, seq_len, packed=source.format.packed)
        else:
            continue
        tags = tuple(t for t in (source.tags or []) if t != name)
        sets.append(EvalSet(name, dataset, tags, f"{path}: {data.field_of(name)}"))
    if not sets:
        raise UserError(f"{path}: the config has no validation data (no source has validation_urls or a validation split)")
    return tokenizer, sets


def sets_from_files(files: Sequence[str], tokenizer, seq_len: int, cache_dir: str, *, taken=(), progress: bool = True):
    """One set per file (``.jsonl`` with a ``text`` field, ``.txt`` a document per line, ``.json``,
    ``.parquet``; compressed too), named by the file's name without its extensions (with ``_``
    added until it differs from the names ``taken``)."""
    from levanter_core.data.cache import open_cache
    from levanter_core.data.dataset import sequence_dataset
    from levanter_core.data.source import UrlSourceConfig

    sets, names = [], set(taken)
    for file in files:
        if "://" not in file and not os.path.exists(file):
            raise UserError(f"--data {file}: no such file")
        name = os.path.basename(file.rstrip("/")).split(".")[0] or "data"
        while name in names:
            name += "_"
        names.add(name)
        source = UrlSourceConfig(type="url", validation_urls=[file])
        cache = open_cache(
            os.path.join(cache_dir, name), source, "validation", tokenizer,
            enforce_eos=True, skip_bad_data=False, background=False, progress=progress,
        )  # fmt: skip
        sets.append(EvalSet(name, sequence_dataset(cache, seq_len, packed=source.format.packed), origin=f"--data {file}"))
    return sets


def evaluate_sets(model, sets: Sequence[EvalSet], tokenizer, *, batch_size: int, max_batches: int | None, progress: bool = True):
    """Each set's ``[nats, tokens, bytes]`` under ``model``: every sequence of the set once, in
    batches of ``batch_size`` (the last one smaller), at most ``max_batches`` of them.
    ``tokenizer`` is the one that tokenized the sets (it says how many bytes each token is)."""
    import haliax as hax
    import jax.numpy as jnp
    from haliax import Axis
    from tqdm.auto import tqdm

    from levanter_core.data.token_bytes import token_byte_lengths
    from levanter_core.models.lm import LmExample, lm_eval_totals

    lengths = jnp.asarray(token_byte_lengths(tokenizer, model.Vocab.size))
    step = hax.named_jit(lm_eval_totals)
    totals = {}
    for s in sets:
        total = np.zeros(3, np.float64)
        try:
            n = s.dataset.wait_complete()
        except DataError as e:  # too short for one sequence, say: name the set, not its cache
            raise UserError(f"{s.origin}: {str(e).split(': ', 1)[-1]}") from None
        starts = list(range(0, n, batch_size))[:max_batches]
        for start in tqdm(starts, desc=s.name, disable=not progress, leave=False):
            batch = s.dataset.rows(np.arange(start, min(start + batch_size, n), dtype=np.int64))
            Batch, Pos = Axis("batch", batch.tokens.shape[0]), Axis("position", batch.tokens.shape[1])

            def named(values, dtype):
                return None if values is None else hax.named(jnp.asarray(values, dtype), (Batch, Pos))

            example = LmExample(
                named(batch.tokens, jnp.int32), named(batch.loss_mask, jnp.float32), named(batch.segment_ids, jnp.int32)
            )
            total += np.asarray(step(model, example, lengths), np.float64)
        totals[s.name] = total
    return totals


def run_eval(
    source: str,
    *,
    config: str | None = None,
    overrides: Sequence[str] = (),
    data: Sequence[str] = (),
    tokenizer: str | None = None,
    batch_size: int = 8,
    max_batches: int | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
) -> EvalReport:
    """Evaluate the model of ``source`` (a checkpoint, an import, a Hugging Face directory or
    hub name) on the validation sets of ``config`` and on the ``data`` files."""
    from levanter_core.models.source import load_model_source
    from levanter_core.trainer.evaluators import eval_metrics

    if not config and not data:
        raise UserError("nothing to evaluate on: give --config CONFIG (its validation sets) or --data FILE")
    loaded = load_model_source(source, tokenizer=tokenizer)
    model = loaded.model
    seq_len = model.config.seq_len
    sets, totals = [], {}

    def evaluate(found, with_tokenizer):
        sets.extend(found)
        totals.update(
            evaluate_sets(model, found, with_tokenizer, batch_size=batch_size, max_batches=max_batches, progress=progress)
        )

    if config:
        config_tokenizer, found = sets_from_config(config, overrides, seq_len, progress=progress)
        evaluate(found, config_tokenizer)
    if data:
        if loaded.tokenizer is None:
            raise UserError(f"{source} has no tokenizer to read --data with: name one with --tokenizer")
        with tempfile.TemporaryDirectory(prefix="levanter-eval-") as scratch:
            found = sets_from_files(data, loaded.tokenizer, seq_len, cache_dir or scratch, taken=set(totals), progress=progress)
            evaluate(found, loaded.tokenizer)
    tags: dict[str, list[str]] = {}
    for s in sets:
        for tag in s.tags:
            tags.setdefault(tag, []).append(s.name)
    empty = [name for name, t in totals.items() if t[1] == 0]
    if empty:
        raise UserError(f"evaluation set(s) {', '.join(empty)} hold no sequence of {seq_len} tokens")
    metrics = eval_metrics(totals, tags, per_set=len(totals) > 1)
    return EvalReport(loaded.name, totals, metrics, tags)
