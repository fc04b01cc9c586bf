"""``levanter serve`` against a hostile client: every numeric field has bounds (400 naming the
field and what is allowed), any string gets 200 or 400, a request that breaks inside the engine
fails alone (500) while the others are served, a broken engine stops the server, and the limits
on what a client may send (body size, slow clients, Host names, the docs behind the API key).
A real uvicorn server on loopback over the tiny model (``tiny.py``), real HTTP clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from levanter_core.cli import main
from levanter_serve.tests.tiny import ServerThread, started_engine

pytestmark = pytest.mark.xdist_group("levanter-serve")


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post(url: str, endpoint: str, body, **kwargs) -> httpx.Response:
    """POST ``body`` (a dict, or raw JSON text such as ``{"temperature": NaN}``)."""
    if isinstance(body, str):
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        return httpx.post(f"{url}/v1/{endpoint}", content=body.encode("utf-8", "surrogatepass"), headers=headers,
                          timeout=120, **kwargs)  # fmt: skip
    return httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=120, **kwargs)


HI = [{"role": "user", "content": "hi"}]

OUT_OF_RANGE = [
    ("completions", {"prompt": "hi", "max_tokens": 4, "top_k": 2147483648}, "top_k", "2147483647"),
    ("completions", {"prompt": "hi", "top_k": 10**30}, "top_k", "2147483647"),
    ("completions", {"prompt": "hi", "top_k": -2}, "top_k", "-1"),
    ("completions", {"prompt": "hi", "temperature": 1e9}, "temperature", "100"),
    ("completions", '{"prompt": "hi", "temperature": Infinity}', "temperature", "finite"),
    ("completions", '{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    ("completions", '{"prompt": "hi", "top_p": NaN}', "top_p", "finite"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "1"),
    ("completions", {"prompt": "hi", "n": 129}, "n", "128"),
    ("completions", {"prompt": "hi", "seed": 2**63}, "seed", "9223372036854775807"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed", "-9223372036854775808"),
    ("completions", {"prompt": "hi", "max_tokens": 10**40}, "max_tokens", "2147483647"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "1"),
    ("completions", {"prompt": "hi", "logprobs": 6}, "logprobs", "5"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "0"),
    ("completions", '{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty", "0"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop", "at most 16"),
    ("completions", {"prompt": "hi", "stop": "x" * 1001}, "stop", "at most 1000"),
    ("chat/completions", {"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "20"),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 2**31}, "max_completion_tokens", "2147483647"),
    ("chat/completions", {"messages": HI, "seed": 2**64}, "seed", "9223372036854775807"),
]


@pytest.mark.parametrize("endpoint, body, param, allowed", OUT_OF_RANGE)
def test_out_of_range_fields_are_400_naming_field_and_range(server, endpoint, body, param, allowed):
    response = post(server, endpoint, body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and allowed in error["message"], error
    # and the engine goes on serving
    assert post(server, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_top_k_past_int32_does_not_stop_the_engine(server):
    """The issue's example: it used to kill the engine's thread, and every later request got 503."""
    bad = post(server, "completions", {"prompt": "hi", "max_tokens": 4, "top_k": 2147483648})
    assert bad.status_code == 400 and error_of(bad)["param"] == "top_k"
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    # a top_k past the vocabulary (but within bounds) keeps every token, as 0 does
    answers = [
        post(server, "completions", {"prompt": "hi", "max_tokens": 6, "seed": 4, "top_k": k}).json()["choices"][0][
            "text"
        ]
        for k in (0, 2147483647)
    ]
    assert answers[0] == answers[1]


SURROGATES = [
    ("completions", '{"prompt": "a\\ud800b"}', "prompt", "prompt"),
    ("completions", '{"prompt": ["fine", "\\udfff"]}', "prompt", "prompt[1]"),
    ("completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop", "stop string 0"),
    ("completions", '{"prompt": "hi", "model": "\\ud800"}', "model", "model"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "content"),
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages[0].content",
        "content",
    ),
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
        "messages[0].name",
        "name",
    ),
]


@pytest.mark.parametrize("endpoint, body, param, what", SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(server, endpoint, body, param, what):
    response = post(server, endpoint, body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"] and what in error["message"]


@pytest.mark.parametrize(
    "text",
    ["", "\x00\x00", "\u202e\u0644\u0627", "😀" * 50, "\n\n", "\\ud800", '"}{', "\r\n\t\x0b\x0c", "\ufffd\uffff"],
)
def test_any_unicode_text_is_answered_200_or_400(server, text):
    for endpoint, body in [
        ("completions", {"prompt": text, "max_tokens": 2, "stop": [text] if text else None}),
        ("completions", {"prompt": [text, "x"], "max_tokens": 2}),
        ("chat/completions", {"messages": [{"role": "user", "content": text, "name": text}], "max_tokens": 2}),
        ("chat/completions", {"messages": HI, "max_tokens": 2, "stop": text or None}),
    ]:
        response = post(server, endpoint, body)
        assert response.status_code in (200, 400), (endpoint, body, response.text)
        if response.status_code == 400:  # only the empty prompt, which has no token
            assert text == "" and error_of(response)["param"] == "prompt"


@pytest.fixture(scope="module")
def limited_server(engine, loaded):
    """A server with small limits: 4 KiB bodies, half a second for headers and for a body."""
    from levanter_serve import create_app

    app = create_app(engine, loaded, max_body_bytes=4096, body_timeout=0.5, allowed_hosts=("my-box.internal",))
    with ServerThread(app, header_timeout=0.5) as running:
        yield running


def test_a_body_over_the_limit_is_413(limited_server):
    url = limited_server.url
    big = {"prompt": "x" * 5000, "max_tokens": 2}
    response = post(url, "completions", big)
    assert response.status_code == 413
    error = error_of(response)
    assert "4,096 bytes" in error["message"] and "--max-body-size" in error["message"]

    def chunks():  # no Content-Length: the body is counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    response = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert post(url, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def _raw(port: int, data: bytes, wait: float) -> bytes:
    """Send ``data`` on a fresh connection, wait ``wait`` seconds, and read what comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        time.sleep(wait)
        received = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
    return received


