"""`vllm-anatomy serve --speculative-config ...`: a real server (engine in its own process, the
drafts crossing the executor's take_draft_token_ids) answers a chat request with the same
tokens as a server without speculation, /metrics has vLLM's four spec-decode counters with the
step's drafts counted, and min_p / logit_bias are refused with 400 (as v0.27.1 refuses them)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
COPY = "Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn."
SPEC_NAMES = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"}


def _chat(server, **extra):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=180)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}],
                                         temperature=0, max_tokens=32, **extra)
    return out.choices[0].message.content


def _value(families, name: str) -> float:
    return sum(s.value for s in families[name].samples if s.name == name + "_total")


def test_server_with_ngram():
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512") as plain:
        want = _chat(plain)
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "512",
                            "--speculative-config", NGRAM) as server:
        assert _chat(server) == want
        deadline = time.monotonic() + 30
        while True:
            families = {f.name: f for f in text_string_to_metric_families(
                httpx.get(f"{server.url}/metrics", timeout=10).text)}
            if _value(families, "vllm:spec_decode_num_drafts") > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert SPEC_NAMES <= set(families)
        assert _value(families, "vllm:spec_decode_num_drafts") > 0
        assert 0 < _value(families, "vllm:spec_decode_num_accepted_tokens") \
            <= _value(families, "vllm:spec_decode_num_draft_tokens")
        positions = {s.labels["position"] for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
        assert positions == {"0", "1", "2"}
        for bad in ({"extra_body": {"min_p": 0.1}}, {"logit_bias": {"5": 1.0}}):
            with pytest.raises(openai.BadRequestError, match="speculative decoding"):
                _chat(server, **bad)
