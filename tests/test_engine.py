"""The continuous-batching engine: many requests share each decoding step, a request's result
does not depend on what it was batched with, the queue's bound, streaming, and truncation."""

import functools
import operator
import threading

import jax
import jax.numpy as jnp
import pytest
from haliax import Axis

from levanter_core.inference import engine as engine_module
from levanter_core.inference.engine import Engine, RequestError
from levanter_core.inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    from levanter_model_llama.llama import LlamaConfig

    config = LlamaConfig(seq_len=96, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return config.build(Axis("vocab", 61), key=jax.random.PRNGKey(0))


def requests():
    """Twelve requests: prompts of 1 to 23 tokens, budgets of 3 to 25 tokens, greedy and sampled."""
    out = []
    for i in range(12):
        prompt = [(7 * i + j) % 61 for j in range(1 + 2 * i)]
        params = SamplingParams(max_new_tokens=3 + 2 * i, temperature=0.0 if i % 3 == 0 else 0.9, top_k=i % 4 * 5,
                                top_p=1.0 if i % 2 else 0.8, seed=i)  # fmt: skip
        out.append((prompt, params))
    return out


def served_alone(model, work) -> list[list[int]]:
    """Each request's tokens from an engine that serves one at a time, one token per step: the
    reference a batched engine's results must equal. Its engine's settings are the same for every
    test here, so that its compiled programs serve them all."""
    with Engine(model, max_seqs=1, max_rounds=1) as alone:
        return [alone.submit(p, params).result().tokens for p, params in work]


@pytest.fixture(scope="module")
def alone(model):
    """:func:`served_alone` of :func:`requests` (computed once: several tests compare with it)."""
    return served_alone(model, requests())


def test_results_do_not_depend_on_the_batch(model, alone):
    with Engine(model, max_seqs=3, max_rounds=3, max_prefill_seqs=2) as shared:
        handles = [shared.submit(p, params) for p, params in requests()]
        got = [h.result().tokens for h in handles]
        stats = shared.stats
    assert got == alone
    assert [len(t) for t in got] == [3 + 2 * i for i in range(12)]  # no end-of-sequence token configured
    # continuous batching: slots freed by short requests were refilled, so steps were shared
    assert stats.decode_tokens / stats.decode_steps > 2.0


def test_requests_from_many_threads(model, alone):
    results = {}
    with Engine(model, max_seqs=4, max_rounds=2) as engine:

        def client(i, prompt, params):
            results[i] = engine.submit(prompt, params).result().tokens

        threads = [threading.Thread(target=client, args=(i, *r)) for i, r in enumerate(requests())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [results[i] for i in range(12)] == alone


def test_a_full_queue_refuses_with_429(model):
    engine = Engine(model, max_seqs=1, max_queued=2, max_rounds=1)
    long = SamplingParams(max_new_tokens=60, temperature=0.0)
    with engine:
        accepted = []
        with pytest.raises(RequestError) as refused:
            for _ in range(5):  # two wait in the queue, one more may be decoding already
                accepted.append(engine.submit([1, 2, 3], long))
        assert refused.value.status == 429 and "the queue holds 2" in str(refused.value)
        assert len(accepted) in (2, 3)
        assert all(len(r.result().tokens) == 60 for r in accepted)


def test_streamed_updates_add_up_to_the_result(model):
    class Digits:  # a tokenizer whose text is the token ids
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    updates = []
    with Engine(model, tokenizer=Digits(), max_seqs=2, max_rounds=3) as engine:
        done = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=10, seed=1), on_update=updates.append).result()
    assert "".join(u.text for u in updates) == done.text
    assert functools.reduce(operator.iadd, (u.tokens for u in updates), []) == done.tokens
    assert updates[-1].finished is done and all(u.finished is None for u in updates[:-1])


