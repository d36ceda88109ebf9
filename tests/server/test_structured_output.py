"""Structured output through the official openai client against a real `tuili serve`:
response_format (json_object, json_schema), vLLM's structured_outputs and guided_* fields, on
both endpoints; every answer parses and validates, whatever batch it was decoded in."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

# Bounded strings and arrays: greedy decoding of a 135M model must complete within max_tokens.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12},
                "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                              "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                            "required": ["city", "zip"], "additionalProperties": False},
            }, "required": ["name", "address"], "additionalProperties": False},
        },
        "required": ["user"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "minItems": 2, "maxItems": 4},
                       "names": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["scores", "names"], "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer", "minimum": 1900,
                                                                              "maximum": 2100},
                       "rating": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["title"], "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                       "ok": {"type": "boolean"}},
        "required": ["phone", "ok"], "additionalProperties": False,
    },
}
PROMPT = "Describe the data you are asked for as JSON."


def _chat(client, model_name, **kw):
    return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=120, temperature=0, **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate(client, model_name, name):
    schema = SCHEMAS[name]
    response = _chat(client, model_name, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_batch_of_constrained_and_free_requests(async_client, model_name):
    """All schemas at once (one decode batch, mixed with free and other constrained rows),
    on both endpoints and in all three spellings."""

    async def run():
        calls = []
        for name, schema in SCHEMAS.items():
            calls.append(async_client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": f"{PROMPT} ({name})"}], max_tokens=120,
                temperature=0.7, seed=1, response_format={"type": "json_schema",
                                                          "json_schema": {"name": name, "schema": schema}}))
            calls.append(async_client.completions.create(
                model=model_name, prompt=f"{name}: ", max_tokens=120, temperature=0,
                extra_body={"structured_outputs": {"json": schema}}))
            calls.append(async_client.completions.create(
                model=model_name, prompt=f"{name} again: ", max_tokens=120, temperature=0,
                extra_body={"guided_json": schema}))
        calls.append(async_client.completions.create(model=model_name, prompt="Free text:", max_tokens=30,
                                                     temperature=0, extra_body={"ignore_eos": True}))
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    schemas = [schema for schema in SCHEMAS.values() for _ in range(3)]
    for schema, response in zip(schemas, results, strict=False):
        choice = response.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert results[-1].usage.completion_tokens == 30


def test_json_object(client, model_name):
    response = _chat(client, model_name, response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    completion = client.completions.create(model=model_name, prompt='Some JSON objects:\n{"a": 1}\n{"b": 2}\n',
                                           max_tokens=120, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)


@pytest.mark.parametrize(("field", "value", "check"), [
    ("regex", r"[A-Z][a-z]{2,6} [0-9]{2}", lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
    ("choice", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
    ("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*',
     lambda t: re.fullmatch(r"\([0-9]+([+*][0-9]+)*\)", t)),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_grammar(client, model_name, field, value, check, endpoint):
    body = {"structured_outputs": {field: value}, "max_tokens": 40}
    if endpoint == "chat":
        response = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Answer."}], temperature=0, extra_body=body)
        text = response.choices[0].message.content
    else:
        response = client.completions.create(model=model_name, prompt="Answer:", temperature=0, extra_body=body)
        text = response.choices[0].text
    assert check(text), text


def test_streamed_structured_output_equals_the_whole_answer(client, model_name):
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    whole = _chat(client, model_name, response_format=fmt).choices[0].message.content
    stream = _chat(client, model_name, response_format=fmt, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": {"type": "object"}}, "guided_regex": "a"}, "guided_regex", "give only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_whitespace_pattern"),
])
def test_bad_constraints_are_refused_by_name(client, model_name, body, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model_name, prompt="x", max_tokens=5, extra_body=body)
    assert message in error.value.message
    if param is not None:
        assert error.value.body["param"] == param
