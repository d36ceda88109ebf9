"""The ranges the API schema publishes agree with what the engine's SamplingParams accepts."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from tuili.server.generation import sampling_params
from tuili.server.protocol import CompletionRequest


def _bounds() -> list[tuple[str, str, float]]:
    """(field, "min" or "max", the most extreme value the schema accepts) for every bound."""
    bounds = []
    for name, prop in CompletionRequest.model_json_schema()["properties"].items():
        for variant in prop.get("anyOf", [prop]):
            integer = variant.get("type") == "integer"
            step = 1 if integer else None
            if "minimum" in variant:
                bounds.append((name, "min", variant["minimum"]))
            if "exclusiveMinimum" in variant:
                low = variant["exclusiveMinimum"]
                bounds.append((name, "min", low + step if integer else math.nextafter(low, math.inf)))
            if "maximum" in variant:
                bounds.append((name, "max", variant["maximum"]))
            if "exclusiveMaximum" in variant:
                high = variant["exclusiveMaximum"]
                bounds.append((name, "max", high - step if integer else math.nextafter(high, -math.inf)))
    return bounds


BOUNDS = _bounds()


def test_the_schema_declares_the_sampling_ranges():
    assert {name for name, _, _ in BOUNDS} >= {
        "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
        "repetition_penalty", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs",
    }


@pytest.mark.parametrize(("field", "side", "value"), BOUNDS, ids=[f"{f}-{s}" for f, s, _ in BOUNDS])
def test_every_boundary_value_the_schema_accepts_the_engine_accepts(field, side, value):
    request = CompletionRequest.model_validate({"prompt": "hi", field: value})
    params = sampling_params(request, request.max_tokens, request.logprobs)
    params.validate()


@pytest.mark.parametrize(("field", "side", "value"), BOUNDS, ids=[f"{f}-{s}" for f, s, _ in BOUNDS])
def test_one_step_past_a_boundary_is_refused_naming_the_field(field, side, value):
    if isinstance(value, int) and not isinstance(value, bool):
        past = value - 1 if side == "min" else value + 1
    else:
        past = math.nextafter(value, -math.inf if side == "min" else math.inf)
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", field: past})
    assert info.value.errors()[0]["loc"][0] == field
