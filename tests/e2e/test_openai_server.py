"""The OpenAI-compatible server, driven by the official `openai` client against a live
`vllm-anatomy serve` subprocess (EngineCore in its own process, real model, CPU).

One server for the whole module. Greedy decoding everywhere output text is
compared, so the expected text is what the same server answers without streaming.
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server_utils import RemoteOpenAIServer, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.slow]

API_KEY = "test-key"
MODEL = "smol"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512",
                            api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, content=QUESTION, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_models_health_version(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_non_stream_and_usage(client):
    r = chat(client, max_tokens=16)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens > 10      # the template adds a system message
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    full = chat(client, max_tokens=12)
    stream = chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completion_max_tokens_stream_and_non_stream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 5
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_completion_token_ids_prompt_and_echo(client, server):
    tok_prompt = [504, 3575, 282, 4649, 314]   # any in-vocabulary ids
    r = client.completions.create(model=MODEL, prompt=tok_prompt, max_tokens=3, temperature=0, echo=True)
    assert r.usage.prompt_tokens == len(tok_prompt)
    plain = client.completions.create(model=MODEL, prompt=tok_prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text.endswith(plain.choices[0].text) and len(r.choices[0].text) > len(plain.choices[0].text)


def test_stop_strings(client):
    base = chat(client, max_tokens=16).choices[0].message.content   # "The capital of France is Paris."
    word = "Paris" if "Paris" in base else base.split()[2]
    r = chat(client, max_tokens=16, stop=[word])
    assert r.choices[0].message.content == base[:base.index(word)]
    assert r.choices[0].finish_reason == "stop"
    # Streaming holds back partial matches and stops at the same place.
    text = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=16, stop=word, stream=True)
                   if c.choices)
    assert text == base[:base.index(word)]


def test_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds all gave the same 12 sampled tokens"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()))     # greedy: the sampled token is the best


def test_chat_logprobs(client):
    r = chat(client, max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_64_concurrent_streams(server, client):
    prompts = ["What is the capital of France?", "Name a color.", "What do bees make?", "Say hello."]
    expected = {p: chat(client, p, max_tokens=8).choices[0].message.content for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i: int) -> tuple[str, str]:
        p = prompts[i % len(prompts)]
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=8, stream=True)
        return p, "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert all(text == expected[p] for p, text in results)
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    # Finished requests' blocks are free (cached ones count as free).
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m['vllm:request_success_total{finished_reason="length"}'] + \
        m['vllm:request_success_total{finished_reason="stop"}'] >= 64
    assert m["vllm:generation_tokens_total"] >= 64
    assert m["vllm:time_to_first_token_seconds_count"] >= 64


def test_disconnect_mid_stream_aborts(server):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]      # a few chunks: the request is running
            during = server.metrics()
            assert any(line.startswith("data: {") for line in got)
    # Closing the connection closed the generator: the engine aborted the request.
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
    m = wait_idle(server, timeout=5)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0


def test_bad_api_key_401(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics").status_code == 200   # probes stay open


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),          # wrong type: 400, never 422
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "hi " * 600}, "prompt"),                             # longer than max_model_len
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({}, "prompt"),
])
def test_bad_values_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["message"]


def test_malformed_json_and_bad_chat_400(server):
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [', headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                   headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.role")
