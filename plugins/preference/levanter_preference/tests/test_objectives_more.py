"""SimPO, IPO and ORPO: on one batch of pairs, each loss (and ORPO's gradient of a weight)
equals its paper's formula computed independently in PyTorch, float64, from Hugging Face Llamas'
logits; a few steps of ``levanter train`` with each train (finite losses that fall, DPO's
metrics logged); bad settings are refused naming the field."""

from __future__ import annotations

import json
import math
import shutil

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter_core.config.train import load_train_config
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.errors import ConfigError
from levanter_core.hf.bridge import load_hf_model
from levanter_core.run import run_training
from levanter_core.testing import write_jsonl
from levanter_preference.tests.conftest import PAIRS, preference_batch
from levanter_preference.tests.test_objective import placed
from levanter_preference.tests.test_training import evaluations, parity_pairs, run_config
from levanter_preference.variants import IpoObjective, OrpoObjective, SimpoObjective, log1m_exp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

SEQ_LEN = 96


@pytest.fixture(scope="module")
def models(llamas):
    return tuple(load_hf_model(directory).model for directory in llamas)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return preference_batch(tmp_path_factory.mktemp("pairs"), PAIRS, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def torch_llamas(llamas) -> tuple:
    """The two Llamas in PyTorch, float64, loaded once for the module's formulas."""
    return tuple(
        transformers.AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager", dtype=torch.float64
        ).eval()
        for directory in llamas
    )


def torch_log_probs(model, batch) -> dict[str, tuple]:
    """Each side's summed log-probabilities of its scored tokens and how many there are, per
    pair, float64: log-softmax of the model's logits, the next token's gathered, masked."""
    sides = {"chosen": (batch.tokens, batch.fields["chosen_mask"]),
             "rejected": (batch.fields["rejected_ids"], batch.fields["rejected_mask"])}  # fmt: skip
    found = {}
    for side, (ids, mask) in sides.items():
        ids = torch.as_tensor(ids, dtype=torch.long)
        weights = torch.as_tensor(mask, dtype=torch.float64)[:, :-1]
        per_token = torch.log_softmax(model(ids).logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        found[side] = ((per_token * weights).sum(-1), weights.sum(-1))
    return found


@eqx.filter_jit
def jax_loss(objective, policy, example, reference=None):
    """``objective.loss`` (the loss and its metrics), compiled (once per objective and shapes)."""
    extra = {} if reference is None else {"reference": reference}
    return objective.loss(policy, example, key=None, **extra)


@eqx.filter_jit
def jax_loss_and_grad(objective, policy, example):
    """``objective.loss`` and its gradient with respect to the policy, compiled: only where the
    gradient is checked (a backward pass about doubles what is compiled)."""
    return eqx.filter_value_and_grad(lambda p: objective.loss(p, example, key=None), has_aux=True)(policy)


def test_the_simpo_loss_equals_levanters_formula(torch_llamas, models, batch):
    objective = SimpoObjective()  # beta 2.0, gamma_beta_ratio 0.5
    loss, metrics = jax_loss(objective, models[0], placed(objective, batch))

    with torch.no_grad():
        pi = torch_log_probs(torch_llamas[0], batch)
    avg = {side: total / count for side, (total, count) in pi.items()}
    expected = F.softplus(-2.0 * ((avg["chosen"] - avg["rejected"]) - 0.5)).mean()  # train_simpo's loss

    assert float(loss) == pytest.approx(expected.item(), abs=1e-5)
    assert float(metrics["dpo/margin"]) == pytest.approx(
        (2.0 * (avg["chosen"] - avg["rejected"])).mean().item(), abs=1e-5
    )
    accuracy = (avg["chosen"] > avg["rejected"]).double().mean().item()
    assert 0 < accuracy < 1 and float(metrics["dpo/accuracy"]) == accuracy


def test_the_ipo_loss_equals_the_papers_formula(torch_llamas, models, batch):
    tau = 0.5
    objective = IpoObjective(beta=tau)
    example = placed(objective, batch)
    loss, metrics = jax_loss(objective, models[0], example, reference=models[1])

    with torch.no_grad():
        pi, ref = (torch_log_probs(model, batch) for model in torch_llamas)
    ratio = {side: pi[side][0] - ref[side][0] for side in pi}
    h = ratio["chosen"] - ratio["rejected"]  # of summed log-probabilities, as in the paper
    expected = ((h - 1 / (2 * tau)) ** 2).mean()

    # the margins agree to 1e-5; their squares (about 35 here) to 1e-5 relative (float32)
    assert float(metrics["dpo/margin"]) == pytest.approx((tau * h).mean().item(), abs=1e-5)
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)

    # a policy equal to its reference: every margin 0, the loss 1 / (4 tau^2)
    loss, metrics = jax_loss(objective, models[0], example, reference=models[0])
    assert float(loss) == pytest.approx(1 / (4 * tau**2), abs=1e-4) and float(metrics["dpo/accuracy"]) == 0


