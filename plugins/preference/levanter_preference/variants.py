"""SimPO, IPO and ORPO: preference objectives beside DPO (``objective: {type: simpo, ...}``).

Each reads the same pairs as DPO (the ``preference`` format), logs the same metrics under the
same names and is evaluated the same way (:class:`~levanter_preference.objective.PairObjective`);
what differs is the loss of a pair and whether a reference model is kept. Two log-probabilities
of an answer ``y`` appear below: ``log pi(y)``, the *sum* of the log-probabilities of its scored
tokens (DPO's), and ``avg log pi(y)``, their *mean* (the sum over the number of scored tokens).

* **SimPO** (Meng et al., 2024, "SimPO: Simple Preference Optimization with a Reference-Free
  Reward"): no reference; the reward is ``beta * avg log pi(y)`` and the loss the sigmoid loss
  of the reward margin less a target margin ``gamma = beta * gamma_beta_ratio``.
* **IPO** (Azar et al., 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences"): DPO's log-ratio margin regressed onto ``1 / (2 tau)`` by a squared loss.
* **ORPO** (Hong et al., 2024, "ORPO: Monolithic Preference Optimization without Reference
  Model"): no reference; the chosen answer's negative log-likelihood plus ``lambda`` times the
  sigmoid loss of the log odds ratio of the two answers.
"""

from __future__ import annotations

import math

import haliax as hax
from haliax import NamedArray
from pydantic import Field

from levanter_core.config.base import ConfigModel
from levanter_preference.objective import (
    ROUNDING,
    SIDE,
    PairObjective,
    PairScores,
    PreferenceExample,
    comparable_pairs,
    policy_and_reference,
    scored_tokens,
    sequence_log_probs,
    smoothed_sigmoid_loss,
    stacked_sides,
)

# -- SimPO -------------------------------------------------------------------------------------


