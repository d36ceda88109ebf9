"""Bad input gets the right status and OpenAI's error shape, never a traceback, and the server
keeps serving a good request running alongside."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.slow

GOOD_TOKENS = 24


def _check_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


_CHAT_HI = {"messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = [
    # (id, path, body, expected status, expected param, text the message must contain)
    ("invalid json", "/v1/completions", b'{"prompt": "hi", ', 400, None, "JSON"),
    ("max_tokens as a string", "/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", "max_tokens"),
    ("temperature as a string", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", "temperature"),
    ("prompt as a number", "/v1/completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("messages as a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "messages"),
    ("stream as a string", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "role"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "-1"),
    ("n=0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "n=0"),
    ("temperature=-1", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature", "temperature"),
    ("top_p=0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt", "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [10**9]}, 400, "prompt", str(10**9)),
    ("max_tokens past the context", "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "prompt",
     "context holds"),
    ("max_tokens=0 without echo", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "echo"),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options", "stream"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("detokenize a bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens", "-1"),
    # A lone surrogate is valid JSON but not text (issue 20.3): refused, never a 500.
    ("lone surrogate prompt", "/v1/completions", {"prompt": "\ud800", "max_tokens": 1}, 400, "prompt", "surrogate"),
    ("lone surrogate in a prompt list", "/v1/completions", {"prompt": ["ok", "a\udc00"]}, 400, "prompt", "surrogate"),
    ("lone surrogate chat content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages", "surrogate"),
    ("lone surrogate text part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400, "messages", "surrogate"),
    ("lone surrogate stop", "/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, 400, "stop", "surrogate"),
    ("lone surrogate tokenize", "/tokenize", {"prompt": "\ud800"}, 400, "prompt", "surrogate"),
    # Content-less turns are client bugs, not empty strings (issue 20.6).
    ("user content null", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400,
     "messages", "needs content"),
    ("user content []", "/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400,
     "messages", "content=[]"),
    # At most --max-sequences-per-request (256) sequences, prompts x n, per call (issue 20.1).
    ("too many sequences", "/v1/completions", {"prompt": ["a", "b", "c"], "n": 128, "max_tokens": 1}, 400, "n",
     "384 sequences"),
    ("17 stop strings", "/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400, "stop",
     "at most 16"),
    ("a 257-character stop", "/v1/completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop", "at most 256"),
    # Logit controls (issue 23): token ids beyond the vocabulary and values out of range, by value.
    ("logit_bias id out of range", "/v1/completions", {"prompt": "hi", "logit_bias": {"10000000": 1}}, 400,
     "logit_bias", "10000000"),
    ("logit_bias key not an id", "/v1/chat/completions", {**_CHAT_HI, "logit_bias": {"sea": 1}}, 400,
     "logit_bias", "'sea'"),
    ("logit_bias 101", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "101"),
    ("allowed_token_ids out of range", "/v1/chat/completions", {**_CHAT_HI, "allowed_token_ids": [3, 10000001]},
     400, "allowed_token_ids", "10000001"),
    ("a blank bad word", "/v1/completions", {"prompt": "hi", "bad_words": ["sea", " "]}, 400, "bad_words",
     "bad_words entry ' '"),
    ("truncate_prompt_tokens -2", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens", "-1"),
    ("tokenize content null", "/tokenize", {"messages": [{"role": "system", "content": None}]}, 400,
     "messages", "needs content"),
]

# Fields that change a request's meaning and are not implemented: refused by name, never ignored
# (issue 20.6). (field, value, endpoints)
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
_COMPLETION = {"prompt": "hi", "max_tokens": 1}
MEANINGFUL_FIELDS = [
    # tool_choice without tools: chat refuses it (nothing to call), completions have no tools at all.
    ("tool_choice", "auto", "both"), ("functions", [{"name": "f"}], "both"), ("parallel_tool_calls", True, "/v1/completions"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "/v1/completions"),
    ("prediction", {"type": "content", "content": "x"}, "both"), ("guided_whitespace_pattern", " ", "both"),
    ("guided_decoding_backend", "outlines", "both"), ("structural_tag", "{}", "both"),
    ("echo", True, "chat"),
    ("chat_template", "{{ messages }}", "chat"), ("chat_template_kwargs", {"enable_thinking": True}, "chat"),
]
for _field, _value, _where in MEANINGFUL_FIELDS:
    for _path, _base in (("/v1/completions", _COMPLETION), ("/v1/chat/completions", _CHAT)):
        if _where == "both" or _where in _path:
            BAD_REQUESTS.append((f"{_field} on {_path}", _path, {**_base, _field: _value}, 400, _field, _field))
BAD_REQUESTS.append(("chat_template on /tokenize", "/tokenize", {"prompt": "hi", "chat_template": "x"}, 400,
                     "chat_template", "chat_template"))


def test_bad_input_is_answered_while_a_good_request_completes(server, model_name, auth, max_model_len):
    headers = {**auth, "Content-Type": "application/json"}
    neutral = {**_COMPLETION, "tool_choice": "none", "bad_words": [], "guided_json": None, "echo": False}
    half = "hello " * (5 * max_model_len)  # half of a chat too long in characters

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            good = asyncio.create_task(http.post("/v1/completions", headers=headers, json={
                "model": model_name, "prompt": "Tell me about the sea.", "max_tokens": GOOD_TOKENS,
                "ignore_eos": True, "temperature": 0,
            }))
            answers = {}
            for name, path, body, *_ in BAD_REQUESTS:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                answers[name] = await http.post(path, content=content, headers=headers)
            # Ten times the context, as text: refused with the limit and the prompt's length.
            long_prompt = "hello " * (10 * max_model_len)
            answers["long prompt"] = await http.post("/v1/completions", headers=headers,
                                                     json={"prompt": long_prompt, "max_tokens": 1})
            answers["long prompt length"] = await http.post("/tokenize", headers=headers, json={"prompt": long_prompt})
            # The same for a chat, its content spread over messages and parts.
            answers["long chat"] = await http.post("/v1/chat/completions", headers=headers, json={
                "messages": [{"role": "system", "content": half},
                             {"role": "user", "content": [{"type": "text", "text": half}]}], "max_tokens": 1})
            # Just over the context: tokenized whole, refused with its exact length.
            answers["prompt just over"] = await http.post("/v1/completions", headers=headers,
                                                          json={"prompt": [7] * (max_model_len + 40), "max_tokens": 1})
            answers["10 MB body"] = await http.post("/v1/completions", headers=headers,
                                                    json={"prompt": "x" * (10 << 20)})
            answers["no key"] = await http.post("/v1/completions", json={"prompt": "hi"})
            answers["wrong key"] = await http.post("/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                                                   content=b"not even json")
            answers["unknown route"] = await http.get("/v2/nothing", headers=headers)
            answers["neutral values"] = await http.post("/v1/completions", headers=headers, json=neutral)
            answers["health without key"] = await http.get("/health")
            return await good, answers

    good, answers = asyncio.run(run())

    for name, _, _, status, param, needle in BAD_REQUESTS:
        assert needle in _check_error(answers[name], status, param), name
    message = _check_error(answers["long prompt"], 400, "prompt")
    length = answers["long prompt length"].json()["count"]
    assert length >= 10 * max_model_len
    # Refused after tokenizing only a prefix (issue 20.5): the message gives the length in
    # characters, the prefix's tokens and the limit.
    assert str(len("hello " * (10 * max_model_len))) in message and f"context holds {max_model_len}" in message
    message = _check_error(answers["long chat"], 400, "messages")
    assert f"messages has {2 * len(half) + 1} characters" in message and f"context holds {max_model_len}" in message
    message = _check_error(answers["prompt just over"], 400, "prompt")
    assert str(max_model_len + 40) in message and str(max_model_len) in message
    _check_error(answers["10 MB body"], 413)
    _check_error(answers["no key"], 401)
    _check_error(answers["wrong key"], 401)
    _check_error(answers["unknown route"], 404)
    assert answers["health without key"].status_code == 200
    assert answers["neutral values"].status_code == 200, answers["neutral values"].text

    assert good.status_code == 200
    result = good.json()
    assert result["usage"]["completion_tokens"] == GOOD_TOKENS
    assert result["choices"][0]["finish_reason"] == "length"
