"""The bounds on a structured-output constraint (structured_output/limits.py, issue 29):
each one gives a 400 naming structured_outputs and saying the number, before any
compiler or recursive walk sees the constraint; just inside each bound is accepted.
"""
from __future__ import annotations

import json
import time

import pytest

from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_anatomy.structured_output import limits


def verify(**constraint) -> None:
    SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)).verify(50_000)


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def optional_properties(n: int, required: int = 0) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
            "required": [f"p{i}" for i in range(required)]}


def refused(match: str, **constraint) -> None:
    with pytest.raises(VLLMValidationError, match=match) as info:
        verify(**constraint)
    assert info.value.parameter == "structured_outputs"


def test_schema_depth():
    verify(json=nested_arrays(limits.MAX_JSON_SCHEMA_DEPTH // 2 - 1))     # 2 JSON levels per array
    refused(f"more than {limits.MAX_JSON_SCHEMA_DEPTH} levels", json=nested_arrays(300))


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_deeper_than_pythons_recursion_limit_is_refused_quickly(as_text):
    """No RecursionError ("maximum recursion depth exceeded") whatever the depth."""
    deep: dict = {}
    for _ in range(100_000):
        deep = {"items": deep}
    spec = '{"items": ' * 5000 + "{}" + "}" * 5000 if as_text else deep
    t0 = time.monotonic()
    refused("levels deep", json=spec)
    assert time.monotonic() - t0 < 10


def test_schema_size():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                            for i in range(600)},
           "required": [f"p{i}" for i in range(600)]}
    refused(f"at most {limits.MAX_GRAMMAR_SPEC_BYTES} bytes|larger than {limits.MAX_GRAMMAR_SPEC_BYTES}", json=big)
    refused(f"at most {limits.MAX_GRAMMAR_SPEC_BYTES} bytes", json=json.dumps(big))
    refused("at most", grammar='root ::= "' + "a" * limits.MAX_GRAMMAR_SPEC_BYTES + '"')


def test_optional_properties_per_object():
    verify(json=optional_properties(limits.MAX_OPTIONAL_PROPERTIES))
    refused(f"{limits.MAX_OPTIONAL_PROPERTIES + 1} optional properties",
            json=optional_properties(limits.MAX_OPTIONAL_PROPERTIES + 1))
    # Required properties do not count.
    verify(json=optional_properties(limits.MAX_OPTIONAL_PROPERTIES + 100, required=100))


def test_choices():
    verify(choice=[str(i) for i in range(limits.MAX_CHOICES)])
    refused(f"at most {limits.MAX_CHOICES}", choice=[str(i) for i in range(limits.MAX_CHOICES + 1)])


def test_regex_repetition_counts():
    verify(regex="[a-z]{0,%d}" % limits.MAX_REGEX_REPETITION)
    refused("repetition count", regex="[a-z]{0,%d}" % (limits.MAX_REGEX_REPETITION + 1))
    refused("repetition count", regex="x{5000}")
    refused("pattern", json={"type": "string", "pattern": "[a-z]{2000,}"})
