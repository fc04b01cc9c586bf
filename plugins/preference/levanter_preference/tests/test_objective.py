"""The ``dpo`` objective on one batch: its loss and metrics equal the DPO formula computed
independently in PyTorch from Hugging Face Llamas' logits, the gradient reaches the policy and
never the reference, and the blockwise log-probabilities equal the plain ones, gradients too."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter_preference.objective import DpoObjective, blocked_log_probs
from levanter_preference.tests.conftest import PAIRS, preference_batch

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SEQ_LEN = 96


def placed(objective, batch):
    """The objective's example of a host batch, as the trainer makes it (on one device)."""
    arrays = {
        name: hax.named(jnp.asarray(np.asarray(field.values, field.dtype)), ("batch", *field.axes))
        for name, field in objective.fields(batch).items()
    }
    return objective.example(arrays)


OBJECTIVES: dict[tuple[float, float], DpoObjective] = {}


def dpo(beta: float = 0.1, label_smoothing: float = 0.0) -> DpoObjective:
    """One objective of each setting for the module: ``dpo_loss`` is compiled for each objective
    (it is a static argument, hashed by identity), so the tests that share a setting and shapes
    share one program instead of tracing and compiling it again."""
    if (beta, label_smoothing) not in OBJECTIVES:
        OBJECTIVES[beta, label_smoothing] = DpoObjective(beta=beta, label_smoothing=label_smoothing)
    return OBJECTIVES[beta, label_smoothing]


@eqx.filter_jit
def dpo_loss(objective, policy, reference, example):
    """``objective.loss`` on the example, compiled (op by op, it takes seconds)."""
    return objective.loss(policy, example, key=None, reference=reference)


@pytest.fixture(scope="module")
def models(llamas):
    from levanter_core.hf.bridge import load_hf_model

    return tuple(load_hf_model(directory).model for directory in llamas)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return preference_batch(tmp_path_factory.mktemp("pairs"), PAIRS, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def torch_log_probs(llamas, batch) -> tuple[dict, dict]:
    """The policy's and the reference's summed log-probabilities of each side of ``batch``, from
    the Hugging Face models' own logits: log-softmax, the next token's log-probability gathered,
    summed where the masks score it (float64 from the logits on). Computed once for the module:
    they do not depend on beta or the label smoothing."""
    import transformers

    ids = {"chosen": torch.as_tensor(batch.tokens, dtype=torch.long),
           "rejected": torch.as_tensor(batch.fields["rejected_ids"], dtype=torch.long)}  # fmt: skip
    masks = {"chosen": torch.as_tensor(batch.fields["chosen_mask"], dtype=torch.float64),
             "rejected": torch.as_tensor(batch.fields["rejected_mask"], dtype=torch.float64)}  # fmt: skip

    def log_probs(directory):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
        out = {}
        for side in ("chosen", "rejected"):
            with torch.no_grad():
                logits = model(ids[side]).logits.double()
            per_token = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[side][:, 1:, None])[..., 0]
            out[side] = (per_token * masks[side][:, :-1]).sum(-1)
        return out

    return log_probs(llamas[0]), log_probs(llamas[1])


def torch_dpo(log_probs: tuple[dict, dict], beta: float, label_smoothing: float) -> dict:
    """The DPO loss and its statistics, in PyTorch, from the policy's and the reference's
    log-probabilities (``torch_log_probs``)."""
    pi, ref = log_probs
    chosen_rewards = beta * (pi["chosen"] - ref["chosen"])
    rejected_rewards = beta * (pi["rejected"] - ref["rejected"])
    m = chosen_rewards - rejected_rewards
    losses = -(1 - label_smoothing) * torch.nn.functional.logsigmoid(
        m
    ) - label_smoothing * torch.nn.functional.logsigmoid(-m)
    return {
        "loss": losses.mean().item(),
        "dpo/rewards_chosen": chosen_rewards.mean().item(),
        "dpo/rewards_rejected": rejected_rewards.mean().item(),
        "dpo/margin": m.mean().item(),
        "dpo/accuracy": (chosen_rewards > rejected_rewards).double().mean().item(),
        "dpo/logps_chosen": pi["chosen"].mean().item(),
        "dpo/logps_rejected": pi["rejected"].mean().item(),
    }


@pytest.mark.parametrize(("beta", "label_smoothing"), [(0.1, 0.0), (0.5, 0.2)])
def test_the_dpo_loss_equals_the_formula_computed_in_torch(torch_log_probs, models, batch, beta, label_smoothing):
    policy, reference = models
    objective = dpo(beta, label_smoothing)

    loss, metrics = dpo_loss(objective, policy, reference, placed(objective, batch))

    expected = torch_dpo(torch_log_probs, beta, label_smoothing)
    found = {"loss": float(loss), **{name: float(value) for name, value in metrics.items()}}
    assert found.keys() == expected.keys()
    assert 0 < expected["dpo/accuracy"] < 1 and abs(expected["dpo/margin"]) > 0.01  # the models disagree
    for name in ("loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy"):
        assert found[name] == pytest.approx(expected[name], abs=1e-5), name
    for name in ("dpo/logps_chosen", "dpo/logps_rejected"):  # sums of ~20 log-probabilities of ~-6 each
        assert found[name] == pytest.approx(expected[name], abs=1e-4), name


