"""Structured output through the official `openai` client against `vllm-anatomy serve`
(three processes, real model, CPU), with sync and with async scheduling:
response_format json_schema (plain and streamed) parses and validates against
its schema, json_object parses to an object, vLLM's structured_outputs choice
and regex are obeyed, and a schema xgrammar cannot compile is a 400 carrying
the compiler's message, the server serving on.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


@pytest.fixture(scope="module", params=["sync", "async"])
def server(request):
    args = ["--served-model-name", MODEL, "--max-model-len", "512"]
    with RemoteOpenAIServer(*args, *(["--async-scheduling"] if request.param == "async" else [])) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=180)


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=120,
                                       response_format=RESPONSE_FORMAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_schema_streamed_validates(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.7, seed=5, max_tokens=120,
                                            response_format=RESPONSE_FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_parses(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}],
        temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_choice_and_regex_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="The best color is", max_tokens=8, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)


def test_invalid_schema_is_a_400_with_the_compilers_message(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=bad,
                                           stream=stream)
        assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
        assert 'Unsupported type "nonsense"' in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs" and "regex" in e.value.body["message"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length"          # still serving