def test_the_orpo_loss_and_its_gradient_equal_the_papers_formula(torch_llamas, models, batch):
    lam = 0.1
    objective = OrpoObjective(beta=lam)
    (loss, metrics), grads = jax_loss_and_grad(objective, models[0], placed(objective, batch))

    policy = torch_llamas[0]
    policy.zero_grad(set_to_none=True)  # the module's model: only this gradient
    pi = torch_log_probs(policy, batch)
    avg = {side: total / count for side, (total, count) in pi.items()}
    log_odds = {side: a - torch.log1p(-torch.exp(a)) for side, a in avg.items()}
    ratio = log_odds["chosen"] - log_odds["rejected"]
    expected = (-avg["chosen"] - lam * F.logsigmoid(ratio)).mean()
    expected.backward()

    assert float(loss) == pytest.approx(expected.item(), abs=1e-5)
    assert float(metrics["orpo/nll"]) == pytest.approx(-avg["chosen"].mean().item(), abs=1e-5)
    assert float(metrics["orpo/log_odds_ratio"]) == pytest.approx(ratio.mean().item(), abs=1e-5)
    found = np.asarray(grads.model.norm.weight.array)
    np.testing.assert_allclose(found, policy.model.norm.weight.grad.numpy(), atol=1e-5)
    assert np.abs(found).max() > 1e-3  # the weight does move the loss


def test_log1m_exp_is_accurate_near_zero_and_far_from_it():
    x = np.array([-1e-6, -1e-3, -0.5, -0.7, -1.0, -20.0])
    found = np.asarray(log1m_exp(hax.named(jnp.asarray(x, jnp.float32), "x")).array)
    np.testing.assert_allclose(found, [math.log(-math.expm1(v)) for v in x], rtol=1e-5)


# -- a few steps of training -------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> tuple[str, str]:
    """64 training pairs and 16 held-out ones (``Is N even?``)."""
    directory = tmp_path_factory.mktemp("parity")
    numbers = np.random.default_rng(0).permutation(np.arange(100, 1000))
    return (write_jsonl(directory / "train.jsonl", parity_pairs(numbers[:64])),
            write_jsonl(directory / "validation.jsonl", parity_pairs(numbers[64:80])))  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(llamas, tmp_path_factory) -> str:
    """A copy of the session's first random Llama, with the byte tokenizer's ``tokenizer.json``."""
    directory = tmp_path_factory.mktemp("llama") / "model"
    shutil.copytree(llamas[0], directory)
    (directory / "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    return str(directory)


@pytest.mark.parametrize(
    "objective",
    [{"type": "simpo", "beta": 2.0, "gamma_beta_ratio": 0.5}, {"type": "ipo", "beta": 0.1}, {"type": "orpo"}],
    ids=["simpo", "ipo", "orpo"],
)
def test_a_few_steps_train_with_the_objective(tmp_path, parity, llama_dir, objective):
    steps = 6
    path = run_config(tmp_path, parity, llama_dir, steps=steps, objective=objective)
    config, _ = load_train_config(path, ["--trainer.train_batch_size", "8", "--trainer.max_eval_batches", "1"])
    run_training(config, progress=False)

    lines = [json.loads(line) for line in (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in lines if "train/loss" in m]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert {"dpo/accuracy", "dpo/margin", "dpo/rewards_chosen"} <= next(m for m in lines if "dpo/accuracy" in m).keys()
    start, end = (evaluations(tmp_path)[step] for step in (0, steps))
    assert end["eval/loss"] < start["eval/loss"], (start, end)
    assert 0 <= end["eval/dpo_accuracy"] <= 1


# -- settings ----------------------------------------------------------------------------------


def test_bad_settings_are_refused_naming_the_field(tmp_path, parity, llama_dir):
    config = run_config(tmp_path, parity, llama_dir, steps=2)
    for objective, field in (({"type": "simpo", "gamma_beta_ratio": -1}, "gamma_beta_ratio"),
                             ({"type": "simpo", "beta": 0}, "beta"),
                             ({"type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
                             ({"type": "orpo", "lambda": 0.2}, "lambda")):  # fmt: skip
        with pytest.raises(ConfigError) as raised:
            load_train_config(config, ["--objective", json.dumps(objective)])
        assert "objective" in str(raised.value) and field in str(raised.value), objective

    loaded, _ = load_train_config(config, ["--objective", '{"type": "simpo", "beta": 2.5}'])
    simpo = SimpoObjective.from_config(loaded)
    assert (simpo.beta, simpo.gamma_beta_ratio, simpo.label_smoothing) == (2.5, 0.5, 0.0)
    with pytest.raises(ConfigError, match=r"data\.format: the orpo objective reads preference pairs"):
        load_train_config(config, ["--objective", "orpo", "--data.format", '{"type": "text"}'])
