"""Tool calling through the official openai client against a real `tuili serve` (SmolLM2,
whose template renders no tools: tuili writes them into a Hermes-format system prompt)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _ask(client, model_name, stream=False, **kw):
    kw = {"messages": MESSAGES, "max_tokens": 150, **kw}
    return client.chat.completions.create(model=model_name, tools=TOOLS, temperature=0, stream=stream, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def _streamed(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    """Assemble a stream's content and tool calls as a client does (by each call's index)."""
    content, calls, reason, ids = "", {}, None, {}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.id:
                assert ids.setdefault(delta.index, delta.id) == delta.id, "a call changed its id"
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    assert len(ids) == len(calls), "every call's first delta carries its id"
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason


def _valid(calls):
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


def test_required_gives_valid_calls_and_streams_the_same(client, model_name):
    message = _ask(client, model_name, tool_choice="required").choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.content is None
    assert all(call.id.startswith("call_") and call.type == "function" for call in message.message.tool_calls)
    _valid(_calls(message.message))
    content, calls, reason = _streamed(_ask(client, model_name, stream=True, tool_choice="required"))
    assert (content, calls, reason) == ("", _calls(message.message), "tool_calls")


def test_required_without_parallel_calls_gives_one(client, model_name):
    message = _ask(client, model_name, tool_choice="required", parallel_tool_calls=False).choices[0].message
    assert len(message.tool_calls) == 1
    _valid(_calls(message))


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_choice_calls_that_function_and_streams_its_arguments(client, model_name, name):
    choice = {"type": "function", "function": {"name": name}}
    message = _ask(client, model_name, tool_choice=choice).choices[0].message
    calls = _calls(message)
    assert [call_name for call_name, _ in calls] == [name]
    _valid(calls)
    stream = list(_ask(client, model_name, stream=True, tool_choice=choice))
    pieces = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2, "a named call's arguments stream as they are written"
    assert _streamed(iter(stream))[1] == calls


def test_auto_parses_the_calls_the_model_writes(client, model_name):
    """The model's text is forced (by a grammar) into Hermes tool calls: auto must find them."""
    grammar = ('root ::= "Checking. <tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": " [1-9] '
               '", \\"b\\": 2}}\\n</tool_call>"')
    body = {"structured_outputs": {"grammar": grammar}}
    message = _ask(client, model_name, tool_choice="auto", extra_body=body).choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.content == "Checking. "
    calls = _calls(message.message)
    assert len(calls) == 1 and calls[0][0] == "add" and calls[0][1]["b"] == 2
    assert _streamed(_ask(client, model_name, stream=True, tool_choice="auto", extra_body=body)) == (
        "Checking. ", calls, "tool_calls")
    # tool_choice none: the same text stays text.
    none = _ask(client, model_name, tool_choice="none", extra_body=body).choices[0]
    assert none.message.tool_calls in (None, []) and "<tool_call>" in none.message.content
    assert none.finish_reason == "stop"


def test_tool_results_are_fed_back_through_the_template(client, model_name):
    first = _ask(client, model_name, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    call = first.message.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "The sum is 5."}]
    answer = _ask(client, model_name, messages=history, tool_choice="none", max_tokens=5)
    without_result = _ask(client, model_name, messages=history[:2], tool_choice="none", max_tokens=5)
    assert answer.usage.prompt_tokens > without_result.usage.prompt_tokens > _ask(
        client, model_name, tool_choice="none", max_tokens=5).usage.prompt_tokens


@pytest.mark.parametrize(("change", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "twice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "only one"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{nope"}}]}]}, None, "not JSON"),
])
def test_bad_tool_requests_are_refused_by_name(server, model_name, auth, change, param, message):
    body = {"model": model_name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **change}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


def test_langchain_bind_tools_and_structured_output(server, model_name):
    import langchain_openai
    from pydantic import BaseModel, Field

    chat = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="test-key", model=model_name,
                                       temperature=0, max_tokens=150, max_retries=0)

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=16)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    for method in ("json_schema", "function_calling", "json_mode"):
        structured = chat.with_structured_output(Weather, method=method)
        prompt = "Weather in Paris, as JSON with city and unit." if method == "json_mode" else "Weather in Paris?"
        if method == "json_mode":
            # json_mode asks for any JSON object: the prompt alone must give its keys.
            prompt = 'Reply with a JSON object {"city": ..., "unit": "celsius"} for Paris.'
        try:
            result = structured.invoke(prompt)
        except Exception as error:  # noqa: BLE001 - name the method that failed
            pytest.fail(f"with_structured_output(method={method!r}) failed: {error}")
        assert isinstance(result, Weather), method
    ai = chat.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(ai.tool_calls[0]["args"])


def test_openai_parse_helper(client, model_name):
    """The openai client's own structured-output helper (json_schema with strict)."""
    from pydantic import BaseModel, Field

    class Sum(BaseModel):
        a: int = Field(ge=0, le=100)
        b: int = Field(ge=0, le=100)

    parsed = client.chat.completions.parse(model=model_name, messages=[{"role": "user", "content": "2 + 3?"}],
                                           response_format=Sum, max_tokens=60, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Sum)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "json_schema"})


def test_litellm_tools_and_response_format(server, model_name):
    import litellm

    common = {"model": f"openai/{model_name}", "api_base": f"{server.url}/v1", "api_key": "test-key",
              "temperature": 0, "max_tokens": 150}
    response = litellm.completion(messages=MESSAGES, tools=TOOLS, tool_choice="required", **common)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls]
    _valid(calls)
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD, "strict": True}}
    response = litellm.completion(messages=[{"role": "user", "content": "2 + 3 as JSON"}], response_format=fmt,
                                  **common)
    jsonschema.validate(json.loads(response.choices[0].message.content), ADD)
