"""prompt_logprobs over HTTP, as vLLM 0.27.1 serves them, against a live `vllm-anatomy serve`
(default model, CPU, EngineCore in its own process), driven with raw httpx to read the JSON as sent.

The values are the LLM API's (RequestOutput.prompt_logprobs, the same model in this
process) for the same prompt tokens: per choice on /v1/completions, top-level on
/v1/chat/completions, the first position null, each position {token id:
{logprob, rank, decoded_token}}. Also: echo (completions: the prompt's tokens lead
the choice's logprobs; max_tokens 0 answers the prompt alone), n = 2 and batched
prompts, streams (any prompt logprobs asked for: 400; 0: accepted), bad values -> 400
naming the field.
"""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

API_KEY = "test-key"
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
MESSAGES = [{"role": "user", "content": "Name a color."}]
# NOTE: the server and this process compute the same logits with different batch
# shapes, so values may differ in the last bits; ranks and token ids must not.
ABS = 1e-4


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512", api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"{server.url}/v1", headers=AUTH, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def llm():
    from vllm_anatomy import LLM
    engine = LLM(max_model_len=512)
    yield engine
    engine.shutdown()


def reference(llm, prompt, k: int, chat: bool = False):
    """The LLM API's RequestOutput for this prompt with prompt_logprobs=k."""
    from vllm_anatomy import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    out = llm.chat(prompt, params, use_tqdm=False) if chat else llm.generate(prompt, params, use_tqdm=False)
    return out[0]


