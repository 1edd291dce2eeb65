"""How large a structured-output constraint may be: checked before any compiler sees it.

Ours, not vLLM's (v0.27.1 hands any constraint within the body limit to xgrammar).
Each bound is a number a learner can read here, in the docs (docs/architecture.md,
"Structured output, stop strings and slow clients under attack") and in the 400 it
produces. Why each one exists, measured with xgrammar 0.2.9 and SmolLM2's 49,152-token
vocabulary on a 2-core CPU:

  * MAX_GRAMMAR_SPEC_BYTES: one constraint's text (the JSON schema as JSON, the
    regex, the EBNF grammar, or all choices together). 64 KiB holds any hand-written
    schema; the 57 KB "2,000 optional properties" schema took 48 s to compile.
  * MAX_JSON_SCHEMA_DEPTH: nesting of objects/arrays in the schema document. xgrammar's
    schema parser is superlinear in depth (300 nested arrays, 600 levels: 4 s to parse;
    32 nested arrays: 7 ms), and Python's own recursion limit (~1,000 frames) is
    reached by anything that walks a schema recursively. The walk here is iterative.
  * MAX_OPTIONAL_PROPERTIES: optional properties of one object. xgrammar compiles
    "any subset, in order" of them into a grammar that grows quadratically: 200 take
    0.14 s, 400 0.46 s, 800 4 s, 2,000 48 s. (OpenAI's strict mode requires every
    property to be required, for the same reason.)
  * MAX_CHOICES: strings of a `choice` constraint.
  * MAX_REGEX_REPETITION: the m and n of a bounded repetition {m,n} in a regex (also a
    JSON schema's "pattern"). xgrammar expands it: [a-z]{0,1000} takes ~1.3 s to
    compile against the vocabulary, [a-z]{0,5000} 2.6-5 s.

What passes these bounds can still be slow in ways no size bound predicts: the
compile's CPU-time budget (StructuredOutputManager, VLLM_ANATOMY_GRAMMAR_COMPILE_TIMEOUT_S)
is the backstop, and compiles run at a lower CPU priority (compile_executor.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

from vllm_anatomy.exceptions import VLLMValidationError

MAX_GRAMMAR_SPEC_BYTES = 64 * 1024
MAX_JSON_SCHEMA_DEPTH = 64
MAX_OPTIONAL_PROPERTIES = 256
MAX_CHOICES = 1024
MAX_REGEX_REPETITION = 1000

# {m}, {m,} or {m,n} (the counts are checked; other braces are literal characters).
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _refuse(message: str) -> VLLMValidationError:
    return VLLMValidationError(message, parameter="structured_outputs")


def check_structured_output_limits(so: Any) -> None:
    """Raise VLLMValidationError (a 400) if the constraint `so` (StructuredOutputsParams)
    exceeds a bound above. Cheap: one pass over the constraint, no recursion."""
    if so.json is not None:
        check_json_schema_limits(so.json)
    elif so.regex is not None:
        _check_spec_size(len(so.regex.encode("utf-8", "surrogatepass")), "regex")
        check_regex_limits(so.regex)
    elif so.grammar is not None:
        _check_spec_size(len(so.grammar.encode("utf-8", "surrogatepass")), "grammar")
    elif so.choice is not None:
        if len(so.choice) > MAX_CHOICES:
            raise _refuse(f"structured_outputs.choice has {len(so.choice)} strings; at most "
                          f"{MAX_CHOICES} are accepted.")
        _check_spec_size(sum(len(c.encode("utf-8", "surrogatepass")) + 3 for c in so.choice
                             if isinstance(c, str)), "choice")


def _check_spec_size(num_bytes: int, what: str) -> None:
    if num_bytes > MAX_GRAMMAR_SPEC_BYTES:
        raise _refuse(f"The structured_outputs {what} is {num_bytes} bytes; at most "
                      f"{MAX_GRAMMAR_SPEC_BYTES} bytes are accepted.")


def check_regex_limits(regex: str, where: str = "regex") -> None:
    """Every bounded repetition {m,n} at most MAX_REGEX_REPETITION."""
    for match in _REPETITION.finditer(regex):
        counts = [int(c) for c in match.groups() if c]
        if counts and max(counts) > MAX_REGEX_REPETITION:
            raise _refuse(f"The structured_outputs {where} repeats {match.group(0)!r}; a repetition "
                          f"count may be at most {MAX_REGEX_REPETITION}.")


def check_json_schema_limits(schema: str | dict) -> None:
    """A JSON schema (its text or the parsed dict) within every bound above.

    NOTE: the depth is checked before anything recursive (json.dumps, xgrammar,
    the unsupported-keyword scan) sees the schema: an iterative walk, stopping at
    the first node past a bound, so a deep or huge schema costs little to refuse.
    """
    if isinstance(schema, str):
        _check_spec_size(len(schema.encode("utf-8", "surrogatepass")), "json schema")
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _depth_error() from None      # (C's json decoder: ~1,000 levels)
        except json.JSONDecodeError:
            return      # not JSON: the validation that follows says so
    stack: list[tuple[Any, int]] = [(schema, 1)]
    num_bytes = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_SCHEMA_DEPTH:
            raise _depth_error()
        if isinstance(node, dict):
            num_bytes += 2
            _check_object_properties(node)
            for key, value in node.items():
                num_bytes += len(str(key)) + 4
                if key == "pattern" and isinstance(value, str):
                    check_regex_limits(value, "json schema's pattern")
                _push(stack, value, depth)
        elif isinstance(node, list):
            num_bytes += 2
            for value in node:
                _push(stack, value, depth)
        else:
            num_bytes += len(node) + 2 if isinstance(node, str) else 8
        if num_bytes > MAX_GRAMMAR_SPEC_BYTES:
            raise _refuse(f"The structured_outputs json schema is larger than {MAX_GRAMMAR_SPEC_BYTES} bytes.")


def _push(stack: list[tuple[Any, int]], value: Any, depth: int) -> None:
    stack.append((value, depth + 1 if isinstance(value, (dict, list)) else depth))


def _check_object_properties(node: dict) -> None:
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return
    required = node.get("required")
    required_names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    num_optional = sum(1 for name in properties if name not in required_names)
    if num_optional > MAX_OPTIONAL_PROPERTIES:
        raise _refuse(f"An object of the structured_outputs json schema has {num_optional} optional "
                      f"properties; at most {MAX_OPTIONAL_PROPERTIES} are accepted (list the others "
                      f"in 'required', or split the object).")


def _depth_error() -> VLLMValidationError:
    return _refuse(f"The structured_outputs json schema nests objects and arrays more than "
                   f"{MAX_JSON_SCHEMA_DEPTH} levels deep.")

