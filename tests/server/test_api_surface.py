"""Issue 23's rest of the surface through the official `openai` client against a real `tuili
serve`: the logit controls on both endpoints (checked against the offline `LLM` and the model's
own tokenizer) and /v1/responses, plain and streamed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tuili.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The sea is"
CHAT = [{"role": "user", "content": "Name a colour."}]


def greedy(offline_llm, prompt, **params):
    return offline_llm.generate(prompt, SamplingParams(temperature=0, ignore_eos=True, **params))[0].outputs[0]


# ---- logit controls -------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(client, model_name, offline_llm):
    plain = greedy(offline_llm, PROMPT, max_tokens=6)
    forced = offline_llm.engine.tokenizer.encode(" blue", add_special_tokens=False)[0]
    bias = {str(forced): 100, str(plain.token_ids[0]): -100}
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logit_bias=bias, extra_body={"ignore_eos": True})
    expected = greedy(offline_llm, PROMPT, max_tokens=6, logit_bias={int(k): v for k, v in bias.items()})
    assert expected.token_ids == [forced] * 6 and response.choices[0].text == expected.text
    # Chat, with a sampled row: +100 leaves the token all the probability there is.
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=1.0, seed=3,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == offline_llm.engine.tokenizer.decode([forced] * 4)


def test_allowed_token_ids_and_bad_words_match_the_offline_engine(client, model_name, offline_llm):
    tokenizer = offline_llm.engine.tokenizer
    allowed = tokenizer.encode(" red green blue and", add_special_tokens=False)
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    expected = greedy(offline_llm, PROMPT, max_tokens=6, allowed_token_ids=allowed)
    assert set(expected.token_ids) <= set(allowed) and response.choices[0].text == expected.text

    plain = greedy(offline_llm, PROMPT, max_tokens=8)
    word = tokenizer.decode(plain.token_ids[:2])  # the greedy answer's first two tokens as one bad word
    banned = tokenizer.encode(word.lstrip(), add_special_tokens=False), tokenizer.encode(" " + word.lstrip(),
                                                                                         add_special_tokens=False)
    expected = greedy(offline_llm, PROMPT, max_tokens=8, bad_words=[word])
    for ids in banned:
        assert not any(expected.token_ids[i:i + len(ids)] == ids for i in range(len(expected.token_ids)))
    assert expected.token_ids[0] == plain.token_ids[0]  # a whole-word ban: the first token alone is fine
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"bad_words": [word], "ignore_eos": True})
    assert response.choices[0].text == expected.text
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body={"bad_words": [word], "allowed_token_ids": allowed})
    offline = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, bad_words=[word],
                                                    allowed_token_ids=allowed))[0].outputs[0]
    assert chat.choices[0].message.content == offline.text


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model_name, offline_llm, max_model_len):
    long_prompt = "One two three four five. " * max_model_len  # far beyond the context, in tokens
    ids = offline_llm.engine.tokenizer.encode(long_prompt)
    response = client.completions.create(model=model_name, prompt=long_prompt, max_tokens=4, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 30})
    expected = greedy(offline_llm, {"prompt_token_ids": ids[-30:]}, max_tokens=4)
    assert response.usage.prompt_tokens == 30 and response.choices[0].text == expected.text
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": long_prompt}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 40})
    assert chat.usage.prompt_tokens == 40
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": max_model_len + 1})
    assert raised.value.body["param"] == "truncate_prompt_tokens"
    assert f"truncate_prompt_tokens={max_model_len + 1}" in raised.value.body["message"]


# ---- /v1/responses ------------------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(client, model_name):
    response = client.responses.create(model=model_name, instructions="You are terse.", input="Name a colour.",
                                       max_output_tokens=40, temperature=0)
    chat = client.chat.completions.create(model=model_name, max_tokens=40, temperature=0, messages=[
        {"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}])
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model_name
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    done = chat.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if done else "incomplete")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "You are terse." and response.max_output_tokens == 40


def test_a_message_list_input_and_a_cut_answer(client, model_name):
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}]
    response = client.responses.create(model=model_name, input=conversation, max_output_tokens=1, temperature=0)
    chat = client.chat.completions.create(model=model_name, max_tokens=1, temperature=0, messages=[
        *conversation[:2], {"role": "user", "content": "Another one?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 1 and chat.choices[0].finish_reason == "length"


def test_a_streamed_response_sends_the_typed_events_in_order(client, model_name):
    kwargs = dict(model=model_name, input="Tell me about the sea.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert len(deltas) > 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in deltas)
    assert text == whole.output_text == events[-4].text  # output_text.done
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert {event.item_id for event in deltas} == {final.output[0].id}


def test_a_json_schema_text_format_is_followed(client, model_name):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(
        model=model_name, input="Is the sea blue? Answer in JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(("field", "value"), [
    ("store", True), ("previous_response_id", "resp_123"), ("background", True),
    ("tools", [{"type": "function", "name": "f", "parameters": {}}]), ("include", ["message.output_text.logprobs"]),
    ("reasoning", {"effort": "high"}), ("truncation", "auto"), ("tool_choice", "required"),
    ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}),
])
def test_fields_tuili_does_not_honour_are_refused_by_name(client, model_name, field, value):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model_name, input="hi", max_output_tokens=2, extra_body={field: value})
    assert raised.value.body["param"] == field and field in raised.value.body["message"]


@pytest.mark.parametrize(("item", "expected"), [
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "function_call_output"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input_image"),
    ({"role": "robot", "content": "hi"}, "robot"),
    ({"role": "user", "content": []}, "content=[]"),
])
def test_input_items_that_are_not_text_messages_are_refused(server, auth, model_name, item, expected):
    answer = httpx.post(f"{server.url}/v1/responses", headers=auth,
                        json={"model": model_name, "input": [item], "max_output_tokens": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "input" and expected in error["message"]


def test_the_clients_stream_and_parse_helpers_work(client, model_name):
    from typing import Literal

    from pydantic import BaseModel

    kwargs = dict(model=model_name, input="Say hi.", max_output_tokens=200, temperature=0)
    with client.responses.stream(**kwargs) as events:
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        final = events.get_final_response()  # needs response.completed: the answer must end by itself
    assert final.status == "completed" and final.output_text == "".join(deltas) == client.responses.create(
        **kwargs).output_text

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    parsed = client.responses.parse(model=model_name, input="Is the sea blue?", text_format=Verdict,
                                    max_output_tokens=20, temperature=0)
    assert parsed.output_parsed.answer in ("yes", "no")