def test_slow_clients_are_answered_408_and_disconnected(limited_server):
    port = limited_server.port
    started = time.monotonic()
    # headers that never end
    answer = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le", 0.1)
    assert answer.startswith(b"HTTP/1.1 408") and b"--header-timeout" in answer
    # a body that never ends
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    answer = _raw(port, head + b'{"prompt": ', 0.1)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
    assert time.monotonic() - started < 10
    # a connection that sends nothing is closed, not held
    assert _raw(port, b"", 0.1) == b""
    # meanwhile, and afterwards, others are served
    assert post(limited_server.url, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_host_names_are_checked_without_an_api_key(limited_server, keyed_server):
    url = limited_server.url
    body = {"prompt": "hi", "max_tokens": 2}
    refused = post(url, "completions", body, headers={"Host": "attacker.example"})
    assert refused.status_code == 400
    error = error_of(refused)
    assert error["code"] == "invalid_host" and "--allowed-host" in error["message"]
    assert httpx.get(f"{url}/health", headers={"Host": "attacker.example:8000"}).status_code == 400
    for host in ("localhost", "localhost:8000", "127.0.0.1:1234", "[::1]:80", "10.1.2.3", "MY-BOX.internal:80"):
        assert post(url, "completions", body, headers={"Host": host}).status_code == 200, host
    # with an API key, the key is the guard
    keyed = httpx.get(
        f"{keyed_server}/v1/models", headers={"Host": "anything.example", "Authorization": "Bearer sesame"}
    )
    assert keyed.status_code == 200


def test_docs_follow_the_api_key(server, keyed_server, engine, loaded):
    from levanter_serve import create_app

    for path in ("/docs", "/openapi.json"):
        assert httpx.get(f"{server}{path}").status_code == 200
        refused = httpx.get(f"{keyed_server}{path}")
        assert refused.status_code == 401 and error_of(refused)["code"] == "invalid_api_key"
        assert httpx.get(f"{keyed_server}{path}", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert (
        "/v1/completions"
        in httpx.get(f"{keyed_server}/openapi.json", headers={"Authorization": "Bearer sesame"}).json()["paths"]
    )
    with ServerThread(create_app(engine, loaded, api_key="sesame", public_docs=True)) as public:
        assert httpx.get(f"{public.url}/docs").status_code == 200
        assert httpx.get(f"{public.url}/openapi.json").status_code == 200
        assert httpx.get(f"{public.url}/v1/models").status_code == 401


# -- failures inside the engine -------------------------------------------------------------------
def _short_reader(model, most: int):
    """``model`` with a bug: it fails (when compiled) on any step reading more than ``most`` tokens
    at once, as a plugin's model might on a shape it was never tried on."""
    import equinox as eqx

    class ShortReader(eqx.Module):
        inner: eqx.Module

        @property
        def config(self):
            return self.inner.config

        @property
        def Vocab(self):
            return self.inner.Vocab

        def get_lm_head(self):
            return self.inner.get_lm_head()

        def init_cache(self, Batch, KeyPos):
            return self.inner.init_cache(Batch, KeyPos)

        def decode(self, input_ids, positions, cache, *, key_len):
            if input_ids.resolve_axis("position").size > most:
                raise ValueError(f"this model cannot read more than {most} tokens at once")
            return self.inner.decode(input_ids, positions, cache, key_len=key_len)

    return ShortReader(model)


def test_a_request_that_fails_in_the_engine_is_500_and_the_others_are_served(loaded):
    from levanter_serve import create_app

    engine = started_engine(_Loaded(loaded, _short_reader(loaded.model, 16)), max_seqs=4, max_rounds=1)
    try:
        with ServerThread(create_app(engine, loaded)) as running:
            url = running.url
            short = {"prompt": "hi", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            alone = post(url, "completions", short).json()["choices"][0]["text"]
            long = {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "max_tokens": 2}
            begun = threading.Barrier(3, timeout=60)

            def streamed_short() -> str:  # a request being decoded while the others fail
                with httpx.stream("POST", f"{url}/v1/completions", json={**short, "stream": True}, timeout=60) as r:
                    lines = r.iter_lines()
                    events = [next(line for line in lines if line.startswith("data: "))]
                    begun.wait()
                    events += [line for line in lines if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                return "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])

            with ThreadPoolExecutor(4) as pool:
                shorts = [pool.submit(streamed_short) for _ in range(2)]
                begun.wait()  # both are being decoded: now two requests that fail
                failures = list(pool.map(lambda b: post(url, "completions", b), [long, long]))
                assert [f.result() for f in shorts] == [alone, alone]
            for failed in failures:
                assert failed.status_code == 500
                error = error_of(failed)
                assert error["type"] == "server_error" and error["code"] == "generation_failed"
                assert "cannot read more than 16 tokens" in error["message"]
            streamed = httpx.post(f"{url}/v1/completions", json={**long, "stream": True}, timeout=60)
            assert "cannot read more than 16 tokens" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
            assert httpx.get(f"{url}/health").json()["status"] == "ok"
            assert post(url, "completions", short).json()["choices"][0]["text"] == alone
    finally:
        engine.shutdown(drain=False)


class _Loaded:
    """``loaded`` with another model in it."""

    def __init__(self, loaded, model):
        self.__dict__.update(vars(loaded))
        self.model = model


def test_an_engine_that_dies_stops_the_server_with_an_error(loaded, monkeypatch):
    from levanter_core.inference import engine as engine_module
    from levanter_serve import create_app
    from levanter_serve.server import EngineFailed, run_until_stopped

    # the session engine's settings: its compiled steps (this process's, or the persistent cache's)
    # serve this one's warm-up, and the failure it meets is the same at any size
    engine = started_engine(loaded)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    outcome = []

    def run():
        try:
            run_until_stopped(engine, create_app(engine, loaded), listener)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert httpx.get(f"{url}/health").status_code == 200
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def lost(cache, *args, **kwargs):  # the device's state is gone: the engine cannot go on
        for leaf in __import__("jax").tree.leaves(cache):
            leaf.delete()
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine_module, "_prefill", lost)
    failed = post(url, "completions", {"prompt": "hi", "max_tokens": 2})
    assert failed.status_code == 503 and "device lost" in error_of(failed)["message"]
    thread.join(30)
    listener.close()
    assert not thread.is_alive(), "the server kept running with a dead engine"
    (error,) = outcome
    assert isinstance(error, EngineFailed) and "device lost" in str(error)


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, names",
    [
        (["--port", "70000"], "--port"),
        (["--port", "abc"], "--port"),
        (["--max-seqs", "0"], "--max-seqs"),
        (["--max-queued", "-1"], "--max-queued"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--max-body-size", "lots"], "--max-body-size"),
        (["--no-such-option"], "--no-such-option"),
    ],
)
def test_bad_options_exit_2_with_one_line(model_dir, capsys, args, names):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", model_dir, *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err, err
    assert err.startswith("error: ")


def test_surrogates_in_a_json_body_are_refused_even_as_json_escapes(server):
    """What a JSON encoder writes for a Python string with a lone surrogate (json.dumps escapes it)."""
    body = json.dumps({"prompt": "x\udc80", "max_tokens": 2})
    response = post(server, "completions", body)
    assert response.status_code == 400 and error_of(response)["param"] == "prompt"