def test_end_of_sequence_and_truncation(model):
    with Engine(model, max_seqs=2, max_rounds=2) as engine:
        free = engine.submit([1, 2], SamplingParams(max_new_tokens=20, temperature=0.0)).result()
    eos = free.tokens[4]
    with Engine(model, eos_ids=(eos,), max_seqs=2, max_rounds=2) as engine:
        stopped = engine.submit([1, 2], SamplingParams(max_new_tokens=20, temperature=0.0)).result()
        # top-k 1 and a tiny nucleus are greedy whatever the temperature
        narrowed = [
            engine.submit([1, 2], SamplingParams(max_new_tokens=20, temperature=2.0, ignore_eos=True, **kw)).result()
            for kw in ({"top_k": 1}, {"top_p": 1e-6})
        ]
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[: free.tokens.index(eos)]
    assert free.finish_reason == "length"
    assert all(n.tokens == free.tokens for n in narrowed)


def test_context_limits_are_checked_before_queueing(model):
    with Engine(model, max_seqs=1) as engine:
        with pytest.raises(RequestError, match="this model's context is 96 tokens") as e:
            engine.submit(list(range(96)), SamplingParams(max_new_tokens=1))
        assert e.value.field == "prompt"
        with pytest.raises(RequestError, match="ask for at most 6 new tokens") as e:
            engine.submit(list(range(90)), SamplingParams(max_new_tokens=7))
        assert e.value.field == "max_new_tokens"
        with pytest.raises(RequestError, match="outside the vocabulary"):
            engine.submit([61], SamplingParams(max_new_tokens=4))
        with pytest.raises(RequestError, match="top_p must be in") as e:
            engine.submit([1], SamplingParams(top_p=0.0, top_logprobs=30))
        assert e.value.field == "top_p" and "top_logprobs must be 0 to 20, not 30" in str(e.value)


def test_top_logprobs_rank_the_alternatives(model):
    greedy = SamplingParams(max_new_tokens=9, temperature=0.0, top_logprobs=4)
    sampled = SamplingParams(max_new_tokens=9, temperature=1.5, seed=3, top_logprobs=20)
    with Engine(model, max_seqs=2, max_rounds=4) as engine:
        plain = engine.submit([3, 4, 5], SamplingParams(max_new_tokens=9, temperature=0.0)).result()
        best, drawn = engine.submit([3, 4, 5], greedy), engine.submit([9, 8], sampled)
        best, drawn = best.result(), drawn.result()
    assert plain.top_logprobs is None
    assert best.tokens == plain.tokens and len(best.top_logprobs) == 9
    for token, logprob, top in zip(best.tokens, best.logprobs, best.top_logprobs):
        assert len(top) == 4 and top[0] == (token, pytest.approx(logprob, abs=1e-5))  # greedy: the chosen is first
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    for token, logprob, top in zip(drawn.tokens, drawn.logprobs, drawn.top_logprobs):
        assert len(top) == 20 and len({t for t, _ in top}) == 20
        # a drawn token among the 20 likeliest carries the same log-probability there
        assert all(lp == pytest.approx(logprob, abs=1e-5) for t, lp in top if t == token)


def test_listeners_hear_of_cancellation_and_failure(model, monkeypatch):
    heard = []
    with Engine(model, max_seqs=1, max_rounds=1) as engine:
        first = engine.submit([1, 2], SamplingParams(max_new_tokens=40, temperature=0.0))
        queued = engine.submit([3], SamplingParams(max_new_tokens=5), on_update=heard.append)
        queued.cancel()
        assert first.result().finish_reason == "length"
        assert queued.result().finish_reason == "cancelled"
    assert heard[-1].finished is queued.result()

    real_prefill = engine_module._prefill

    def buggy(cache, model, tokens, *args, **kwargs):  # a step that fails for one prompt (a model's bug)
        if int(tokens[0, 0]) == 13:
            raise ValueError("cannot read token 13")
        return real_prefill(cache, model, tokens, *args, **kwargs)

    monkeypatch.setattr(engine_module, "_prefill", buggy)
    with Engine(model, max_seqs=1, max_rounds=1) as engine:
        failed = []
        request = engine.submit([13, 2], SamplingParams(max_new_tokens=3), on_update=failed.append)
        with pytest.raises(RequestError, match="cannot read token 13") as e:
            request.result(timeout=60)
        assert e.value.status == 500 and failed[-1].error is e.value
        # that request failed alone: the engine goes on
        assert engine.accepting
        assert len(engine.submit([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True)).result(60).tokens) == 3

    def lost(cache, *args, **kwargs):  # a step that loses the device's state, as on a device error
        for leaf in jax.tree.leaves(cache):
            leaf.delete()
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine_module, "_prefill", lost)
    stopped = []
    engine = Engine(model, max_seqs=1, max_rounds=1, on_failure=stopped.append)
    failed = []
    assert engine.accepting
    request = engine.submit([1, 2], SamplingParams(max_new_tokens=3), on_update=failed.append)
    with pytest.raises(RequestError) as e:
        request.result(timeout=60)
    assert e.value.status == 503 and failed[-1].error is e.value and failed[-1].finished is None
    assert not engine.accepting and "the engine has failed" in engine.refusal()
    assert [str(x) for x in stopped] == ["device lost"] and engine.failed is stopped[0]
    with pytest.raises(RequestError, match="the engine has failed") as e:
        engine.submit([1], SamplingParams(max_new_tokens=1))
    assert e.value.status == 503
    engine.shutdown()


