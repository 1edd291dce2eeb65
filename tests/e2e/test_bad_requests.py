"""Issue 14, held to the edge: every bad field gets a 4xx OpenAI error object (never
a 500, never a dead engine), and the server still answers a good request after it.

A live `vllm-anatomy serve` (default model, CPU, EngineCore in its own process),
driven with raw httpx (to send what the `openai` client would not: NaN literals,
lone surrogates, 2**64) and with the official `openai` client. Then, in process
(the tiny random Llama), what cannot be provoked from outside: a request that
fails inside a step fails alone while a concurrent one completes, and a slow
tokenization does not block /health.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from server_utils import RemoteOpenAIServer

API_KEY = "test-key"
MODEL = "smol"
VOCAB = 49152                      # SmolLM2's vocabulary: ids 0..49151
BODY_LIMIT = 1_000_000
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512",
                            "--max-request-body-bytes", str(BODY_LIMIT),
                            "--allowed-origins", "http://localhost:3000", api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200


def post_raw(server, route: str, raw_json: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", content=raw_json.encode(), timeout=60,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


CHAT = '"messages": [{"role": "user", "content": "Hi"}]'
# (route, JSON body written by hand, the `param` the 400 must name)
BAD_BODIES = [
    # The crash: min-tokens masking indexed past the vocabulary; engine dead for good.
    ("completions", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [999999]}', "stop_token_ids"),
    ("completions", f'{{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [{VOCAB}]}}',
     "stop_token_ids"),
    ("chat/completions", f'{{{CHAT}, "min_tokens": 1, "stop_token_ids": [{VOCAB}]}}', "stop_token_ids"),
    ("completions", '{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', "stop_token_ids.0"),
    ("completions", '{"prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids.0"),
    # Integers outside 64 bits.
    ("completions", '{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("completions", '{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
    ("chat/completions", f'{{{CHAT}, "seed": 99999999999999999999999}}', "seed"),
    ("completions", '{"prompt": "hi", "max_tokens": 1180591620717411303424}', "max_tokens"),
    ("completions", '{"prompt": "hi", "top_k": 1180591620717411303424}', "top_k"),
    # Floats must be finite (Python's json accepts these literals).
    ("completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("completions", '{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("chat/completions", f'{{{CHAT}, "min_p": -Infinity}}', "min_p"),
    ("completions", '{"prompt": "hi", "temperature": 2.5}', "temperature"),
    # Token ids in the prompt and in logit_bias.
    ("completions", f'{{"prompt": [1, 2, {VOCAB}]}}', "prompt"),
    ("completions", '{"prompt": [1, -2]}', "prompt.1"),
    ("completions", '{"prompt": [[1, 18446744073709551616]]}', "prompt.0.1"),
    ("completions", f'{{"prompt": "hi", "logit_bias": {{"{VOCAB}": 5}}}}', "logit_bias"),
    ("completions", '{"prompt": "hi", "logit_bias": {"not-an-id": 5}}', "logit_bias"),
    ("chat/completions", f'{{{CHAT}, "logit_bias": {{"12": NaN}}}}', "logit_bias.12"),
    # Text that cannot be encoded (lone surrogates).
    ("completions", '{"prompt": "hi \\ud800 there"}', "prompt"),
    ("completions", '{"prompt": ["\\udfff"]}', "prompt.0"),
    ("completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages.0.content"),
    ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}', "messages.0.name"),
    # Refused, not silently ignored.
    ("chat/completions", f'{{{CHAT}, "tools": [{{"type": "function", "function": {{"name": "f"}}}}]}}', "tools"),
    ("chat/completions", f'{{{CHAT}, "tool_choice": "auto"}}', "tool_choice"),
    # A JSON schema xgrammar cannot compile.
    ("chat/completions", f'{{{CHAT}, "response_format": {{"type": "json_schema", "json_schema": '
                         f'{{"name": "x", "schema": {{"type": "nonsense"}}}}}}}}', "response_format"),
    ("completions", f'{{"prompt": "hi", "allowed_token_ids": [1, {VOCAB}]}}', "allowed_token_ids"),
    ("completions", '{"prompt": "hi", "min_tokens": 5, "max_tokens": 2}', "min_tokens"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route, body, param", BAD_BODIES)
def test_bad_field_is_a_400_and_the_server_lives(server, route, body, param, stream):
    if stream:
        body = body[:-1] + ', "stream": true}'
    # NOTE: a stream is validated before its 200: the same JSON error, no SSE.
    assert_openai_error(post_raw(server, route, body), 400, param)
    assert_still_serving(server)


def test_the_official_client_gets_bad_request_errors(server, client):
    calls = [
        ("stop_token_ids", lambda: client.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, extra_body={"min_tokens": 2, "stop_token_ids": [VOCAB]})),
        ("seed", lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=2**64)),
        ("logit_bias", lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], logit_bias={str(VOCAB + 1): 1})),
        ("tools", lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("response_format", lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})),
        # Streamed: refused before the 200 (the client cannot send lone surrogates: raw httpx does).
        ("stop_token_ids", lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_body={"min_tokens": 1, "stop_token_ids": [10**6]})),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.body["param"] == param, (param, e.value.body)
        assert_still_serving(server)
    # response_format "text" constrains nothing: accepted.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_logit_bias_is_applied(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert client.completions.create(**kw).choices[0].text != ",,,"
    assert client.completions.create(**kw, logit_bias={"28": 100}).choices[0].text == ",,,"   # 28 is ","


def test_tiny_top_p_samples_the_top_token(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for seed in (1, 2, 3):
        r = client.completions.create(**kw, temperature=1.0, top_p=1e-50, seed=seed)
        assert r.choices[0].text == greedy and "<|endoftext|>" not in r.choices[0].text


def test_body_over_the_limit_is_a_413_even_streamed(server):
    big = json.dumps({"model": MODEL, "prompt": "a" * (BODY_LIMIT + 10)}).encode()
    url, headers = f"{server.url}/v1/completions", {**AUTH, "Content-Type": "application/json"}
    err = assert_openai_error(httpx.post(url, content=big, headers=headers, timeout=60), 413)
    assert str(BODY_LIMIT) in err["message"] and err["type"] == "RequestTooLargeError"

    def chunks():                  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]
    assert_openai_error(httpx.post(url, content=chunks(), headers=headers, timeout=60), 413)
    assert_still_serving(server)


def test_text_too_long_for_the_model_is_refused_before_tokenizing(server):
    # Under the body limit, but more characters than 512 tokens can hold.
    r = post_raw(server, "completions", json.dumps({"prompt": "x" * 900_000}))
    err = assert_openai_error(r, 400, "prompt")
    assert "characters" in err["message"]
    assert_still_serving(server)


def test_same_x_request_id_twice_both_succeed(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers={**AUTH, "X-Request-Id": "same-id"},
                                     timeout=60) as c:
            body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2)))
    for r in asyncio.run(run()):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-same-id" and r.json()["usage"]["completion_tokens"] == 12
    too_long = post_raw(server, "completions", '{"prompt": "hi", "max_tokens": 1}', {"X-Request-Id": "x" * 129})
    assert_openai_error(too_long, 400, "X-Request-Id")


def test_api_key_scheme_and_cors_preflight(server):
    url = f"{server.url}/v1/models"
    assert httpx.get(url, headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"BEARER {API_KEY}"}).status_code == 200
    for bad in (f"Basic {API_KEY}", "Bearer wrong", f"Bearer {API_KEY}x", "", f"Bearer{API_KEY}"):
        assert_openai_error(httpx.get(url, headers={"Authorization": bad}), 401)
    # A browser's preflight carries no key; CORS answers it (--allowed-origins).
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


# -- in process (the tiny random Llama): failures inside a step, tokenizer off the loop ----------
@pytest.fixture
def inproc_app(tiny_llama_dir):
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.engine.async_llm import AsyncLLM
    from vllm_anatomy.entrypoints.openai.api_server import build_app

    llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, device="cpu", max_model_len=128,
                                               block_size=8, num_gpu_blocks_override=64), multiprocess=False)
    app = build_app(llm, argparse.Namespace(served_model_name=["tiny"], model=None, api_key=None))
    yield llm, app
    llm.shutdown()


POISON = 7        # a prompt starting with this token id fails while joining the batch


def test_request_failing_inside_a_step_fails_alone(inproc_app, monkeypatch):
    """Fault injection in the worker (what no client input can reach any more):
    the poisoned requests get a 500 OpenAI error (a stream: an error event), a
    concurrent stream completes, and the engine serves the next request."""
    from vllm_anatomy.worker.gpu_input_batch import InputBatch
    llm, app = inproc_app
    check = InputBatch._check_request
    batch_sizes_at_failure = []

    def poisoned_check(self, request):
        if request.prompt_token_ids[0] == POISON:
            batch_sizes_at_failure.append(self.num_reqs)
            raise RuntimeError("injected fault while building the request's row")
        check(self, request)
    monkeypatch.setattr(InputBatch, "_check_request", poisoned_check)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            good = {"prompt": [5, 6, 7, 8], "max_tokens": 100, "ignore_eos": True, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            bad = {"prompt": [POISON, 9, 10], "max_tokens": 4, "temperature": 0}

            async def stream_text() -> tuple[list[dict], str]:
                async with c.stream("POST", "/v1/completions", json=good) as r:
                    assert r.status_code == 200
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                return [json.loads(e) for e in events[:-1]], events[-1]
            good_task = asyncio.create_task(stream_text())
            while not llm.engine_core.engine_core.scheduler.running:
                await asyncio.sleep(0.005)                 # the good stream is running
            plain = await c.post("/v1/completions", json=bad)
            streamed = await c.post("/v1/completions", json={**bad, "stream": True})
            chunks, done = await good_task
            after = await c.post("/v1/completions", json={**good, "stream": False, "stream_options": None})
            health = await c.get("/health")
            assert not llm.errored
            return plain, streamed, chunks, done, after, health

    plain, streamed, chunks, done, after, health = asyncio.run(run())
    err = assert_openai_error(plain, 500)
    assert err["type"] == "InternalServerError" and "failed inside the engine" in err["message"]
    assert streamed.status_code == 200                     # validated fine: the failure came later
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["type"] == "InternalServerError" and events[-1] == "[DONE]"
    assert done == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 100
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert batch_sizes_at_failure and batch_sizes_at_failure[0] >= 1     # the good one shared the step
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 100
    assert health.status_code == 200


def test_tokenization_does_not_block_the_event_loop(inproc_app, monkeypatch):
    """A tokenization that takes 1.5 s (slowed on purpose) runs in the tokenizer
    thread: /health answers meanwhile, in milliseconds."""
    llm, app = inproc_app
    tokenizer = llm.get_tokenizer()
    encode = tokenizer.encode
    threads = []

    def slow_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(1.5)
        return encode(*args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "t5 t6 t7", "max_tokens": 2}))
            await asyncio.sleep(0.3)                       # the slow tokenization is under way
            latencies = []
            for _ in range(5):
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
            assert not slow.done()
            return latencies, await slow
    latencies, slow = asyncio.run(run())
    assert slow.status_code == 200, slow.text
    assert threads and all(name.startswith("tokenizer") for name in threads)
    assert max(latencies) < 0.5, latencies
