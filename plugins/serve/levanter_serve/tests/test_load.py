"""A bounded load test of ``levanter serve`` on loopback: 2,000 requests, valid ones mixed with
every class of bad input (numbers out of range, non-finite numbers, lone surrogates, bodies
that are not JSON or too large, unknown models and routes, foreign Host names, prompts past the
context, slow clients), sent concurrently through a real HTTP client to a real uvicorn server
over the tiny model. Every valid answer must equal the same request sent alone at temperature
0 (its log-probabilities to 1e-4), no client mistake may be answered 500, and the engine must
never stop."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from levanter_serve.tests.tiny import SENTENCES, ServerThread

pytestmark = [pytest.mark.xdist_group("levanter-serve"), pytest.mark.slow]

REQUESTS = 2000
CONCURRENCY = 24
SLOW_CLIENT_TIMEOUT = 5.0
"""Seconds the server waits for a request's headers or body: long enough that a valid request on a
busy machine always makes it (1 s did not, in CI), short enough for the stalled clients' 408."""
# The test is bounded in time by its client's 60 s timeout per request, not by a wall-clock
# assertion: how fast the requests go is a benchmark's business (bench/generate.py), and a busy
# machine must not fail a test of behaviour.


LOGPROB_TOLERANCE = 1e-4
"""How far a log-probability answered under load may be from the same request's alone. Its text
and tokens must be the same, but its numbers come from a program compiled for the batch it was
served in (more rows; prompts padded to the batch's longest), whose sums XLA orders differently:
their last bits can differ (the one request that asks for log-probabilities failed an exact
comparison in two full runs of the suite on a busy 2-core machine, 2026-11-28 and -29)."""


def _same_choices(got, want) -> bool:
    """``got == want``, but floats (log-probabilities) within :data:`LOGPROB_TOLERANCE`."""
    if isinstance(want, float) and isinstance(got, float):
        return abs(got - want) <= LOGPROB_TOLERANCE
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_same_choices(got[k], want[k]) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same_choices(g, w) for g, w in zip(got, want))
    return type(got) is type(want) and got == want


