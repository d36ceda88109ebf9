"""Property-based: requests schemathesis derives from the server's own OpenAPI schema, valid
and deliberately invalid, never get a 5xx, and every error has OpenAI's shape."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

EXAMPLES_PER_MODE = 40


def _bound_cost(body: object) -> None:
    """Keep generation cheap: at most 2 choices of 3 tokens. Other fields keep what was drawn,
    and values of the wrong type stay wrong (negative cases must still be refused)."""
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(field)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 3):
            body[field] = 3
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("min_tokens"), int) and not isinstance(body["min_tokens"], bool):
        body["min_tokens"] = min(body["min_tokens"], 3)


def test_no_request_the_schema_describes_gets_a_server_error(server, auth):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}

    for operation in operations:
        # Only the POST routes take input that can be made invalid.
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (operation.method.upper() == "POST")
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def call(case) -> None:
                if case.path.startswith("/v1/"):
                    _bound_cost(case.body)
                response = case.call(base_url=server.url, headers=auth, timeout=120)
                summary = f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:500]}"
                assert response.status_code < 500, summary
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}, summary

            call()
