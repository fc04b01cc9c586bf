"""``levanter serve`` as OpenAI's own client sees it: a real uvicorn server on loopback over a
tiny random Llama (see ``tiny.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from levanter_core.cli import main
from levanter_core.testing import listed_plugin
from levanter_serve.tests.tiny import CONTEXT, SENTENCES, ServerThread, started_engine

# one worker under `pytest -n` builds the tiny model and its servers once for all of these
pytestmark = pytest.mark.xdist_group("levanter-serve")


def model_name(client) -> str:
    """The name the server gives its model (the model directory's, which pytest numbers)."""
    return client.models.list().data[0].id


def error_of(response: httpx.Response) -> dict:
    """The OpenAI-style error of a response, checked for its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_health_and_models(server, model_dir):
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [os.path.basename(model_dir)]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == CONTEXT


def test_completion_fields(client):
    name = model_name(client)
    answer = client.completions.create(model=name, prompt="hello world", max_tokens=12, temperature=0, logprobs=1)
    assert answer.id.startswith("cmpl-") and answer.object == "text_completion" and answer.model == name
    assert abs(answer.created - time.time()) < 60
    (choice,) = answer.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    generated = len(choice.logprobs.tokens)
    assert answer.usage.completion_tokens == generated and (generated == 12) == (choice.finish_reason == "length")
    assert answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + generated
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    # greedy: the chosen token is the likeliest at each position
    for text, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert list(top) == [text] and top[text] == pytest.approx(lp, abs=1e-5)

    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0, n=2,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy twice
    assert len(chat.choices[0].logprobs.content) <= 5
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    for entry in chat.choices[0].logprobs.content:
        alternatives = entry.top_logprobs
        assert len(alternatives) == 3 and alternatives[0].token == entry.token
        assert alternatives[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert alternatives[0].logprob >= alternatives[1].logprob >= alternatives[2].logprob


def _requests(name: str) -> list[tuple[str, dict]]:
    """16 different requests at temperature 0: completions of prompts of different lengths
    (text, several texts, token ids) and chats."""
    out = []
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        out.append(("completion", dict(prompt=" ".join(words[: 2 + i]), max_tokens=6 + 3 * i)))
        out.append(("completion", dict(prompt=sentence, max_tokens=10, stop=["e"])))
        out.append(("chat", dict(messages=[{"role": "user", "content": sentence}], max_tokens=8 + i)))
    out.append(("completion", dict(prompt=[5, 9, 200, 17], max_tokens=9)))
    out.append(("completion", dict(prompt=[SENTENCES[0], SENTENCES[2][:9]], max_tokens=7)))
    turns = [("user", "a"), ("assistant", "b"), ("user", "c")]
    out.append(("chat", dict(messages=[{"role": r, "content": c} for r, c in turns], max_tokens=12)))
    turns = [("system", "be brief"), ("user", "why?")]
    out.append(("chat", dict(messages=[{"role": r, "content": c} for r, c in turns], max_tokens=5)))
    assert len(out) == 16
    return [(kind, dict(model=name, temperature=0, **args)) for kind, args in out]


async def _ask(client: AsyncOpenAI, kind: str, args: dict) -> list[tuple[str, str]]:
    if kind == "completion":
        answer = await client.completions.create(**args)
        return [(c.text, c.finish_reason) for c in answer.choices]
    answer = await client.chat.completions.create(**args)
    return [(c.message.content, c.finish_reason) for c in answer.choices]


def test_concurrent_requests_match_each_alone(server, client):
    requests = _requests(model_name(client))
    batch = requests * 4  # 64

    async def run():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as aclient:
            alone = [await _ask(aclient, kind, args) for kind, args in requests]
            together = await asyncio.gather(*(_ask(aclient, kind, args) for kind, args in batch))
        return alone, together

    alone, together = asyncio.run(run())
    assert len(together) == 64
    assert together == alone * 4
    assert all(text for answer in alone for text, _ in answer)


def _stream_text(stream, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_streaming_matches_whole_answer(client, temperature):
    name = model_name(client)
    args = dict(model=name, prompt=["the quick brown", "hello"], max_tokens=40, temperature=temperature, seed=3, n=2)
    whole = client.completions.create(**args)
    texts, reasons = _stream_text(client.completions.create(stream=True, **args), chat=False)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}

    args = dict(model=name, messages=[{"role": "user", "content": "hello world"}], max_tokens=40,
                temperature=temperature, seed=3, n=2, stop=["o"])  # fmt: skip
    whole = client.chat.completions.create(**args)
    texts, reasons = _stream_text(client.chat.completions.create(stream=True, **args), chat=True)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert all("o" not in text for text in texts.values())


def test_stream_usage_and_done(server, client):
    body = dict(model=model_name(client), prompt="hello", max_tokens=7, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_same_seed_same_text(client):
    args = dict(
        model=model_name(client),
        prompt="language models",
        max_tokens=30,
        temperature=1.0,
        top_p=0.95,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    first = client.completions.create(seed=11, **args).choices[0].text
    assert client.completions.create(seed=11, **args).choices[0].text == first
    assert client.completions.create(seed=12, **args).choices[0].text != first

    chat = dict(model=args["model"], messages=[{"role": "user", "content": "tell me"}], max_tokens=20, temperature=0.9)
    first = client.chat.completions.create(seed=5, **chat).choices[0].message.content
    assert client.chat.completions.create(seed=5, **chat).choices[0].message.content == first


@pytest.mark.parametrize(
    "endpoint, body, param",
    [
        ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "hi", "echo": True}, "echo"),
        ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("completions", {"prompt": [1, 2, 100000]}, "prompt"),
        ("completions", {"prompt": ""}, "prompt"),
        ("chat/completions", {}, "messages"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ],
)
def test_bad_request_is_400(server, endpoint, body, param):
    response = httpx.post(f"{server}/v1/{endpoint}", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_requests_through_the_client(client):
    name = model_name(client)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=name, prompt="hi", temperature=-1)
    assert caught.value.param == "temperature" and "greater than or equal to 0" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=name, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="hi")
    assert caught.value.code == "model_not_found" and name in caught.value.body["message"]


def test_not_json_and_unknown_route(server):
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and "JSON" in error_of(response)["message"]
    response = httpx.get(f"{server}/v1/engines")
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"


def test_beyond_the_context_is_400_naming_the_limit(client):
    name = model_name(client)
    long_prompt = " ".join(SENTENCES) * 10  # well over 256 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=name, prompt=long_prompt, max_tokens=4)
    assert f"context is {CONTEXT} tokens" in caught.value.body["message"]
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=name, prompt="hello", max_tokens=CONTEXT)
    assert f"context of {CONTEXT} tokens" in caught.value.body["message"] and caught.value.param == "max_tokens"

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": long_prompt}])
    assert f"context is {CONTEXT} tokens" in caught.value.body["message"] and caught.value.param == "messages"

    with pytest.raises(openai.BadRequestError) as caught:
        hi = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model=name, messages=hi, max_completion_tokens=999)
    assert f"context of {CONTEXT} tokens" in caught.value.body["message"]
    assert caught.value.param == "max_completion_tokens"


def test_api_key(keyed_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        response = httpx.get(f"{keyed_server}/v1/models", headers=headers)
        assert response.status_code == 401
        assert error_of(response)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny-keyed", prompt="hi", max_tokens=2
        )
    good = OpenAI(base_url=f"{keyed_server}/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny-keyed"]
    hi = [{"role": "user", "content": "hi"}]
    answer = good.chat.completions.create(model="tiny-keyed", messages=hi, max_tokens=3)
    assert answer.model == "tiny-keyed" and answer.usage.completion_tokens <= 3
    assert httpx.get(f"{keyed_server}/health").status_code == 200  # for load balancers, no key


SMALL_CONTEXT = 64


@pytest.fixture(scope="module")
def small_server(loaded):
    """A server whose engine decodes one sequence and queues one more, one token per step, in a
    context of 64 tokens."""
    from levanter_serve import create_app

    engine = started_engine(loaded, max_seqs=1, max_queued=1, max_rounds=1, max_seq_len=SMALL_CONTEXT)
    with ServerThread(create_app(engine, loaded)) as running:
        yield running.url, engine
    engine.shutdown(drain=False)


def test_full_queue_is_429(small_server, loaded):
    url, _ = small_server
    body = {"prompt": "hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    barrier = threading.Barrier(6)

    def post(_):
        barrier.wait()
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
    for r in responses:
        if r.status_code == 200:  # what was accepted was answered in full
            assert r.json()["usage"]["completion_tokens"] == 60
        else:
            error = error_of(r)
            assert error["code"] == "rate_limit_exceeded" and "the queue holds 1" in error["message"]
            assert r.headers["retry-after"] == "1"


def test_chat_answers_fill_the_context_by_default(small_server):
    url, _ = small_server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=model_name(client), messages=[{"role": "user", "content": "why?"}], temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == SMALL_CONTEXT


def test_disconnect_cancels_the_request(server, engine, monkeypatch):
    url = server
    submitted = []
    submit = engine.submit

    def spy(*args, **kwargs):
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(engine, "submit", spy)
    body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # the answer has begun; then the client goes away
    (request,) = submitted
    completion = request.result(timeout=60)
    assert completion.finish_reason == "cancelled" and len(completion.tokens) < 200
    assert engine.pending() == 0


def test_installed_as_a_command():
    ours = listed_plugin("levanter-serve")
    assert ours["error"] is None and ours["hooks"] == ["register_commands"]


def test_busy_port_is_a_user_error(model_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", model_dir, "--port", str(port)])
    assert exit_info.value.code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ctrl_c_finishes_answers_in_flight(model_dir):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from levanter_core.cli import main; main()",
            "serve",
            model_dir,
            "--port",
            str(port),
            "--max-rounds",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = model_name(client)
        stream = client.completions.create(
            model=name, prompt="hello", max_tokens=200, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        process.send_signal(signal.SIGINT)  # while the answer is being generated
        usage = None
        for chunk in chunks:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert usage.completion_tokens == 200
        with pytest.raises(openai.APIConnectionError):  # it has stopped taking requests
            client.completions.create(model=name, prompt="hello", max_tokens=2)
        output = process.communicate(timeout=60)[0]
        assert process.returncode == 0, output
        assert f"serving {name}" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
