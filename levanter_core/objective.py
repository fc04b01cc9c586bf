"""Training objectives: what a batch holds, the loss a step minimizes, and what evaluation sums.

The trainer runs one :class:`Objective` and never asks which: it places the arrays the
objective names (:meth:`Objective.fields`) on the mesh, split over the batch axis, hands them
back to the objective to make its *example* (:meth:`Objective.example`), and calls
:meth:`Objective.loss` inside the compiled step, :meth:`Objective.eval_loss` and
:meth:`Objective.eval_totals` in evaluation. Checkpoints, resumption, sharding, mixed precision,
microbatches and trackers are the trainer's, and the same for every objective.

Causal language modelling, :class:`LmObjective` (registered as ``lm``), is built in; a plugin
registers others with the ``register_objectives`` hook::

    @hookimpl
    def register_objectives(register):
        register("asr", SpeechRecognition)

A model config names the objective it trains with (:attr:`Objective.name`, through its
``objective`` class attribute; ``lm`` for every decoder language model); a run's ``objective:``
section picks another (``{type: dpo, beta: 0.1}``), with the settings of :attr:`Objective.options`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from levanter_core.data.token_bytes import token_byte_lengths
from levanter_core.models import lm
from levanter_core.models.lm import LmExample, _targets_and_mask, as_example, lm_eval_totals, lm_sampled_loss
from levanter_core.trainer.evaluators import eval_metrics


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One array of a host batch: ``values`` ``[rows, ...]`` (None: the batch has no such
    array), the names of its axes after the batch axis, and the dtype it is placed with."""

    values: np.ndarray | None
    axes: tuple[str, ...]
    dtype: Any


