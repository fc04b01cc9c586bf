"""The distill loss against the formula computed independently in numpy, on a tiny GPT-2
student and a larger GPT-2 teacher of the same vocabulary: full vocabulary and top-k, several
temperatures and weights, with a loss mask."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest
from haliax import Axis

from levanter_core.config.train import TrainConfig
from levanter_core.models.lm import LmExample
from levanter_core.testing import tiny_model
from levanter_distill.objective import DistillObjective

Vocab = Axis("vocab", 257)
Batch, Pos = Axis("batch", 3), Axis("position", 16)


def build(key: int, **fields):
    config = TrainConfig.model_validate({"model": tiny_model(**fields), "data": {"tokenizer": "byte"}}).model
    # one compiled program rather than a small one for each of the initialization's ops
    return eqx.filter_jit(lambda: config.build(Vocab, key=jax.random.PRNGKey(key)))()


@pytest.fixture(scope="module")
def models():
    return build(0), build(1, hidden_dim=64, num_layers=2, num_heads=4)


@pytest.fixture(scope="module")
def batch(models):
    """One batch with a loss mask, and the student's and the teacher's logits from their own
    forward pass (their __call__), as numpy: the same for every setting, so computed once."""
    student, teacher = models
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (Batch.size, Pos.size)).astype(np.int32)
    mask = (rng.random((Batch.size, Pos.size)) < 0.7).astype(np.float32)
    example = LmExample(hax.named(tokens, (Batch, Pos)), hax.named(mask, (Batch, Pos)))
    logits = eqx.filter_jit(lambda m: m(example.tokens).rearrange((Batch, Pos, Vocab)).array)
    return example, tokens, mask, np.asarray(logits(student)), np.asarray(logits(teacher))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def expected(student: np.ndarray, teacher: np.ndarray, tokens: np.ndarray, mask: np.ndarray, T, alpha, top_k):
    """``alpha T^2 KL(p_T || q_T) + (1 - alpha) CE``, means over the predicting positions."""
    weights = mask.astype(np.float64).copy()
    weights[:, -1] = 0  # the last position predicts nothing
    t = teacher.astype(np.float64) / T
    if top_k is not None:
        kth = np.sort(t, axis=-1)[..., -top_k][..., None]
        t = np.where(t >= kth, t, -np.inf)
    p = np.exp(log_softmax(t))
    log_q = log_softmax(student.astype(np.float64) / T)
    with np.errstate(invalid="ignore", divide="ignore"):
        kl = np.where(p > 0, p * (np.log(p) - log_q), 0.0).sum(-1)
    targets = np.roll(tokens, -1, axis=1)
    ce = -np.take_along_axis(log_softmax(student.astype(np.float64)), targets[..., None], axis=-1)[..., 0]
    n = weights.sum()
    kl, ce = (kl * weights).sum() / n, (ce * weights).sum() / n
    return alpha * T**2 * kl + (1 - alpha) * ce, kl, ce


@pytest.mark.parametrize(
    ("temperature", "alpha", "top_k"), [(1.0, 1.0, None), (2.0, 0.5, None), (0.7, 0.3, 5), (3.0, 0.9, 1)]
)
def test_the_loss_is_the_formula(models, batch, temperature, alpha, top_k):
    student, teacher = models
    example, tokens, mask, s, t = batch
    objective = DistillObjective(teacher="unused", temperature=temperature, alpha=alpha, top_k=top_k)
    # compiled: op by op, the forward passes' many small programs cost more than one compile per setting
    loss, metrics = eqx.filter_jit(lambda m, e, r: objective.loss(m, e, key=None, reference=r))(
        student, example, teacher
    )

    # logits from the models' own forward pass (their __call__), then numpy from there
    want, kl, ce = expected(s, t, tokens, mask, temperature, alpha, top_k)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert float(metrics["distill/kl"]) == pytest.approx(kl, rel=1e-5, abs=1e-6)
    assert float(metrics["distill/ce"]) == pytest.approx(ce, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("temperature", "alpha", "top_k"), [(1.0, 1.0, None), (0.7, 0.3, 5)])
def test_the_teacher_gets_no_gradient(models, batch, temperature, alpha, top_k):
    """Its logits are cut off the gradient where they are computed, before the temperature and
    top-k act on them: shown with the whole vocabulary, all weight on the KL term (where the
    teacher moves the loss most), and with top-k. (A backward pass, compiled for each setting:
    for these two, not for all four of the formula's.)"""
    student, teacher = models
    example = batch[0]
    objective = DistillObjective(teacher="unused", temperature=temperature, alpha=alpha, top_k=top_k)
    grads = eqx.filter_jit(jax.grad(lambda m: objective.loss(student, example, key=None, reference=m)[0]))(teacher)
    assert all(float(np.abs(g).max()) == 0 for g in jax.tree.leaves(grads))


def test_evaluation_is_the_students_own_next_token_loss(models):
    from levanter_core.models.lm import lm_eval_loss

    student, teacher = models
    tokens = hax.named(np.random.default_rng(1).integers(0, 256, (Batch.size, Pos.size)).astype(np.int32), (Batch, Pos))
    objective = DistillObjective(teacher="unused", temperature=2.0, alpha=0.5)
    both = eqx.filter_jit(lambda m, r, e: (objective.eval_loss(m, e, reference=r), lm_eval_loss(m, e)))
    got, want = both(student, teacher, LmExample(tokens))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
