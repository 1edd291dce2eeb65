"""n choices, batched prompts and the sampling parameters over HTTP, against a live
`vllm-anatomy serve` (default model, CPU, EngineCore in its own process), with the
official `openai` client and raw httpx.

Seeded sampling makes streamed and plain answers comparable: choice i of a
request with seed s is sampled with seed s + i (vLLM's rule), whatever else is
in the batch, so a stream's deltas, joined per index, equal the plain answer.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_utils import RemoteOpenAIServer, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.slow]

API_KEY = "test-key"
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VOCAB = 49152
MESSAGES = [{"role": "user", "content": "Tell me a fact about the moon."}]


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512", api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


def test_chat_n_choices_plain_and_streamed(client):
    kw = dict(model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=1234, max_tokens=12)
    plain = client.chat.completions.create(**kw)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    texts = [c.message.content for c in plain.choices]
    assert len(set(texts)) == 3, f"three seeds, three samples: {texts}"
    assert plain.usage.completion_tokens > 12 * 2 and plain.usage.prompt_tokens > 5
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == texts
    streamed: dict[int, str] = {}
    roles, finishes = [], {}
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == [0, 1, 2] and [streamed[i] for i in range(3)] == texts
    assert set(finishes) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_completions_n_plain_and_streamed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7, max_tokens=10)
    plain = client.completions.create(**kw)
    assert [c.index for c in plain.choices] == [0, 1] and plain.choices[0].text != plain.choices[1].text
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in plain.choices]


def test_batched_prompts(client, server):
    prompts = ["The capital of France is", "def add(a, b):"]
    singles = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # Token-id prompts, n = 2 each: choice = prompt index * n + output index.
    ids = [[504, 3575, 282, 4649, 314], [1672, 17967]]
    kw = dict(model=MODEL, prompt=ids, n=2, temperature=1.0, seed=3, max_tokens=6)
    plain = client.completions.create(**kw)
    assert [c.index for c in plain.choices] == [0, 1, 2, 3]
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in plain.choices]
    # Echo: each choice starts with its own prompt.
    echo = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=3, echo=True)
    assert [c.text.startswith(p) for c, p in zip(echo.choices, prompts)] == [True, True]
    assert wait_idle(server, timeout=20)["vllm:num_requests_running"] == 0


def test_sampling_parameters_are_accepted_and_used(client, default_model_dir):
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    tok = get_tokenizer(default_model_dir)
    base = dict(model=MODEL, prompt="one two three four one two three four", temperature=0, max_tokens=12)
    plain = client.completions.create(**base).choices[0].text
    penalized = client.completions.create(**base, frequency_penalty=1.5, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5}).choices[0].text
    assert penalized != plain
    # allowed_token_ids: only these ids can come out.
    allowed = [504, 3575, 282]
    r = client.completions.create(**base, extra_body={"allowed_token_ids": allowed}, logprobs=0)
    assert len(r.choices[0].logprobs.tokens) == 12
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([i]) for i in allowed}
    # bad_words: the first word of the plain answer cannot appear.
    first_word = plain.split()[0]
    r = client.completions.create(**base, extra_body={"bad_words": [first_word]})
    assert first_word not in r.choices[0].text.split()
    r = client.completions.create(**{**base, "temperature": 0.8}, extra_body={"min_p": 0.2}, seed=1)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 2, "temperature": 0}, "n"),      # greedy n > 1 (vLLM refuses too)
    ("chat/completions", {"messages": MESSAGES, "n": 3, "temperature": 0}, "n"),
    ("completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("completions", {"prompt": ["hi", ""]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [1, VOCAB]]}, "prompt"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "bad_words": [""]}, "bad_words"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_values_are_400_before_anything_runs(server, route, body, param, stream):
    r = httpx.post(f"{server.url}/v1/{route}", headers=AUTH, timeout=60,
                   json={"model": MODEL, "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_closing_a_stream_aborts_every_choice(server):
    body = {"model": MODEL, "prompt": ["Write a long story.", "Count to a thousand:"], "n": 3,
            "temperature": 1.0, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) >= 2:
                break                  # hang up with six requests running
    m = wait_idle(server, timeout=20)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