def _valid() -> list[tuple[str, dict]]:
    """Distinct valid requests at temperature 0 (small budgets: the test is about the server)."""
    out = []
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        out.append(("completions", {"prompt": " ".join(words[: 2 + i]), "max_tokens": 3 + i}))
        out.append(("chat/completions", {"messages": [{"role": "user", "content": sentence}], "max_tokens": 4}))
    out += [
        ("completions", {"prompt": [5, 9, 200, 17], "max_tokens": 5, "stop": ["e", "\n\n"]}),
        ("completions", {"prompt": ["hello", "fox"], "max_tokens": 3, "n": 2}),
        ("completions", {"prompt": "😀 \u202e\x00 ok", "max_tokens": 4, "top_k": 2**31 - 1, "seed": -(2**63)}),
        (
            "chat/completions",
            {
                "messages": [{"role": "user", "content": "\\ud800 is six characters"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
    ]
    return [(endpoint, {**body, "temperature": 0}) for endpoint, body in out]


HI = [{"role": "user", "content": "hi"}]


def _bad() -> list[tuple[str, str | dict, dict, set[int]]]:
    """``(endpoint, body, headers, statuses allowed)`` for each class of client mistake. A body
    that is a string is sent as it is (raw JSON, or not JSON at all)."""
    json_ = {"content-type": "application/json"}
    numbers = [
        {"top_k": 2**31}, {"top_k": 10**30}, {"top_k": -7}, {"top_p": 0}, {"top_p": 1.01}, {"temperature": -1},
        {"temperature": 1e6}, {"n": 0}, {"n": 10**6}, {"seed": 2**64}, {"seed": -(2**70)}, {"max_tokens": 0},
        {"max_tokens": 10**50}, {"max_tokens": 300}, {"logprobs": 99}, {"presence_penalty": 2}, {"frequency_penalty": -1},
        {"stop": ["a"] * 40}, {"stop": ["b" * 5000]}, {"stop": [""]}, {"stop": [1, 2]}, {"top_k": "many"},
        {"temperature": True, "top_p": []},
    ]  # fmt: skip
    out = [("completions", {"prompt": "hi", "max_tokens": 2, **n}, {}, {400}) for n in numbers]
    raw = [
        '{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "temperature": Infinity}',
        '{"prompt": "hi", "top_p": -Infinity}', '{"prompt": "hi", "seed": ' + "9" * 5000 + "}",
        '{"prompt": "\\ud800"}', '{"prompt": ["ok", "\\udfff"]}', '{"prompt": "hi", "stop": "\\ud83d"}',
        '{"prompt": "hi", "model": "\\udc00"}', "{not json", "", "[1, 2, 3]", '"just a string"', "null",
        '{"prompt": {"nested": [[[[]]]]}}', '{"prompt": [1, 2, 100000]}', '{"prompt": [-1]}', '{"prompt": []}',
        '{"prompt": [[]]}', '{"prompt": ' + json.dumps(" ".join(SENTENCES) * 8) + "}",
    ]  # fmt: skip
    out += [("completions", body, json_, {400}) for body in raw]
    chats = [
        '{"messages": [{"role": "user", "content": "\\ud800"}]}', '{"messages": []}', '{"messages": [{"role": "x"}]}',
        '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": true}',
        '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1e400}',
    ]  # fmt: skip
    out += [("chat/completions", body, json_, {400}) for body in chats]
    out += [
        ("completions", {"prompt": "x" * 70_000}, {}, {413}),
        ("completions", {"prompt": "hi", "max_tokens": 2}, {"Host": "rebind.attacker.example"}, {400}),
        ("completions", {"prompt": "hi", "model": "gpt-4"}, {}, {404}),
        ("engines", {"prompt": "hi"}, {}, {404}),
        ("completions", "prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, {400}),
    ]
    return out


async def _slow_client(port: int, data: bytes) -> bytes:
    """A client that sends ``data`` and then nothing more: what the server answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def test_two_thousand_requests_mixing_valid_and_bad_input(engine, loaded):
    from levanter_serve import create_app

    app = create_app(engine, loaded, max_body_bytes=64 * 1024, body_timeout=SLOW_CLIENT_TIMEOUT)
    valid, bad = _valid(), _bad()
    with ServerThread(app, header_timeout=SLOW_CLIENT_TIMEOUT) as running:
        url = running.url

        async def send(client: httpx.AsyncClient, endpoint: str, body, headers: dict) -> httpx.Response:
            if isinstance(body, str):
                content = body.encode("utf-8", "surrogatepass")
                return await client.post(f"{url}/v1/{endpoint}", content=content, headers=headers)
            return await client.post(f"{url}/v1/{endpoint}", json=body, headers=headers)

        async def run():
            # a new connection a request: a pooled connection that the server closes as idle just as
            # the client reuses it fails in the client (HTTP keep-alive's own race), not in the server
            limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                alone = [(await send(client, e, b, {})).json()["choices"] for e, b in valid]
                rng = random.Random(0)
                plan = [rng.choice([("valid", i) for i in range(len(valid))] * 2 + [("bad", j) for j in range(len(bad))])
                        for _ in range(REQUESTS)]  # fmt: skip
                gate = asyncio.Semaphore(CONCURRENCY)

                async def one(kind, i):
                    async with gate:
                        if kind == "valid":
                            return kind, i, await send(client, *valid[i], {})
                        endpoint, body, headers, _ = bad[i]
                        return kind, i, await send(client, endpoint, body, headers)

                slow = [
                    _slow_client(running.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"),
                    _slow_client(
                        running.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n{"
                    ),
                ]
                started = time.monotonic()
                results = await asyncio.gather(*(one(k, i) for k, i in plan), *slow)
                return alone, results[:REQUESTS], results[REQUESTS:], time.monotonic() - started

        alone, results, slow_answers, seconds = asyncio.run(run())
        health = httpx.get(f"{url}/health").json()

    statuses: dict[int, int] = {}
    for kind, i, response in results:
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if kind == "valid":
            assert response.status_code == 200, (valid[i], response.text)
            assert _same_choices(response.json()["choices"], alone[i]), (valid[i], response.json(), alone[i])
        else:
            endpoint, body, headers, allowed = bad[i]
            assert response.status_code in allowed, (
                endpoint,
                str(body)[:200],
                headers,
                response.status_code,
                response.text,
            )
            assert set(response.json()) == {"error"}
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in slow_answers), slow_answers
    assert 500 not in statuses and 503 not in statuses
    assert health["status"] == "ok" and engine.failed is None and engine.accepting
    print(f"\n{REQUESTS} requests in {seconds:.1f} s: " + ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items())))
