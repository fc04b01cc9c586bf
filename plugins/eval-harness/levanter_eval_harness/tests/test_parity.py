"""Our harness model against lm-eval's own ``hf`` backend (transformers on PyTorch) on the same
tiny random Llama and the same local tasks: every request's log-likelihood, the accuracies, the
generated strings and the perplexities agree."""

from __future__ import annotations

import math

import pytest

from levanter_eval_harness.tests.tiny import GEN_DOCS, MC_DOCS, PPL_DOCS

MAX_LENGTH = 64
"""The context both harnesses are given: shorter than some requests, so that left-truncation
and rolling windows are exercised."""
TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]

pytestmark = pytest.mark.slow  # about 40 s: both harnesses on three tasks, and our compilations


@pytest.fixture(scope="module")
def hf_results(model_dir, manager):
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}",
        tasks=TASKS,
        device="cpu",
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
        task_manager=manager,
    )


@pytest.fixture(scope="module")
def our_results(loaded, model_dir, manager):
    from levanter_eval_harness.harness import HarnessRun, PreparedTasks, evaluate
    from levanter_eval_harness.lm import LevanterLM
    from levanter_eval_harness.tasks import load_tasks

    lm = LevanterLM(loaded.model, loaded.tokenizer, eos_ids=loaded.eos_ids, max_length=MAX_LENGTH, batch_size=4)
    try:
        run = HarnessRun(tasks=TASKS, log_samples=True, bootstrap_iters=0)
        prepared = PreparedTasks(manager, load_tasks(TASKS, manager))
        results = evaluate(lm, run, model_name=model_dir, prepared=prepared)
    finally:
        lm.close()
    return results


def _by_doc(results, task):
    return {s["doc_id"]: s for s in results["samples"][task]}


def test_every_loglikelihood_equals_the_hf_backend(hf_results, our_results):
    theirs, ours = _by_doc(hf_results, "tiny_mc"), _by_doc(our_results, "tiny_mc")
    assert sorted(ours) == sorted(theirs) == list(range(len(MC_DOCS)))
    compared = 0
    for doc_id, sample in theirs.items():
        assert ours[doc_id]["arguments"] == sample["arguments"]  # the same requests
        for (their_ll, their_greedy), (our_ll, our_greedy) in zip(
            (r[0] for r in sample["resps"]), (r[0] for r in ours[doc_id]["resps"])
        ):
            assert abs(float(our_ll) - float(their_ll)) <= 1e-4, (doc_id, our_ll, their_ll)
            assert bool(our_greedy) == bool(their_greedy)
            compared += 1
    assert compared == sum(len(d["choices"]) for d in MC_DOCS)
    for metric in ("acc,none", "acc_norm,none"):
        assert our_results["results"]["tiny_mc"][metric] == hf_results["results"]["tiny_mc"][metric]


def test_generated_strings_equal_the_hf_backend(hf_results, our_results):
    theirs, ours = _by_doc(hf_results, "tiny_gen"), _by_doc(our_results, "tiny_gen")
    assert len(ours) == len(GEN_DOCS)
    for doc_id, sample in theirs.items():
        assert ours[doc_id]["resps"] == sample["resps"], doc_id
        assert ours[doc_id]["arguments"] == sample["arguments"]
    assert any(r[0] for s in ours.values() for r in s["resps"]), "every generation came back empty"
    assert our_results["results"]["tiny_gen"] == hf_results["results"]["tiny_gen"]


def test_rolling_perplexity_equals_the_hf_backend(hf_results, our_results):
    theirs, ours = _by_doc(hf_results, "tiny_ppl"), _by_doc(our_results, "tiny_ppl")
    assert len(ours) == len(PPL_DOCS)
    for doc_id, sample in theirs.items():
        (their_ll,), (our_ll,) = sample["resps"][0], ours[doc_id]["resps"][0]
        assert math.isclose(float(our_ll), float(their_ll), rel_tol=1e-6, abs_tol=1e-4), (doc_id, our_ll, their_ll)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        ours_value = our_results["results"]["tiny_ppl"][metric]
        theirs_value = hf_results["results"]["tiny_ppl"][metric]
        assert math.isclose(ours_value, theirs_value, rel_tol=1e-5), (metric, ours_value, theirs_value)


def test_chat_prompts_with_fewshot_turns_equal_the_hf_backend(loaded, model_dir, manager):
    """With the chat template, few-shot examples as turns: the same prompts, the same scores."""
    import lm_eval

    from levanter_eval_harness.harness import HarnessRun, PreparedTasks, evaluate
    from levanter_eval_harness.lm import LevanterLM
    from levanter_eval_harness.tasks import load_tasks

    settings = dict(num_fewshot=2, limit=4, apply_chat_template=True, fewshot_as_multiturn=True)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}", tasks=["tiny_mc"],
        device="cpu", batch_size=4, log_samples=True, bootstrap_iters=0, task_manager=manager, **settings,
    )  # fmt: skip
    lm = LevanterLM(loaded.model, loaded.tokenizer, max_length=MAX_LENGTH, batch_size=4)
    run = HarnessRun(tasks=["tiny_mc"], log_samples=True, bootstrap_iters=0, **settings)
    ours = evaluate(lm, run, model_name=model_dir, prepared=PreparedTasks(manager, load_tasks(["tiny_mc"], manager)))
    for doc_id, sample in _by_doc(theirs, "tiny_mc").items():
        mine = _by_doc(ours, "tiny_mc")[doc_id]
        assert mine["arguments"] == sample["arguments"]
        assert "<|assistant|>" in sample["arguments"][0][0]  # (context, continuation) of its first choice
        for theirs_resp, our_resp in zip(sample["resps"], mine["resps"]):
            assert abs(float(our_resp[0][0]) - float(theirs_resp[0][0])) <= 1e-4