def test_seeds_select_streams_by_all_their_bits(model):
    """Seeds that agree modulo 2**32 draw different text; a seed below 2**32 draws as before
    (its key is jax.random.PRNGKey(seed)); seeds past 64 bits are refused by name."""
    import numpy as np

    from levanter_core.inference.sampling import token_keys

    words = np.array([SamplingParams(seed=s).seed_words for s in (7, 2**32 + 7, -1)], np.uint32)
    keys = token_keys(words, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))
    assert (keys[0] == jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), 0), 0)).all()
    assert not (keys[0] == keys[1]).all() and not (keys[0] == keys[2]).all()
    with Engine(model, max_seqs=4) as engine:

        def text(seed):
            params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
            return engine.submit([1, 2, 3], params).result(60).tokens

        assert text(1) == text(1)
        assert text(1) != text(2**32 + 1) and text(5) != text(5 - 2**32)
        for seed in (2**63, -(2**63) - 1):
            with pytest.raises(RequestError, match="seed must be an integer from -2\\*\\*63 to 2\\*\\*63 - 1") as e:
                engine.submit([1], SamplingParams(seed=seed))
            assert e.value.field == "seed"


def test_out_of_range_settings_are_refused_not_fatal(model):
    """A top_k past what a device integer holds used to kill the engine's thread."""
    with Engine(model, max_seqs=2) as engine:
        for bad, field in [
            (dict(top_k=2**31), "top_k"), (dict(top_k=-1), "top_k"), (dict(temperature=float("nan")), "temperature"),
            (dict(temperature=float("inf")), "temperature"), (dict(top_p=float("nan")), "top_p"),
            (dict(stop=("x",) * 17), "stop"), (dict(stop=("x" * 1001,)), "stop"),
        ]:  # fmt: skip
            with pytest.raises(RequestError) as e:
                engine.submit([1, 2], SamplingParams(max_new_tokens=2, **bad))
            assert e.value.status == 400 and e.value.field == field
        # a top_k past the vocabulary keeps every token, as 0 does
        same = [
            SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, top_k=k, ignore_eos=True) for k in (0, 2**31 - 1)
        ]
        first, second = (engine.submit([4, 5], p).result(60).tokens for p in same)
        assert first == second and engine.accepting


def test_precompiled_engines_compile_nothing_while_serving(model):
    compiled = []

    def listen(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    engine = Engine(model, max_seqs=3, max_seq_len=40, max_rounds=2, max_prefill_seqs=2)
    # (rows 1, 2 x prompt lengths 16, 32, 40; keys 16, 32, 40) x greedy or sampling
    assert engine.precompile() == 18  # greedy and sampling programs each
    compiled.clear()
    work = [([(5 * i + j) % 61 for j in range(1 + 3 * i)],
             SamplingParams(max_new_tokens=4 + i, temperature=0.7 * (i % 2), seed=i)) for i in range(9)]  # fmt: skip
    try:
        with engine:
            got = [r.result().tokens for r in [engine.submit(p, params) for p, params in work]]
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == []
    # (the reference engine has the model's whole context: its programs are those of the other tests')
    assert got == served_alone(model, work)
