"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis).

Schema-valid bodies for every route, against a live server: whatever comes in,
the answer is never a 5xx (bad values are 4xx OpenAI errors). A tiny
--max-model-len bounds every generation, so each example costs at most ~2 s.

NOTE: schemathesis' pytest plugin (`schemathesis.pytest.from_fixture`) does not
work with pytest 9 here, so the operations are driven with hypothesis directly.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

OPERATIONS = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health",
              "GET /version", "GET /metrics"]


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("--max-model-len", "64") as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_schema_lists_all_routes(api_schema):
    found = {f"{op.method.upper()} {op.path}" for op in (r.ok() for r in api_schema.get_all_operations())}
    assert set(OPERATIONS) <= found


@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_server_errors(api_schema, server, operation):
    method, path = operation.split(" ")
    op = api_schema[path][method]
    examples = 20 if method == "POST" else 3

    @given(case=op.as_strategy())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        if method == "POST":   # anything refused is an OpenAI error body, not FastAPI's 422
            assert response.status_code in (200, 400, 404), response.text
            if response.status_code != 200:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