class SimpoOptions(ConfigModel):
    """The settings of ``objective: {type: simpo, ...}`` (the defaults: Levanter's ``train_simpo``)."""

    beta: float = Field(2.0, gt=0)
    """The scale of the rewards ``beta * avg log pi(y)``; the SimPO paper uses 2 to 10."""

    gamma_beta_ratio: float = Field(0.5, ge=0)
    """The target reward margin ``gamma`` over ``beta``: the loss keeps pushing until the chosen
    answer's mean log-probability exceeds the rejected one's by about this much. 0: none."""

    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The probability that a pair's preference is the wrong way round, as DPO's:
    ``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``. 0: plain SimPO."""


class SimpoObjective(PairObjective):
    """The ``simpo`` objective, reference-free. With ``avg log pi(y)`` the mean log-probability
    of an answer's scored tokens, the loss of a pair is

        -(1 - ls) log sigmoid(z) - ls log sigmoid(-z)
        z = beta * (avg log pi(chosen) - avg log pi(rejected)) - beta * gamma_beta_ratio

    (with ``ls = 0``, ``softplus(-beta * ((avg_c - avg_r) - gamma_beta_ratio))``, Levanter's
    ``train_simpo``); defaults ``beta = 2.0``, ``gamma_beta_ratio = 0.5``, ``ls = 0``. Rewards
    (``dpo/rewards_chosen``, ``dpo/rewards_rejected``) are ``beta * avg log pi``, so
    ``dpo/margin`` is ``beta`` times the difference of the mean log-probabilities and
    ``dpo/accuracy`` the share of pairs whose chosen answer has the higher mean log-probability
    (not the share past the target margin)."""

    name = "simpo"
    options = SimpoOptions

    def __init__(self, *, beta: float = 2.0, gamma_beta_ratio: float = 0.5, label_smoothing: float = 0.0):
        settings = SimpoOptions(beta=beta, gamma_beta_ratio=gamma_beta_ratio, label_smoothing=label_smoothing)
        self.beta = settings.beta
        self.gamma_beta_ratio = settings.gamma_beta_ratio
        self.label_smoothing = settings.label_smoothing

    def scores(self, model, example: PreferenceExample, reference=None, *, key=None) -> PairScores:
        tokens, masks = stacked_sides(example)
        policy = sequence_log_probs(model, tokens, masks, key=key)
        means = mean_log_probs(policy, tokens, masks)
        rewards = self.beta * means
        z = rewards[SIDE, 0] - rewards[SIDE, 1] - self.beta * self.gamma_beta_ratio
        return PairScores.of_sides(
            losses=smoothed_sigmoid_loss(z, self.label_smoothing),
            rewards=rewards,
            policy=policy,
            counted=comparable_pairs(tokens, masks),
            rounding=self.beta * ROUNDING * hax.sum(hax.abs(means), SIDE),
        )


# -- IPO ---------------------------------------------------------------------------------------


class IpoOptions(ConfigModel):
    """The settings of ``objective: {type: ipo, ...}``."""

    beta: float = Field(0.1, gt=0)
    """The IPO paper's regularization ``tau``: the loss pulls the log-ratio margin towards
    ``1 / (2 tau)`` (5 at the default 0.1); larger values keep the policy closer to the
    reference."""


class IpoObjective(PairObjective):
    """The ``ipo`` objective: against a frozen reference model, as DPO. With ``h`` the margin of
    DPO's log-ratios of the *summed* log-probabilities (the paper's ``h_pi(y_w, y_l, x)``,
    sequence log-probabilities),

        h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))

    the loss of a pair is ``(h - 1 / (2 tau))^2`` (the paper's equation 17), ``tau`` the
    ``beta`` setting (default 0.1). TRL's ``loss_type: ipo`` divides each log-probability by its
    answer's length first, which changes the scale ``h`` is compared with ``1 / (2 tau)`` on;
    this is the paper's. Rewards are DPO's, ``beta * (log pi - log ref)``; at the first step
    (the policy its reference) every margin is 0, the accuracy 0 and the loss
    ``1 / (4 tau^2)``."""

    name = "ipo"
    keeps_reference = True
    options = IpoOptions
    flops_scale = 4 / 3  # the policy's forward and backward, and the reference's forward

    def __init__(self, *, beta: float = 0.1):
        self.beta = IpoOptions(beta=beta).beta

    def scores(self, model, example: PreferenceExample, reference, *, key=None) -> PairScores:
        tokens, masks = stacked_sides(example)
        policy, ref = policy_and_reference(self.name, model, reference, tokens, masks, key=key)
        ratios = policy - ref
        h = ratios[SIDE, 0] - ratios[SIDE, 1]
        return PairScores.of_sides(
            losses=hax.square(h - 1 / (2 * self.beta)),
            rewards=self.beta * ratios,
            policy=policy,
            counted=comparable_pairs(tokens, masks),
            rounding=self.beta * ROUNDING * hax.sum(hax.abs(policy) + hax.abs(ref), SIDE),
        )


# -- ORPO --------------------------------------------------------------------------------------


class OrpoOptions(ConfigModel):
    """The settings of ``objective: {type: orpo, ...}``."""

    beta: float = Field(0.1, gt=0)
    """The ORPO paper's ``lambda``: the weight of the odds-ratio term beside the chosen answer's
    negative log-likelihood (0.1 in the paper, as in TRL's ``ORPOConfig.beta``)."""


CERTAIN = 1e-6
"""How close to 0 ORPO lets a mean log-probability come (an answer the model is sure of), so
that its log odds stay finite: at most ``log(1 / CERTAIN)``, about 13.8."""


class OrpoObjective(PairObjective):
    """The ``orpo`` objective, reference-free. With ``p(y) = exp(avg log pi(y))`` (the geometric
    mean of the answer's token probabilities) and ``log odds(y) = log(p / (1 - p))``, the loss of
    a pair is

        -avg log pi(chosen) - lambda * log sigmoid(log odds(chosen) - log odds(rejected))

    the chosen answer's negative log-likelihood per token plus ``lambda`` (the ``beta``
    setting, default 0.1) times the odds-ratio loss. ``log(1 - p)`` is computed stably
    (:func:`log1m_exp`), a mean log-probability above ``-CERTAIN`` taken as ``-CERTAIN``. TRL
    averages the likelihood term over the batch's chosen tokens; here each pair's is its own
    mean, the batch's loss the mean over pairs. Rewards are ``lambda * avg log pi`` (as TRL's);
    ``orpo/nll`` (the first term) and ``orpo/log_odds_ratio`` are logged besides."""

    name = "orpo"
    options = OrpoOptions

    def __init__(self, *, beta: float = 0.1):
        self.beta = OrpoOptions(beta=beta).beta

    def scores(self, model, example: PreferenceExample, reference=None, *, key=None) -> PairScores:
        tokens, masks = stacked_sides(example)
        policy = sequence_log_probs(model, tokens, masks, key=key)
        means = mean_log_probs(policy, tokens, masks)
        bounded = hax.minimum(means, -CERTAIN)
        log_odds = bounded - log1m_exp(bounded)
        ratio = log_odds[SIDE, 0] - log_odds[SIDE, 1]
        nll = -means[SIDE, 0]
        rewards = self.beta * means
        return PairScores.of_sides(
            losses=nll - self.beta * hax.nn.log_sigmoid(ratio),
            rewards=rewards,
            policy=policy,
            counted=comparable_pairs(tokens, masks),
            rounding=self.beta * ROUNDING * hax.sum(hax.abs(means), SIDE),
            extra={"nll": nll, "log_odds_ratio": ratio},
        )


# -- helpers -----------------------------------------------------------------------------------


def mean_log_probs(sums: NamedArray, tokens: NamedArray, masks: NamedArray) -> NamedArray:
    """Summed log-probabilities (:func:`~levanter_preference.objective.sequence_log_probs`) over
    the number of tokens they sum: the mean per scored token (0 for a sequence with none)."""
    return sums / hax.maximum(scored_tokens(tokens, masks), 1.0)


def log1m_exp(x: NamedArray) -> NamedArray:
    """``log(1 - exp(x))`` for ``x < 0``, accurate over the whole range: ``log(-expm1(x))`` near
    0, where ``1 - exp(x)`` loses its digits, and ``log1p(-exp(x))`` further out, where
    ``exp(x)`` is small (Mächler, 2012, "Accurately Computing log(1 - exp(-|a|))")."""
    return hax.where(x > -math.log(2), hax.log(-hax.expm1(x)), hax.log1p(-hax.exp(x)))