def test_evaluation_sums_what_the_loss_averages(models, batch):
    policy, reference = models
    objective = dpo()
    example = placed(objective, batch)

    loss, metrics = dpo_loss(objective, policy, reference, example)
    evaluate = eqx.filter_jit(  # both evaluations in one compiled program
        lambda p, e, r: (objective.eval_totals(p, e, reference=r), objective.eval_loss(p, e, reference=r))
    )
    totals, eval_loss = evaluate(policy, example, reference)
    totals = np.asarray(totals)

    assert totals[1] == len(PAIRS)
    assert totals[0] / totals[1] == pytest.approx(float(loss), abs=1e-6)
    assert float(eval_loss) == pytest.approx(float(loss), abs=1e-6)
    assert totals[2] / totals[1] == pytest.approx(float(metrics["dpo/accuracy"]))
    assert totals[3] / totals[1] == pytest.approx(float(metrics["dpo/margin"]), abs=1e-6)
    reported = objective.eval_metrics({"a": totals, "b": totals / 2}, {"mine": ["b"]}, per_set=True)
    assert reported["eval/loss"] == pytest.approx(totals[0] / totals[1])
    assert reported["eval/dpo_accuracy"] == reported["eval/b/dpo_accuracy"] == pytest.approx(totals[2] / totals[1])
    assert reported["eval/mine/dpo_margin"] == pytest.approx(totals[3] / totals[1])


def test_a_policy_equal_to_its_reference_starts_at_log_2(models, batch):
    policy, _ = models
    objective = dpo()
    loss, metrics = dpo_loss(objective, policy, policy, placed(objective, batch))
    assert float(loss) == pytest.approx(np.log(2), abs=1e-6)
    assert float(metrics["dpo/margin"]) == 0 and float(metrics["dpo/accuracy"]) == 0  # ties are not wins


def test_a_reference_equal_up_to_rounding_ties_and_a_tie_is_no_win(models, batch):
    """At the first step the policy is its reference, but their forward passes may round
    differently (another fusion, another device): a difference of rounding is a tie, not a win."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    policy, _ = models
    # the same weights but for the last bit: log-probabilities that differ by rounding only
    nudged = jax.tree.map(lambda x: jnp.nextafter(x, jnp.inf) if eqx.is_inexact_array(x) else x, policy)
    objective = dpo()
    loss, metrics = dpo_loss(objective, nudged, policy, placed(objective, batch))
    assert abs(float(metrics["dpo/margin"])) < 1e-4 and float(loss) == pytest.approx(np.log(2), abs=1e-4)
    assert float(metrics["dpo/accuracy"]) == 0


def test_a_pair_with_nothing_scored_on_a_side_is_left_out(models, batch):
    policy, reference = models
    objective = dpo()
    cut = {**batch.fields, "rejected_mask": batch.fields["rejected_mask"].copy()}
    cut["rejected_mask"][1] = 0  # its answer was cut off by seq_len, say
    damaged = placed(objective, type(batch)(batch.tokens, fields=cut))
    kept = [0, 2, 3]
    rest = placed(objective, type(batch)(batch.tokens[kept], fields={k: v[kept] for k, v in batch.fields.items()}))

    assert float(objective.data_points(damaged)) == 3
    found = dpo_loss(objective, policy, reference, damaged)
    expected = dpo_loss(objective, policy, reference, rest)
    assert float(found[0]) == pytest.approx(float(expected[0]), abs=1e-6)
    assert float(found[1]["dpo/margin"]) == pytest.approx(float(expected[1]["dpo/margin"]), abs=1e-6)


def test_the_gradient_reaches_the_policy_and_never_the_reference(models, batch):
    policy, reference = models
    objective = dpo()
    example = placed(objective, batch)

    # one backward pass with respect to both models (one program, one forward pass), rather than
    # one gradient of each: the loss's derivative in each model's weights is its part of it
    @eqx.filter_jit
    @eqx.filter_grad
    def gradients(models):
        p, r = models
        return objective.loss(p, example, key=None, reference=r)[0]

    to_policy, to_reference = gradients((policy, reference))
    policy_norm = sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(eqx.filter(to_policy, eqx.is_array)))
    reference_leaves = jax.tree.leaves(eqx.filter(to_reference, eqx.is_array))
    assert policy_norm > 1e-6
    assert reference_leaves and all(not np.any(np.asarray(g)) for g in reference_leaves)


def test_blockwise_log_probs_equal_the_plain_ones_with_their_gradients():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(keys[0], (3, 13, 8))
    head = jax.random.normal(keys[1], (8, 40))
    targets = jax.random.randint(keys[2], (3, 13), 0, 40)
    weights = (jnp.arange(13) % 3 != 0).astype(jnp.float32)

    def plain(h, w):
        return jnp.take_along_axis(jax.nn.log_softmax(h @ w, axis=-1), targets[..., None], axis=-1)[..., 0]

    def values_and_grads(log_probs):
        return log_probs(hidden, head), jax.grad(lambda h, w: jnp.sum(log_probs(h, w) * weights), argnums=(0, 1))(
            hidden, head
        )

    blocks = (None, 1, 4)  # one block, one position each, blocks that leave a partial one

    @jax.jit
    def everything():
        """The plain values and gradients, and each blocking's: one compiled program, not seven."""
        found = [values_and_grads(lambda h, w, b=b: blocked_log_probs(h, w, targets, block=b)) for b in blocks]
        return values_and_grads(plain), found

    (want, expected), found = everything()
    for values, grads in found:
        np.testing.assert_allclose(values, want, atol=1e-5)
        for a, b in zip(grads, expected):
            np.testing.assert_allclose(a, b, atol=1e-5)
