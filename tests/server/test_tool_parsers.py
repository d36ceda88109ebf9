"""The tool-call parsers on the text real chat templates write for calls, and on the formats
Llama 3.1 and Mistral models answer in."""

from __future__ import annotations

import json

import pytest

from tuili.server.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    ToolPlan,
    ToolStream,
    parser_for_template,
)
from tuili.tokenizer import Tokenizer

CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "unit": "c"}}},
         {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": [2, "三"]}}}]
EXPECTED = [ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}'),
            ParsedCall("add", '{"a": 1, "b": [2, "三"]}')]


@pytest.fixture(scope="module")
def qwen3(real_tokenizer_dirs) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(real_tokenizer_dirs["qwen3"])


def test_hermes_reads_back_the_calls_qwen3s_template_writes(qwen3):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS}]
    text = qwen3.decode(qwen3.apply_chat_template(messages, add_generation_prompt=False, tools=tools),
                        skip_special_tokens=False)
    assert "<tool_call>" in text
    answer = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("\n").removesuffix("<|im_end|>")
    parsed = HermesParser().parse(answer)
    assert parsed.calls == EXPECTED
    assert parsed.content.strip().endswith("Let me check.")  # after Qwen3's (empty) <think> block
    assert parser_for_template(qwen3.hf_tokenizer.chat_template) == "hermes"


def test_hermes_edge_cases():
    parser = HermesParser()
    assert parser.parse("no calls here").calls == []
    # The model stopped before the closing tag.
    assert parser.parse('<tool_call>\n{"name": "f", "arguments": {}}\n').calls == [ParsedCall("f", "{}")]
    # A block that is not a call: the whole answer is content.
    bad = 'x <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parser.parse(bad).content == bad and parser.parse(bad).calls == []


def test_llama3_json():
    parser = Llama3JsonParser()
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    assert parser.parse(one).calls == EXPECTED[:1]
    assert parser.parse("<|python_tag|>" + one).calls == EXPECTED[:1]
    two = one + '; {"name": "add", "parameters": {"a": 1, "b": [2, "三"]}}'
    assert parser.parse(two).calls == EXPECTED and parser.parse(two).content is None
    assert parser.parse("The weather is fine.").content == "The weather is fine."
    assert parser.parse('{"not": "a call"}').calls == []


def test_mistral_both_formats():
    parser = MistralParser()
    v3 = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
          '{"name": "add", "arguments": {"a": 1, "b": [2, "三"]}}]')
    assert parser.parse(v3).calls == EXPECTED
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": [2, "三"]}'
    assert parser.parse(v11).calls == EXPECTED
    assert parser.parse("Sure. " + v3).content == "Sure. "
    assert parser_for_template("{% if x %}[TOOL_CALLS]{% endif %}") == "mistral"


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()], ids=lambda p: p.marker)
def test_streamed_pieces_add_up_to_the_parsed_answer(parser):
    texts = {
        "<tool_call>": 'Checking. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        "{": '{"name": "f", "parameters": {"x": 1}}',
        "[TOOL_CALLS]": 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]',
    }
    text = texts[parser.marker]
    plan = ToolPlan(tools=[], choice="auto", parser=parser, parser_name="")
    stream = ToolStream(plan)
    content, calls = "", []
    for end in range(1, len(text) + 1):  # one character a step, the hardest split
        delta, new_calls = stream.deltas(text[:end], end == len(text))
        content += delta
        calls += new_calls
    whole = parser.parse(text)
    assert content == (whole.content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]
