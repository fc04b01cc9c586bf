"""Direct preference optimization (``objective: {type: dpo, beta: 0.1}``).

DPO (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model") trains a policy on pairs of a chosen and a rejected answer to one prompt, against
a frozen *reference* model, usually the policy as training started. The implicit reward of an
answer ``y`` is ``beta * (log pi(y) - log ref(y))``, where ``log pi(y)`` is the sum of the
log-probabilities of the answer's tokens given everything before them; the loss of a pair is

    -(1 - ls) * log sigmoid(beta * m) - ls * log sigmoid(-beta * m)
    m = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))

with ``ls`` the label smoothing of conservative DPO (cDPO; 0: plain DPO, the sigmoid loss), the
mean over the batch's pairs. A batch holds each pair in one row: the chosen sequence's ids and
mask, the rejected sequence's (the ``preference`` data format's document fields, see
:mod:`levanter_preference.format`); masks are 1 at each position whose *next* token is scored.

The trainer keeps the reference (``keeps_reference``): a frozen copy of the starting weights, or,
for a model with LoRA adapters, the model without them. Its log-probabilities are computed in
the step, under ``stop_gradient``. Chosen and rejected sequences go through each model in one
forward pass (stacked on a ``side`` axis); the log-probabilities come from the hidden states
block by block, each block's logits recomputed in the backward pass rather than kept, so no
more than one block of logits is held at a time, as in the core's language-modelling loss.

What every preference objective shares (the batch, the metrics, evaluation) is
:class:`PairObjective`; SimPO, IPO and ORPO, in :mod:`levanter_preference.variants`, differ from
DPO only in how they score a pair (:meth:`PairObjective.scores`).
"""

from __future__ import annotations

import abc

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from pydantic import Field

from levanter_core.config.base import ConfigModel
from levanter_core.models.cross_entropy import soft_cap
from levanter_core.models.lm import loss_inputs
from levanter_core.objective import BatchField, Objective
from levanter_core.trainer.evaluators import eval_metrics
from levanter_preference.format import CHOSEN_MASK, FIELDS, REJECTED_IDS, REJECTED_MASK

SIDE = "side"
"""The axis on which a batch's chosen (0) and rejected (1) sequences are stacked."""


class DpoOptions(ConfigModel):
    """The settings of ``objective: {type: dpo, ...}``."""

    beta: float = Field(0.1, gt=0)
    """How far the policy may move from the reference: the scale of the implicit rewards
    ``beta * (log pi - log ref)``. Small values (0.1, the usual default) let it go further."""

    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The probability that a pair's preference is the wrong way round (conservative DPO, cDPO):
    the loss becomes ``-(1 - ls) log sigmoid(beta m) - ls log sigmoid(-beta m)``. 0: plain DPO."""


class PreferenceExample(eqx.Module):
    """A batch of preference pairs on the mesh, ``(batch, position)`` each: token ids, and
    masks that are 1 where a position's next token is part of the answer being scored."""

    chosen: NamedArray
    chosen_mask: NamedArray
    rejected: NamedArray
    rejected_mask: NamedArray


class PairScores(eqx.Module):
    """What a preference objective computes for each pair of a batch, ``(batch,)`` each."""

    losses: NamedArray
    """The pair's loss."""
    rewards_chosen: NamedArray
    """The chosen answer's reward, as the objective defines it (DPO: ``beta * (log pi(chosen) -
    log ref(chosen))``)."""
    rewards_rejected: NamedArray
    """The rejected answer's reward, likewise."""
    logps_chosen: NamedArray
    """The policy's summed log-probability of the chosen answer."""
    logps_rejected: NamedArray
    """The policy's summed log-probability of the rejected answer."""
    counted: NamedArray
    """1.0 for a pair that has a scored token on both sides, else 0.0 (an answer cut off by
    ``seq_len``): such a pair compares nothing and is left out of every mean."""
    rounding: NamedArray
    """How far apart the two rewards may be and still be equal but for rounding: a margin no
    larger is a tie (see :func:`ranked_right`)."""
    extra: dict[str, NamedArray] = eqx.field(default_factory=dict)
    """Further per-pair quantities the objective logs (as ``<name>/<key>``, means over the pairs)."""

    @classmethod
    def of_sides(
        cls,
        losses: NamedArray,
        rewards: NamedArray,
        policy: NamedArray,
        counted: NamedArray,
        rounding: NamedArray,
        extra: dict[str, NamedArray] | None = None,
    ) -> PairScores:
        """The scores from ``rewards`` and ``policy`` (the summed log-probabilities) as they come,
        ``(side, batch)`` with the chosen answers at side 0 and the rejected at side 1."""
        return cls(
            losses=losses,
            rewards_chosen=rewards[SIDE, 0],
            rewards_rejected=rewards[SIDE, 1],
            logps_chosen=policy[SIDE, 0],
            logps_rejected=policy[SIDE, 1],
            counted=counted,
            rounding=rounding,
            extra=extra or {},
        )


