"""Batching log-likelihood queries: few compiled shapes, one row per distinct input (one pass
per distinct context, for a model with a cache), and a score that does not depend on what else
is in the batch or on how it was batched."""

from __future__ import annotations

import math

import numpy as np
import pytest

from levanter_eval_harness.scoring import Query, plan_batches


def _queries() -> list[Query]:
    rng = np.random.default_rng(0)
    out = []
    for length in (5, 9, 17, 30, 31, 63):
        context = [int(t) for t in rng.integers(1, 200, size=length)]
        for answer in (3, 7, 11):  # three one-token answers: the same input, three targets
            out.append(Query.of_pair(context, [answer], 64))
        out.append(Query.of_pair(context[:-2], context[-2:] + [5], 64))  # a longer continuation
    return out


def test_queries_with_the_same_input_share_a_row():
    queries = _queries()
    batches = plan_batches(queries, rows=4, max_length=64)
    distinct = {q.tokens for q in queries}
    used_rows = sum(len({tuple(b.tokens[r]) for r in b.row[: len(b.indices)]}) for b in batches)
    assert used_rows == len(distinct) < len(queries)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(queries)))
    for b in batches:
        assert b.tokens.shape[0] == 4
        for size in (b.targets.shape[0], b.targets.shape[1]):
            assert size & (size - 1) == 0  # powers of two: few shapes to compile
        length = b.tokens.shape[1]
        assert length & (length - 1) == 0 or ((length // 3) & (length // 3 - 1) == 0 and length % 3 == 0)
        longest = max(len(queries[i].tokens) for i in b.indices)
        assert b.tokens.shape[1] >= longest


def test_a_query_longer_than_the_context_is_cut_from_the_left():
    q = Query.of_pair(list(range(1, 100)), [7, 8], max_length=10)
    assert q.tokens == (91, 92, 93, 94, 95, 96, 97, 98, 99, 7) and q.start == 8 and q.targets == (7, 8)


def test_scores_do_not_depend_on_the_batch(loaded):
    from levanter_eval_harness.lm import LevanterLM

    queries = _queries()
    vocab = loaded.Vocab.size
    queries = [Query(tuple(t % vocab for t in q.tokens), q.start, tuple(t % vocab for t in q.targets)) for q in queries]
    together = LevanterLM(loaded.model, loaded.tokenizer, max_length=64, batch_size=8).score(queries)
    alone = LevanterLM(loaded.model, loaded.tokenizer, max_length=64, batch_size=1)
    for query, (logprob, greedy) in zip(queries[::5], together[::5]):
        ((alone_logprob, alone_greedy),) = alone.score([query])
        assert math.isclose(logprob, alone_logprob, abs_tol=1e-4) and greedy == alone_greedy
    assert all(lp < 0 for lp, _ in together)


def test_an_empty_continuation_is_refused():
    with pytest.raises(ValueError, match="no tokens to score"):
        plan_batches([Query((1, 2), 1, ())], rows=2, max_length=8)


def _score_all(scorer, batches, count):
    out = [None] * count
    for batch in batches:
        for i, lp, g in zip(batch.indices, *scorer.run(batch)):
            out[i] = (float(lp), bool(g))
    return out


def test_shared_contexts_run_once_and_score_as_whole_inputs(loaded):
    from levanter_eval_harness.compute import Scorer

    rng = np.random.default_rng(1)
    vocab = loaded.Vocab.size
    queries = []
    for length in (1, 6, 20, 45):  # a one-token context (an empty one, in lm-eval) among them
        context = [int(t) for t in rng.integers(1, vocab, size=length)]
        for answer_length in (1, 3, 8):
            queries.append(Query.of_pair(context, [int(t) for t in rng.integers(1, vocab, size=answer_length)], 64))
    shared = plan_batches(queries, rows=4, max_length=64, share_prefixes=True)
    assert all(b.suffix is not None for b in shared)
    assert sum(len({tuple(r) for r in b.tokens[b.row[: len(b.indices)]]}) for b in shared) == 4  # one per context
    scorer = Scorer(loaded.model)
    assert scorer.shares_prefixes
    plain = _score_all(scorer, plan_batches(queries, rows=4, max_length=64), len(queries))
    for (lp, greedy), (lp2, greedy2) in zip(plain, _score_all(scorer, shared, len(queries))):
        assert abs(lp - lp2) <= 1e-4 and greedy == greedy2


def test_prefixes_nobody_shares_run_as_whole_inputs():
    windows = [Query.of_pair([1 + i, 2, 3], [4, 5, 6], 64) for i in range(3)]
    assert all(b.suffix is None for b in plan_batches(windows, rows=4, max_length=64, share_prefixes=True))
