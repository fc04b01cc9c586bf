"""``levanter eval``: a model's evaluation metrics on evaluation sets, outside training.

What is measured is the model's training objective's
(:class:`~levanter_core.objective.Objective`): for a language model the loss and bits per byte,
for a speech model (Whisper) the loss and the word error rate of its greedy transcripts. The
sets are a training config's validation sets (``--config``, read into that config's cache as
training would) or given files (``--data``, read in the objective's data format with the
model's tokenizer into a temporary cache, or ``--cache-dir``). Each set is read as training
reads its validation data (for text: the documents, each followed by the end-of-text token, cut
into sequences of the model's ``seq_len``; for audio: one utterance a row); the metrics are
those training logs (:meth:`~levanter_core.objective.Objective.eval_metrics`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from tqdm.auto import tqdm

from levanter_core.config.levanter_current import EVAL_LM_FIELDS, translate_eval_program
from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import TrainConfig, objective_class, train_config_from_raw
from levanter_core.data.cache import SKIP_BAD_DATA_HINT, open_cache
from levanter_core.data.dataset import TOO_SHORT_HINT, held_out, sequence_dataset
from levanter_core.data.formats import MESSAGES_FIELD_HINT, TEXT_KEY_HINT
from levanter_core.data.pipeline import _open
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import DataError, UserError
from levanter_core.models.source import load_model_source
from levanter_core.objective import batch_totals, evaluate_batch

if TYPE_CHECKING:
    from levanter_core.data.dataset import SequenceDataset
    from levanter_core.objective import Objective


@dataclasses.dataclass
class EvalSet:
    name: str
    dataset: SequenceDataset
    tags: tuple[str, ...] = ()
    origin: str = ""
    """Where the set comes from, for messages (a file, a config's source)."""


@dataclasses.dataclass
class EvalReport:
    """Each set's evaluation totals (the objective's: ``[nats, tokens, bytes]`` for language
    modelling, ``[nats, tokens, word errors, words]`` for speech recognition) and the metrics
    made of them."""

    source: str
    totals: dict[str, np.ndarray]
    metrics: dict[str, float]
    """The objective's metrics over all sets (``eval/loss``, ``eval/bpb``, ``eval/<tag>/wer``...)."""
    tags: dict[str, list[str]]
    set_metrics: dict[str, dict[str, float]]
    """Each set's own metrics, without the ``eval/`` prefix (``loss``, ``bpb``...)."""
    counts: dict[int, str]
    """The totals shown as counts, by index (``{1: "tokens", 2: "bytes"}``)."""

    @property
    def rates(self) -> list[str]:
        """The metrics besides the loss that some set has (``bpb``, ``wer``), in order."""
        names = [k for metrics in self.set_metrics.values() for k in metrics if k != "loss"]
        return list(dict.fromkeys(names))

    def as_json(self) -> dict:
        """The metrics over everything (``loss``, ``bpb`` or ``wer``...) with their macro averages,
        then per set (with its counts) and per tag."""

        def pick(prefix: str) -> dict:
            found = {k[len(prefix) + 1 :]: v for k, v in self.metrics.items() if k.startswith(prefix + "/")}
            return {k: v for k, v in found.items() if "/" not in k and k != "micro_loss"}

        sets = {}
        for name, totals in self.totals.items():
            own = self.set_metrics[name]
            sets[name] = {
                "loss": own["loss"],
                **{rate: own.get(rate) for rate in self.rates},
                **{count: int(totals[i]) for i, count in self.counts.items()},
            }
        return {
            "source": self.source,
            **pick("eval"),
            "eval_sets": sets,
            "tags": {t: pick(f"eval/{t}") for t in self.tags},
        }

    def table(self) -> str:
        """The report as a text table: one row per set, then per tag, then all together."""
        rates, counts = self.rates, list(self.counts.items())
        m = self.metrics

        def values(prefix: str, macro: str = "") -> list[str]:
            """The loss and rates under ``prefix`` (``macro``: their ``macro_`` averages)."""
            return [f"{m[f'{prefix}/{macro}loss']:.4f}", *(_fmt(m.get(f"{prefix}/{macro}{r}")) for r in rates)]

        rows = [("set", "loss", *rates, *(name for _, name in counts))]
        for name, entry in self.as_json()["eval_sets"].items():
            rows.append(
                (name, f"{entry['loss']:.4f}", *(_fmt(entry[r]) for r in rates), *(f"{entry[c]:,}" for _, c in counts))
            )
        blank = [""] * len(counts)
        for tag, names in self.tags.items():
            rows.append((f"tag {tag} ({len(names)} sets)", *values(f"eval/{tag}"), *blank))
        if len(self.totals) > 1:
            summed = [f"{int(sum(t[i] for t in self.totals.values())):,}" for i, _ in counts]
            rows.append(("all (micro)", *values("eval"), *summed))
            rows.append(("all (macro)", *values("eval", macro="macro_"), *blank))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


@dataclasses.dataclass
class EvalConfig:
    """A config given to ``levanter eval --config``: a training config (its validation sets), or
    Levanter's ``eval_lm`` config, which also names the model (``checkpoint_path`` or
    ``hf_checkpoint``: :attr:`source`) and the length of the evaluated sequences
    (``max_eval_length``: :attr:`length`)."""

    path: str
    config: TrainConfig
    source: str | None = None
    length: int | None = None


def load_eval_config(path: str, overrides: Sequence[str] = ()) -> EvalConfig:
    """The config at ``path`` with ``overrides``, read as :class:`EvalConfig` says."""
    raw, sources = load_config_dict(path, list(overrides))
    source = length = None
    if isinstance(raw, dict) and any(name in raw for name in EVAL_LM_FIELDS):
        raw, source, length = translate_eval_program(raw, sources)
    config, _ = train_config_from_raw(raw, sources)
    return EvalConfig(path, config, source, length)


def sets_from_config(loaded: EvalConfig, seq_len: int, field_lengths: Mapping[str, int], *, progress: bool = True):
    """The validation sets of a training config (its tokenizer, the sets, and each tag's sets),
    their caches built where that config keeps them. ``field_lengths``: the objective's
    :meth:`~levanter_core.objective.Objective.row_lengths` (for audio, say)."""
    path, data = loaded.path, loaded.config.data
    tokenizer = load_tokenizer(data.tokenizer)
    sets = []
    held = data.held_out()  # num_validation_sequences, validation_split_fraction
    for name, source in data.configs.items():
        if name in held:
            split = "train"
        elif source.has_split("validation"):
            split = "validation"
        else:
            continue
        cache = _open(data, name, split, tokenizer, ray=None, background=False, progress=progress, build=True)
        dataset = sequence_dataset(cache, seq_len, layout=source.format.layout, field_lengths=field_lengths)
        if name in held:
            dataset = held_out(dataset, name, held[name], shuffled=data.shuffles_split(held[name]))[1]
        tags = tuple(t for t in (source.tags or []) if t != name)
        sets.append(EvalSet(name, dataset, tags, f"{path}: {data.field_of(name)}"))
    if not sets:
        raise UserError(
            f"{path}: the config has no validation data (no source has validation_urls or a validation split)"
        )
    return tokenizer, sets


def sets_from_files(
    files: Sequence[str],
    tokenizer,
    seq_len: int,
    cache_dir: str,
    *,
    data_format: dict | None = None,
    field_lengths: Mapping[str, int] | None = None,
    taken=(),
    progress: bool = True,
):
    """One set per file, named by the file's name without its extensions (with ``_`` added
    until it differs from the names ``taken``), read in ``data_format`` (a ``format`` section;
    None: text, from ``.jsonl`` with a ``text`` field, ``.txt`` a document per line, ``.json``,
    ``.parquet``, compressed too; ``{"type": "audio"}``: a manifest of ``audio`` and ``text``).
    ``field_lengths``: as for :func:`sets_from_config`."""
    sets, names = [], set(taken)
    for file in files:
        if "://" not in file and not os.path.exists(file):
            raise UserError(f"--data {file}: no such file")
        name = os.path.basename(file.rstrip("/")).split(".")[0] or "data"
        while name in names:
            name += "_"
        names.add(name)
        source = UrlSourceConfig.model_validate(
            {"type": "url", "validation_urls": [file], **({"format": data_format} if data_format else {})}
        )
        try:
            cache = open_cache(
                os.path.join(cache_dir, name), source, "validation", tokenizer,
                enforce_eos=True, skip_bad_data=False, background=False, progress=progress,
            )  # fmt: skip
        except DataError as e:
            raise UserError(for_eval_data(str(e))) from None
        dataset = sequence_dataset(cache, seq_len, layout=source.format.layout, field_lengths=field_lengths)
        sets.append(EvalSet(name, dataset, origin=f"--data {file}"))
    return sets


EVAL_TOO_SHORT_HINT = "add data (evaluation cuts it into sequences of the model's seq_len)"
"""An evaluation set too short for one sequence: its sequences are the model's, so only more data helps."""

_EVAL_DATA_HINTS = {
    TEXT_KEY_HINT: "`levanter eval --data` reads each record's 'text' field (for another, give a training config "
    "with --config whose validation source sets format.text_key)",
    MESSAGES_FIELD_HINT: "`levanter eval --data` reads each record's 'messages' field (for another, give a training "
    "config with --config whose validation source sets format.messages_field)",
    SKIP_BAD_DATA_HINT: "fix or remove it: `levanter eval --data` reads every record (a training config given with "
    "--config may set data.skip_bad_data: true)",
    TOO_SHORT_HINT: EVAL_TOO_SHORT_HINT,
}


def for_eval_data(message: str) -> str:
    """``message`` (a data error) with the advice it gives a training run (settings of its config,
    which ``levanter eval --data`` has not) replaced by what can be done in an evaluation."""
    for hint, instead in _EVAL_DATA_HINTS.items():
        message = message.replace(hint, instead)
    return message


def evaluate_sets(
    model,
    sets: Sequence[EvalSet],
    objective,
    tokenizer,
    *,
    batch_size: int,
    max_batches: int | None,
    progress: bool = True,
):
    """Each set's evaluation totals under ``model``, those of ``objective``
    (:meth:`~levanter_core.objective.Objective.eval_totals`, then the sums of its
    :meth:`~levanter_core.objective.Objective.eval_outputs` where it has outputs): every row of
    the set once, in batches of ``batch_size`` (the last one smaller), at most ``max_batches``
    of them. ``tokenizer`` is the one that tokenized the sets (for the objective's
    :meth:`~levanter_core.objective.Objective.eval_constants`: how many bytes each token is)."""
    constants = objective.eval_constants(model, tokenizer)

    step = hax.named_jit(lambda model, example, *constants: evaluate_batch(objective, model, example, *constants))
    totals = {}
    for s in sets:
        total = None
        try:
            n = s.dataset.wait_complete()
        except DataError as e:  # too short for one sequence, say: name the set, not its cache
            problem = str(e).split(": ", 1)[-1].replace(TOO_SHORT_HINT, EVAL_TOO_SHORT_HINT)
            raise UserError(f"{s.origin}: {problem}") from None
        starts = list(range(0, n, batch_size))[:max_batches]
        for start in tqdm(starts, desc=s.name, disable=not progress, leave=False):
            batch = s.dataset.rows(np.arange(start, min(start + batch_size, n), dtype=np.int64))
            part = batch_totals(objective, *step(model, example_of(objective, batch), *constants))
            total = part if total is None else total + part
        totals[s.name] = np.zeros(2) if total is None else total
    return totals


def example_of(objective, batch):
    """The objective's example of a host ``batch``: the arrays it names
    (:meth:`~levanter_core.objective.Objective.fields`) as named arrays on the default device,
    the batch axis (``batch``) first."""
    fields = objective.fields(batch)
    Batch = Axis("batch", next(len(f.values) for f in fields.values() if f.values is not None))

    def named(field):
        if field.values is None:
            return None
        values = jnp.asarray(field.values, field.dtype)
        return hax.named(values, (Batch, *(Axis(a, size) for a, size in zip(field.axes, values.shape[1:]))))

    return objective.example({name: named(field) for name, field in fields.items()})


def run_eval(
    source: str | None,
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
    hub name; None: the one ``config`` names, as Levanter's ``eval_lm`` configs do) on the
    validation sets of ``config`` and on the ``data`` files, through the model's training
    objective."""
    if not config and not data:
        raise UserError("nothing to evaluate on: give --config CONFIG (its validation sets) or --data FILE")
    evaluated = load_eval_config(config, overrides) if config else None
    source = source or (evaluated.source if evaluated else None)
    if source is None:
        raise UserError(
            "which model? give SOURCE (a checkpoint, an import or a Hugging Face model), or name it in the "
            "config (Levanter's checkpoint_path or hf_checkpoint)"
        )
    loaded = load_model_source(source, tokenizer=tokenizer)
    model = loaded.model
    seq_len = model.config.seq_len
    if evaluated is not None and evaluated.length is not None:
        if evaluated.length > seq_len:
            raise UserError(
                f"{config}: max_eval_length ({evaluated.length}) exceeds the model's context ({seq_len} tokens)"
            )
        seq_len = evaluated.length
    kind = cast("type[Objective]", objective_class(model.config))  # (a registered objective's class)
    field_lengths = kind.row_lengths(model.config)
    sets, totals = [], {}
    objective: Objective | None = None

    def evaluate(found, with_tokenizer):
        nonlocal objective
        # the objective decodes with the tokenizer that encoded the sets (a speech model's transcripts)
        objective = kind.for_evaluation(model.config, with_tokenizer)
        sets.extend(found)
        totals.update(
            evaluate_sets(
                model,
                found,
                objective,
                with_tokenizer,
                batch_size=batch_size,
                max_batches=max_batches,
                progress=progress,
            )
        )

    if config:
        assert evaluated is not None
        config_tokenizer, found = sets_from_config(evaluated, seq_len, field_lengths, progress=progress)
        evaluate(found, config_tokenizer)
    if data:
        if loaded.tokenizer is None:
            raise UserError(f"{source} has no tokenizer to read --data with: name one with --tokenizer")
        with tempfile.TemporaryDirectory(prefix="levanter-eval-") as scratch:
            found = sets_from_files(
                data, loaded.tokenizer, seq_len, cache_dir or scratch, data_format=kind.default_format,
                field_lengths=field_lengths, taken=set(totals), progress=progress,
            )  # fmt: skip
            evaluate(found, loaded.tokenizer)
    tags: dict[str, list[str]] = {}
    for s in sets:
        for tag in s.tags:
            tags.setdefault(tag, []).append(s.name)
    empty = [name for name, t in totals.items() if t[1] == 0]
    if empty:
        raise UserError(f"evaluation set(s) {', '.join(empty)} hold no sequence of {seq_len} tokens")
    assert objective is not None  # set by evaluate(), called for the config or the data (one is given)
    metrics = objective.eval_metrics(totals, tags, per_set=len(totals) > 1)
    set_metrics = {}
    for name, t in totals.items():
        own = objective.eval_metrics({name: t}, {}, per_set=False)
        set_metrics[name] = {
            k[len("eval/") :]: v for k, v in own.items() if k.count("/") == 1 and k != "eval/micro_loss"
        }
    return EvalReport(loaded.name, totals, metrics, tags, set_metrics, dict(objective.eval_counts))