def assert_same(got: list, want: list, k: int) -> None:
    """JSON prompt_logprobs == the LLM API's, position by position; k top entries each."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for pos, (entry, ref) in enumerate(zip(got[1:], want[1:]), start=1):
        assert {int(t) for t in entry} == set(ref), pos
        for tid, lp in ref.items():
            sent = entry[str(tid)]
            assert set(sent) == {"logprob", "rank", "decoded_token"}
            assert sent["rank"] == lp.rank and sent["decoded_token"] == lp.decoded_token
            assert sent["logprob"] == pytest.approx(lp.logprob, abs=ABS)
        assert sum(1 for lp in entry.values() if lp["rank"] <= k) == k, pos   # the top-k, plus the scored token


def post(http, path: str, body: dict) -> httpx.Response:
    return http.post(path, json={"model": MODEL, **body})


def test_completion_prompt_logprobs_equal_the_llm_api(http, llm):
    r = post(http, "/completions", {"prompt": PROMPTS[0], "prompt_logprobs": 3, "max_tokens": 2,
                                    "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert len(choice["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    ref = reference(llm, PROMPTS[0], 3)
    assert_same(choice["prompt_logprobs"], ref.prompt_logprobs, 3)
    # The scored token of each position is the prompt's own token.
    assert [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]] == ref.prompt_token_ids[1:]
    assert choice["logprobs"] is None            # sample logprobs were not asked for
    plain = post(http, "/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    assert plain["choices"][0]["text"] == choice["text"]       # asking changes nothing else


def test_completion_n2_and_batched_prompts_each_choice_carries_its_prompts(http, llm):
    r = post(http, "/completions", {"prompt": PROMPTS, "n": 2, "prompt_logprobs": 2, "max_tokens": 3,
                                    "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]       # prompt index * n + output index
    for prompt_idx, prompt in enumerate(PROMPTS):
        ref = reference(llm, prompt, 2)
        for c in choices[2 * prompt_idx: 2 * prompt_idx + 2]:
            assert_same(c["prompt_logprobs"], ref.prompt_logprobs, 2)
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert len(choices[0]["prompt_logprobs"]) != len(choices[2]["prompt_logprobs"])


def test_chat_prompt_logprobs_are_top_level_and_equal_the_llm_api(http, llm):
    r = post(http, "/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 2, "max_tokens": 3,
                                         "temperature": 0, "n": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "prompt_logprobs" not in body["choices"][0]
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert_same(body["prompt_logprobs"], reference(llm, MESSAGES, 2, chat=True).prompt_logprobs, 2)
    # n = 2: the prompt's logprobs once, beside the two choices.
    two = post(http, "/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 2, "max_tokens": 3,
                                           "temperature": 1.0, "seed": 3, "n": 2}).json()
    assert len(two["choices"]) == 2
    assert_same(two["prompt_logprobs"], reference(llm, MESSAGES, 2, chat=True).prompt_logprobs, 2)


def test_chat_echo_asks_for_the_prompts_scored_tokens(http):
    """v0.27.1's rule: echo without prompt_logprobs asks for top_logprobs' k (0 by default)."""
    body = post(http, "/chat/completions", {"messages": MESSAGES, "echo": True, "max_tokens": 2,
                                            "temperature": 0}).json()
    plp = body["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(entry) == 1 for entry in plp[1:])              # the scored token only


def test_completion_echo_with_logprobs_covers_the_prompt(http, llm):
    body = post(http, "/completions", {"prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 3,
                                       "temperature": 0}).json()
    choice, lp = body["choices"][0], body["choices"][0]["logprobs"]
    num_prompt = body["usage"]["prompt_tokens"]
    plain = post(http, "/completions", {"prompt": PROMPTS[0], "logprobs": 2, "max_tokens": 3,
                                        "temperature": 0}).json()["choices"][0]
    assert choice["text"] == PROMPTS[0] + plain["text"]
    assert len(lp["tokens"]) == num_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None     # nothing precedes it
    ref = reference(llm, PROMPTS[0], 2)
    for pos in range(1, num_prompt):
        tid = ref.prompt_token_ids[pos]
        assert lp["token_logprobs"][pos] == pytest.approx(ref.prompt_logprobs[pos][tid].logprob, abs=ABS)
        assert len(lp["top_logprobs"][pos]) in (2, 3)             # top-2 and the prompt's token
    assert lp["tokens"][num_prompt:] == plain["logprobs"]["tokens"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert_same(choice["prompt_logprobs"], ref.prompt_logprobs, 2)   # also per choice, as v0.27.1
    # Streamed: the same tokens, logprobs and offsets, the prompt's in the first chunk.
    chunks = stream(http, "/completions", {"prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 3,
                                           "temperature": 0})
    joined = {key: [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "text_offset")}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=ABS)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_completion_echo_with_max_tokens_zero_scores_the_prompt_alone(http, llm):
    """The evaluation harnesses' request: the prompt back with its logprobs, nothing generated."""
    body = post(http, "/completions", {"prompt": PROMPTS[1], "echo": True, "logprobs": 1, "max_tokens": 0,
                                       "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPTS[1] and choice["finish_reason"] == "length"
    ref = reference(llm, PROMPTS[1], 1)
    assert len(choice["logprobs"]["tokens"]) == len(ref.prompt_token_ids) == body["usage"]["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i], abs=ABS)
    assert body["usage"]["completion_tokens"] == 1      # the token the engine ran (v0.27.1 counts it too)
    chunks = stream(http, "/completions", {"prompt": PROMPTS[1], "echo": True, "logprobs": 1, "max_tokens": 0,
                                           "temperature": 0})
    assert [c["choices"][0]["text"] for c in chunks] == [PROMPTS[1]]


def stream(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": PROMPTS[0]}),
    ("/chat/completions", {"messages": MESSAGES}),
])
def test_streams_refuse_prompt_logprobs_but_take_zero(http, path, body):
    for k in (1, -1):
        r = post(http, path, {**body, "stream": True, "prompt_logprobs": k, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_logprobs"
        assert "not available when `stream=True`" in r.json()["error"]["message"]
    chunks = stream(http, path, {**body, "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0})
    assert chunks and all("prompt_logprobs" not in c and all("prompt_logprobs" not in ch for ch in c["choices"])
                          for c in chunks)


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": PROMPTS[0]}),
    ("/chat/completions", {"messages": MESSAGES}),
])
@pytest.mark.parametrize("value, words", [
    (-2, "must be a positive value or -1"),
    (21, "prompt_logprobs"),                   # past max_logprobs (20)
    (-1, "greater than max allowed: 20"),      # the whole vocabulary, as v0.27.1 under its default
    ("3", "prompt_logprobs"),
    (True, "prompt_logprobs"),
    (2.5, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_400_naming_the_field(http, path, body, value, words):
    r = post(http, path, {**body, "prompt_logprobs": value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and words in error["message"], error
    ok = post(http, path, {**body, "max_tokens": 2, "temperature": 0})         # and the server is fine
    assert ok.status_code == 200, ok.text