class PairObjective(Objective):
    """What every preference objective shares: a batch row is a pair of a chosen and a rejected
    sequence (the ``preference`` format's), the loss the mean of :meth:`scores`' per-pair losses
    over the pairs with something scored on both sides, and the same metrics, logged under
    DPO's names whichever the objective (so that runs of each compare on one chart): every step
    ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/margin`` (chosen's reward less
    rejected's), ``dpo/accuracy`` (the share of pairs whose chosen answer has the higher
    reward, a tie up to rounding not counted: :func:`ranked_right`), ``dpo/logps_chosen`` and
    ``dpo/logps_rejected`` (the policy's summed log-probabilities), with the objective's own
    (``PairScores.extra``) as ``<name>/<key>``; each evaluation ``eval/loss`` (per pair),
    ``eval/dpo_accuracy`` and ``eval/dpo_margin``. A subclass says how a pair is scored."""

    default_format = {"type": "preference"}
    eval_counts = {1: "pairs"}
    sequences_per_row = 2  # a pair: the chosen and the rejected sequence

    @abc.abstractmethod
    def scores(self, model, example: PreferenceExample, reference, *, key=None) -> PairScores:
        """Each pair's loss, rewards and log-probabilities under ``model`` (the policy, which the
        gradient flows through) and ``reference`` (the frozen reference model for objectives
        that keep one, which it does not; else None)."""

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse, when the config loads, data whose format does not store preference pairs
        (every source's must: the ``preference`` format, or one with its document fields)."""
        for name, source in config.data.configs.items():
            if not set(FIELDS) <= set(source.format.document_fields()):
                raise ValueError(
                    f"{config.data.field_of(name)}.format: the {cls.name} objective reads preference pairs (a chosen "
                    f"and a rejected answer per record), but this source's format is {source.format.type!r}; set "
                    "format: {type: preference} (or leave the format out, which means preference for this objective)"
                )

    @classmethod
    def row_lengths(cls, model_config) -> dict[str, int]:
        """Each pair's masks and rejected sequence are as long as its chosen sequence: ``seq_len``."""
        return dict.fromkeys(FIELDS, model_config.seq_len)

    def fields(self, batch) -> dict[str, BatchField]:
        """The chosen sequences are the batch's token ids; the rest are its document fields."""
        return {
            "chosen": BatchField(batch.tokens, ("position",), np.int32),
            "chosen_mask": BatchField(batch.fields[CHOSEN_MASK], ("position",), np.float32),
            "rejected": BatchField(batch.fields[REJECTED_IDS], ("position",), np.int32),
            "rejected_mask": BatchField(batch.fields[REJECTED_MASK], ("position",), np.float32),
        }

    def example(self, arrays) -> PreferenceExample:
        return PreferenceExample(arrays["chosen"], arrays["chosen_mask"], arrays["rejected"], arrays["rejected_mask"])

    def loss(self, model, example: PreferenceExample, *, key, reference=None) -> tuple[jax.Array, dict]:
        """The mean loss of the batch's pairs, and the metrics of the class docstring (means over
        the pairs)."""
        s = self.scores(model, example, reference, key=key)

        def mean(x):
            return hax.sum(x * s.counted).scalar() / jnp.maximum(hax.sum(s.counted).scalar(), 1.0)

        metrics = {
            "dpo/rewards_chosen": mean(s.rewards_chosen),
            "dpo/rewards_rejected": mean(s.rewards_rejected),
            "dpo/margin": mean(s.rewards_chosen - s.rewards_rejected),
            "dpo/accuracy": mean(ranked_right(s)),
            "dpo/logps_chosen": mean(s.logps_chosen),
            "dpo/logps_rejected": mean(s.logps_rejected),
            **{f"{self.name}/{name}": mean(value) for name, value in s.extra.items()},
        }
        return mean(s.losses), jax.lax.stop_gradient(metrics)

    def data_points(self, example: PreferenceExample) -> jax.Array:
        """The pairs the loss averages over (those with a scored token on both sides)."""
        return hax.sum(comparable_pairs(*stacked_sides(example))).scalar()

    # -- evaluation ----------------------------------------------------------------------------
    def eval_loss(self, model, example: PreferenceExample, *, reference=None) -> jax.Array:
        return self.loss(model, example, key=None, reference=reference)[0]

    def eval_totals(self, model, example: PreferenceExample, *constants, reference=None) -> jax.Array:
        """``[summed loss, pairs, pairs whose chosen answer has the higher reward, summed
        margins]``, float32."""
        s = self.scores(model, example, reference)
        margins = s.rewards_chosen - s.rewards_rejected
        return jnp.stack([hax.sum(x * s.counted).scalar() for x in (s.losses, s.counted, ranked_right(s), margins)])

    def eval_metrics(self, totals, tags, *, per_set: bool) -> dict[str, float]:
        """The loss of :func:`~levanter_core.trainer.evaluators.eval_metrics` (per pair), and
        ``dpo_accuracy`` and ``dpo_margin`` over every set's pairs, each set's (``per_set``) and
        each tag's, beside the loss of the same sets."""
        metrics = eval_metrics({name: t[:2] for name, t in totals.items()}, tags, per_set=per_set)
        groups = {"eval": list(totals)}
        if per_set:
            groups |= {f"eval/{name}": [name] for name in totals}
        groups |= {f"eval/{tag}": [n for n in names if n in totals] for tag, names in tags.items()}
        for prefix, names in groups.items():
            pairs = sum(totals[n][1] for n in names)
            if pairs:
                metrics[f"{prefix}/dpo_accuracy"] = sum(totals[n][2] for n in names) / pairs
                metrics[f"{prefix}/dpo_margin"] = sum(totals[n][3] for n in names) / pairs
        return metrics


class DpoObjective(PairObjective):
    """The ``dpo`` objective: preference pairs scored against a frozen reference model, with the
    loss of the module docstring; rewards ``beta * (log pi - log ref)`` of the summed
    log-probabilities. Logs what :class:`PairObjective` says."""

    name = "dpo"
    keeps_reference = True
    options = DpoOptions
    flops_scale = 4 / 3  # the policy's forward and backward, and the reference's forward

    def __init__(self, *, beta: float = 0.1, label_smoothing: float = 0.0):
        settings = DpoOptions(beta=beta, label_smoothing=label_smoothing)
        self.beta = settings.beta
        self.label_smoothing = settings.label_smoothing

    def scores(self, model, example: PreferenceExample, reference, *, key=None) -> PairScores:
        tokens, masks = stacked_sides(example)
        policy, ref = policy_and_reference(self.name, model, reference, tokens, masks, key=key)
        rewards = self.beta * (policy - ref)
        margin = rewards[SIDE, 0] - rewards[SIDE, 1]  # beta * m
        return PairScores.of_sides(
            losses=smoothed_sigmoid_loss(margin, self.label_smoothing),
            rewards=rewards,
            policy=policy,
            counted=comparable_pairs(tokens, masks),
            rounding=self.beta * ROUNDING * hax.sum(hax.abs(policy) + hax.abs(ref), SIDE),
        )


def smoothed_sigmoid_loss(z: NamedArray, label_smoothing: float) -> NamedArray:
    """``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``: the sigmoid loss of a pair whose
    preference is the wrong way round with probability ``ls`` (cDPO's label smoothing)."""
    return -(1 - label_smoothing) * hax.nn.log_sigmoid(z) - label_smoothing * hax.nn.log_sigmoid(-z)


def policy_and_reference(
    objective: str, model, reference, tokens: NamedArray, masks: NamedArray, *, key=None
) -> tuple[NamedArray, NamedArray]:
    """The summed log-probabilities (:func:`sequence_log_probs`) of ``tokens`` under the policy
    ``model`` and under ``reference``, which the gradient does not reach."""
    if reference is None:
        raise ValueError(f"the {objective} objective compares the model with a reference model: pass reference=")
    policy = sequence_log_probs(model, tokens, masks, key=key)
    return policy, jax.lax.stop_gradient(sequence_log_probs(reference, tokens, masks))


# -- log-probabilities of sequences ------------------------------------------------------------


def sequence_log_probs(model, tokens: NamedArray, mask: NamedArray, *, key=None) -> NamedArray:
    """``sum_t mask[t] * log p(tokens[t + 1] | tokens[<= t])`` for each sequence of ``tokens``
    (any axes besides ``position``, which the result drops), float32. ``mask`` follows the core's
    ``loss_mask`` convention: the weight of predicting the token *after* each position; the last
    position predicts nothing and is left out whatever ``mask`` says. Attention is causal:
    padding after a sequence's end does not change its scores."""
    hidden = model.activations(tokens, key=key)
    targets = hax.roll(tokens, -1, "position")
    weights = mask.astype(jnp.float32) * _not_last(tokens)
    return hax.sum(token_log_probs(model, hidden, targets) * weights, "position")


def token_log_probs(model, hidden: NamedArray, targets: NamedArray) -> NamedArray:
    """``log softmax(hidden @ head)[target]`` at each position (float32, soft-capped logits
    where the model caps them), with the axes of ``targets``: computed in blocks of positions
    (the model's ``cross_entropy_block_size``, as its loss is), differentiable."""
    h, head, (t,), block, cap = loss_inputs(model, hidden, targets)
    Rows = hidden.rearrange((..., "position", "embed")).axes[:-1]
    found = blocked_log_probs(h, head, t, block=block, cap=cap)
    return hax.named(found.reshape(tuple(ax.size for ax in Rows)), Rows).rearrange(targets.axes)


def blocked_log_probs(hidden, head, targets, *, block: int | None = None, cap: float | None = None):
    """``log softmax(hidden @ head)[targets]``, ``[rows, positions]`` float32, from plain arrays
    ``hidden [rows, positions, embed]``, ``head [embed, vocab]`` and ``targets [rows, positions]``,
    ``block`` positions at a time (None: all at once). Each block's logits are recomputed for the
    backward pass (``jax.checkpoint``) rather than kept, so a step holds one block of them."""
    rows, positions = targets.shape
    per = positions if block is None else max(1, min(block, positions))
    count = -(-positions // per)
    pad = count * per - positions
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(rows, count, per, hidden.shape[-1]).swapaxes(0, 1)
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, count, per).swapaxes(0, 1)

    @jax.checkpoint
    def one_block(xs):
        h_block, t_block = xs
        logits = soft_cap(jnp.dot(h_block, head, preferred_element_type=jnp.float32), cap)
        chosen = jnp.take_along_axis(logits, t_block[..., None], axis=-1)[..., 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1)

    found = jax.lax.map(one_block, (h, t))  # [blocks, rows, per]
    return found.swapaxes(0, 1).reshape(rows, count * per)[:, :positions]


ROUNDING = 1e-6
"""How far apart, relative to the summed log-probabilities, two computations of the same
rewards may round (float32 sums of many tokens' log-probabilities, in two passes)."""


def ranked_right(s: PairScores) -> NamedArray:
    """1.0 for each pair whose chosen answer has the higher reward, strictly: by more than the
    rounding of the log-probabilities the rewards come from (``s.rounding``); else 0.0. A policy
    equal to its reference (DPO's first step) ties on every pair, though its forward pass and
    the reference's may round differently, and a tie is not a win."""
    return (s.rewards_chosen - s.rewards_rejected > s.rounding).astype(jnp.float32)


def scored_tokens(tokens: NamedArray, masks: NamedArray) -> NamedArray:
    """How many tokens of each sequence are scored (float32, the position axis dropped): the
    mask's, less the last position, which predicts nothing."""
    return hax.sum(masks * _not_last(tokens), "position")


def stacked_sides(example: PreferenceExample) -> tuple[NamedArray, NamedArray]:
    """The example's chosen and rejected token ids, and their masks (float32), stacked on a
    ``side`` axis that comes after the batch axis: flattened into the rows of the blockwise
    log-probabilities, each device's rows stay its own (a pair's two sides side by side)."""
    tokens = hax.stack(SIDE, [example.chosen, example.rejected]).rearrange((..., SIDE, "position"))
    masks = hax.stack(SIDE, [example.chosen_mask, example.rejected_mask]).rearrange((..., SIDE, "position"))
    return tokens, masks.astype(jnp.float32)


def comparable_pairs(tokens: NamedArray, masks: NamedArray) -> NamedArray:
    """1.0 for each pair with a scored token on both sides (float32, the side and position axes
    dropped), else 0.0."""
    return hax.all(scored_tokens(tokens, masks) > 0, axis=SIDE).astype(jnp.float32)


def _not_last(tokens: NamedArray) -> NamedArray:
    """1.0 at every position but the last (which has no next token to predict)."""
    Pos = tokens.resolve_axis("position")
    return (hax.arange(Pos) < Pos.size - 1).astype(jnp.float32)