class Objective(abc.ABC):
    """What a run trains its model to do. Subclasses are registered by name
    (``register_objectives``) and built once per run."""

    name: ClassVar[str]
    """The name a model config gives (its ``objective``) to train with this objective."""

    eval_counts: ClassVar[dict[int, str]] = {1: "tokens"}
    """Which of :meth:`eval_totals`' sums (with :meth:`eval_output_totals`' after them) are counts
    that reports show beside the metrics, by index: the second, what the loss averages over, is
    ``tokens``."""

    keeps_reference: ClassVar[bool] = False
    """Whether the objective compares the model with the model as training started (preference
    optimization): the trainer then keeps that *reference* frozen beside the model (a copy of
    the starting weights in :class:`~levanter_core.trainer.state.TrainerState`, checkpointed
    with it; for a model with LoRA adapters, the model without them, which costs nothing) and
    passes it as the keyword ``reference`` to :meth:`loss`, :meth:`eval_loss` and
    :meth:`eval_totals`. An objective whose reference is another model (a distillation
    teacher) also sets it, and returns that model from :meth:`frozen_model`."""

    sequences_per_row: ClassVar[int] = 1
    """How many sequences of ``seq_len`` tokens one batch row holds (a preference pair's chosen
    and rejected answers: 2): throughput counts the tokens of each."""

    flops_scale: ClassVar[float] = 1.0
    """The step's work per token relative to training a language model on it (a forward and a
    backward pass, three forwards' worth): an objective that also runs a frozen reference forward
    does four, 4/3. Model FLOP/s (and so MFU) are scaled by it."""

    options: ClassVar[type | None] = None
    """The objective's own settings: a :class:`~levanter_core.config.base.ConfigModel` that a
    run's ``objective:`` section (``{type: NAME, ...settings}``) is validated into, given to
    :meth:`from_config` as ``config.objective_options``. None: the objective takes none."""

    default_format: ClassVar[dict[str, Any] | None] = None
    """The data format (a ``format`` section, ``{"type": "audio"}`` say) that every data source
    written without a ``format`` gets in a run of this objective; None: the sources' own
    default (``text``)."""

    @classmethod
    def for_evaluation(cls, model_config: Any, tokenizer: Any) -> Objective:
        """The objective as evaluation outside a training run uses it (``levanter eval``), for a
        model of ``model_config`` whose data ``tokenizer`` encoded; by default built with no
        arguments."""
        return cls()

    @classmethod
    def row_lengths(cls, model_config: Any) -> dict[str, int]:
        """For data whose format stores arrays of its own with each document (``document``
        layouts, such as audio samples beside a transcript): how many values of each, by name,
        one batch row holds for a model of ``model_config`` (longer ones are cut, shorter ones
        padded with zeros). Empty by default: the objective reads token ids only."""
        return {}

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Refuse, when the run's config (a :class:`~levanter_core.config.train.TrainConfig`)
        loads, before any data is read, a run this objective cannot train: raise ``ValueError``
        with a message that names the field (data whose format it cannot read, say). By default
        nothing is refused."""

    @classmethod
    def from_config(cls, config: Any) -> Objective:
        """The objective of the run ``config`` (a :class:`~levanter_core.config.train.TrainConfig`)
        describes; by default built with no arguments, or with the settings of its ``objective:``
        section (``config.objective_options``, an instance of :attr:`options`) as keywords."""
        settings = getattr(config, "objective_options", None)
        return cls() if settings is None else cls(**dict(settings))

    def frozen_model(self, Vocab: Any) -> Any | None:
        """A model of its own to keep frozen beside the trained one (a distillation teacher),
        loaded from the objective's options when the run starts; None (the default): none.
        ``Vocab`` is the trained model's vocabulary axis: a model of another vocabulary should be
        refused here (``ConfigError`` naming the option). An objective that returns one sets
        :attr:`keeps_reference`: the trainer then keeps this model, cast to the compute precision
        and placed with the parameter sharding, in the state's ``reference`` slot (in place of a
        copy of the starting weights), passes it as the keyword ``reference`` to :meth:`loss`,
        :meth:`eval_loss` and :meth:`eval_totals` (an argument of the compiled step, not a
        constant of it), and leaves it out of checkpoints: it is loaded again at every start,
        a resumed run's included."""
        return None

    @abc.abstractmethod
    def fields(self, batch: Any) -> dict[str, BatchField]:
        """The arrays of ``batch`` (one host batch of the run's data, ``[rows, ...]`` each),
        by name, as the trainer should place them."""

    @abc.abstractmethod
    def example(self, arrays: Mapping[str, NamedArray | None]) -> Any:
        """What :meth:`loss` receives: made from the placed arrays of :meth:`fields` (named
        arrays whose first axis is the batch axis), a pytree of named arrays."""

    @abc.abstractmethod
    def loss(self, model: Any, example: Any, *, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The mean loss of a batch that the step minimizes, and scalars to log with it."""

    def sampled_loss(self, model: Any, example: Any, *, key: jax.Array) -> jax.Array:
        """The loss of a batch against targets drawn (with ``key``) from the model's own
        predictions for it, the draw held fixed under differentiation: the gradient of this is
        what Gauss-Newton estimates of the Hessian square (Sophia-G), and optimizers reach it
        through :class:`~levanter_core.optim.BatchObjective`. Objectives that cannot draw
        targets leave it unimplemented, and such optimizers refuse them."""
        raise NotImplementedError(f"the {self.name!r} objective cannot draw targets from its model's predictions")

    def data_points(self, example: Any) -> jax.Array:
        """How many predictions :meth:`loss` averages over in a batch (float32 scalar): by default
        the batch's rows."""
        leaves = list(jax.tree.leaves(example, is_leaf=lambda x: isinstance(x, NamedArray)))
        return jnp.asarray(leaves[0].axes[0].size, jnp.float32)

    def eval_loss(self, model: Any, example: Any) -> jax.Array:
        """The loss evaluation reports for a batch (by default :meth:`loss`'s, which may hold
        auxiliary terms that evaluation should leave out: override it then)."""
        return self.loss(model, example, key=None)[0]

    @abc.abstractmethod
    def eval_totals(self, model: Any, example: Any, *constants: Any) -> jax.Array:
        """Sums that add up over evaluation batches, float32 ``[n]``, the first two the summed
        loss and what it is averaged over (tokens, say); ``constants`` are
        :meth:`eval_constants`, passed with every batch."""

    def eval_outputs(self, model: Any, example: Any) -> Any:
        """What evaluation computes on the device for a batch besides :meth:`eval_totals`, for
        totals that only the host can work out (a speech model's greedy transcripts, whose words
        are compared with the references'): a pytree of arrays, gathered whole to every process
        and handed to :meth:`eval_output_totals`. None (the default): nothing."""
        return None

    def eval_output_totals(self, outputs: Any) -> np.ndarray:
        """Sums of one batch's :meth:`eval_outputs` (numpy arrays), appended after
        :meth:`eval_totals`' and added up over batches the same way."""
        raise NotImplementedError(f"{type(self).__name__}.eval_outputs returns outputs, so it must sum them here")

    def eval_constants(self, model: Any, tokenizer: Any) -> tuple[Any, ...]:
        """Device arrays that :meth:`eval_totals` needs besides the batch, computed once per
        run (none by default)."""
        return ()

    def eval_metrics(
        self, totals: Mapping[str, Sequence[float]], tags: Mapping[str, Sequence[str]], *, per_set: bool
    ) -> dict[str, float]:
        """The metrics of a validation pass from each set's totals (``tags``: tag -> the sets
        that carry it; ``per_set``: also each set's own). By default the loss (and bits per
        byte where the totals have a third entry, bytes) of
        :func:`levanter_core.trainer.evaluators.eval_metrics`."""
        return eval_metrics(totals, tags, per_set=per_set)


def evaluate_batch(
    objective: Objective, model: Any, example: Any, *constants: Any, **reference: Any
) -> tuple[jax.Array, Any]:
    """One evaluation batch's :meth:`~Objective.eval_totals` and :meth:`~Objective.eval_outputs`
    (None for an objective without outputs), traceable: compiled as one program, so what both
    compute (a speech model's encoder) is computed once. ``reference``: the keyword
    ``reference=`` for objectives that keep one (:attr:`Objective.keeps_reference`), else none."""
    return objective.eval_totals(model, example, *constants, **reference), objective.eval_outputs(model, example)


def batch_totals(objective: Objective, totals: Any, outputs: Any) -> np.ndarray:
    """One batch's totals on the host, float64: :meth:`~Objective.eval_totals`' followed by the
    sums :meth:`~Objective.eval_output_totals` makes of ``outputs`` (when there are any)."""
    found = np.asarray(totals, np.float64)
    if outputs is None:
        return found
    host = objective.eval_output_totals(jax.tree.map(np.asarray, outputs))
    return np.concatenate([found, np.asarray(host, np.float64)])


class LmObjective(Objective):
    """Next-token prediction: a batch is token ids ``[rows, position]``, or a ``data.Batch``
    with a loss mask and segment ids (packed chat and supervised data); the example an
    :class:`~levanter_core.models.lm.LmExample`. ``loss_fn`` and ``eval_loss_fn`` replace the
    cross-entropy of :func:`~levanter_core.models.lm.lm_loss_and_metrics` (with
    ``z_loss_weight``) and :func:`~levanter_core.models.lm.lm_eval_loss`."""

    name = "lm"
    eval_counts = {1: "tokens", 2: "bytes"}

    @classmethod
    def from_config(cls, config: Any) -> LmObjective:
        return cls(z_loss_weight=config.z_loss_weight)

    def __init__(
        self,
        *,
        z_loss_weight: float = 0.0,
        loss_fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]] | None = None,
        eval_loss_fn: Callable[..., jax.Array] | None = None,
    ) -> None:
        self._loss = loss_fn or (
            lambda model, ex, *, key: lm.lm_loss_and_metrics(model, ex, key=key, z_loss_weight=z_loss_weight)
        )
        if eval_loss_fn is not None:
            self._eval_loss = eval_loss_fn
        elif loss_fn is not None:
            self._eval_loss = lambda model, ex, *, key: loss_fn(model, ex, key=key)[0]
        else:
            self._eval_loss = lm.lm_eval_loss

    def fields(self, batch: Any) -> dict[str, BatchField]:
        return {
            "tokens": BatchField(getattr(batch, "tokens", batch), ("position",), np.int32),
            "loss_mask": BatchField(getattr(batch, "loss_mask", None), ("position",), np.float32),
            "segment_ids": BatchField(getattr(batch, "segment_ids", None), ("position",), np.int32),
        }

    def example(self, arrays: Mapping[str, NamedArray | None]) -> Any:
        return LmExample(arrays["tokens"], arrays["loss_mask"], arrays["segment_ids"])

    def loss(self, model: Any, example: Any, *, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self._loss(model, example, key=key)

    def eval_loss(self, model: Any, example: Any) -> jax.Array:
        return self._eval_loss(model, example, key=None)

    def sampled_loss(self, model: Any, example: Any, *, key: jax.Array) -> jax.Array:
        """Next-token cross-entropy against tokens sampled from the model's predictions
        (:func:`~levanter_core.models.lm.lm_sampled_loss`)."""
        return lm_sampled_loss(model, example, key=key)

    def data_points(self, example: Any) -> jax.Array:
        """The positions whose next token the loss counts."""
        example = as_example(example)
        points: jax.Array = _targets_and_mask(example.tokens, example.loss_mask)[1].sum().scalar()
        return points

    def eval_totals(self, model: Any, example: Any, *constants: Any) -> jax.Array:
        """``[nats, tokens, bytes]`` (:func:`~levanter_core.models.lm.lm_eval_totals`); the
        constant is the bytes of text each token id stands for."""
        (byte_lengths,) = constants
        return lm_eval_totals(model, example, byte_lengths)

    def eval_constants(self, model: Any, tokenizer: Any) -> tuple[Any, ...]:
        """The bytes of text each token id stands for (as long as the model's vocabulary: ids
        past the tokenizer's stand for none), for bits per byte."""
        return (jnp.asarray(token_byte_lengths(tokenizer, model.Vocab.size)),)
