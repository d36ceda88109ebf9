"""The API as the official `openai` client sees it, checked against the offline `LLM` and the
model's own (transformers) tokenizer."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_ALIAS
from tuili.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_greedy_completion_equals_offline_generate(client, model_name, offline_llm):
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    expected = offline_llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.object == "text_completion" and response.model == model_name and response.id
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_greedy_chat_equals_offline_chat(client, model_name, offline_llm):
    response = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0)
    expected = offline_llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0))[0]
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_a_developer_message_is_a_system_message(client, model_name, server, auth):
    as_developer = [{"role": "developer", "content": CHAT[0]["content"]}, *CHAT[1:]]
    kwargs = dict(model=model_name, max_tokens=8, temperature=0)
    developer = client.chat.completions.create(messages=as_developer, **kwargs)
    system = client.chat.completions.create(messages=CHAT, **kwargs)
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    tokens = [httpx.post(f"{server.url}/tokenize", json={"messages": m}, headers=auth).json()["tokens"]
              for m in (as_developer, CHAT)]
    assert tokens[0] == tokens[1]


def test_content_as_text_parts_is_the_joined_string(client, model_name):
    parts = [{"type": "text", "text": "Say hello"}, {"type": "text", "text": "in French."}]
    as_parts = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0
    )
    as_string = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Say hello\nin French."}], max_tokens=4, temperature=0
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


@pytest.mark.parametrize("seed", [7, 12345])
def test_streamed_completion_concatenates_to_the_whole_one(client, model_name, seed):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_streamed_chat_concatenates_to_the_whole_one(client, model_name):
    kwargs = dict(model=model_name, messages=CHAT, max_tokens=8, temperature=0.8, seed=3)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_seed_reproduces_and_different_seeds_differ(client, model_name):
    def sample(seed: int) -> str:
        return client.completions.create(
            model=model_name, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=seed
        ).choices[0].text

    first = sample(42)
    assert sample(42) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_n_choices_and_their_usage(client, model_name):
    response = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=0
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text != response.choices[1].text  # independent samples (seeded: stable)
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)
    # n greedy choices are all the greedy text.
    greedy = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_several_prompts_and_token_id_prompts(client, model_name, offline_llm):
    prompts = [PROMPT, "One, two, three,"]
    response = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0, n=2)
    expected = offline_llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected for _ in range(2)]
    ids = expected[1].prompt_token_ids
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == expected[1].outputs[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_strings_cut_the_text(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    words = full.split()
    assert len(words) >= 3, f"the test needs a longer greedy text than {full!r}"
    stop = words[2]
    cut = client.completions.create(**kwargs, stop=[stop, "never-appears"]).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_completion_logprobs(client, model_name):
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == response.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == logprob
        assert logprob == max(top.values())  # greedy picks the most likely token
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5


def test_chat_logprobs(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    # A choice that stopped at the end-of-turn token lists that token too, though its text is not shown.
    texts = [entry.token for entry in content]
    assert "".join(texts[:-1] if choice.finish_reason == "stop" else texts) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_models_and_tokenizer_endpoints(server, client, model_name, offline_llm, auth):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name, MODEL_ALIAS]
    hf = offline_llm.get_tokenizer()  # transformers' tokenizer of the same model
    text = "Hello, wörld! 你好"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=auth).json()
    assert tokens["tokens"] == hf.encode(text) and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=auth).json()
    assert chat["tokens"] == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert back["prompt"] == hf.decode(tokens["tokens"], skip_special_tokens=True)


def test_retrieve_one_model_and_an_unknown_one(client, model_name):
    model = client.models.retrieve(model_name)
    assert (model.id, model.object, model.owned_by) == (model_name, "model", "tuili")
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    error = raised.value.body  # the client unwraps OpenAI's {"error": {...}}
    assert error["code"] == "model_not_found" and error["param"] == "model" and "no-such-model" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_every_served_name_is_a_model_and_answers(client, model_name):
    assert client.models.retrieve(MODEL_ALIAS).id == MODEL_ALIAS  # a name with a slash
    kwargs = dict(prompt=PROMPT, max_tokens=4, temperature=0)
    by_default = client.completions.create(model=model_name, **kwargs)
    by_alias = client.completions.create(model=MODEL_ALIAS, **kwargs)
    assert (by_default.model, by_alias.model) == (model_name, MODEL_ALIAS)  # each answer names the name asked
    assert by_alias.choices[0].text == by_default.choices[0].text
    chat = client.chat.completions.create(model=MODEL_ALIAS, messages=CHAT, max_tokens=2, temperature=0)
    assert chat.model == MODEL_ALIAS
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="tuili-test", **kwargs)
    assert raised.value.body["code"] == "model_not_found" and MODEL_ALIAS in raised.value.body["message"]


def test_usage_reports_prefix_cache_hits(client, model_name, server, scrape):
    prompt = "A repeated preamble that is long enough to fill a few KV cache blocks. " * 4
    before = scrape(server.url)
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached >= (first.usage.prompt_tokens_details.cached_tokens or 0)
    after = scrape(server.url)

    def grew(name):
        return after[name] - before.get(name, 0.0)

    assert grew("tuili:prefix_cache_queries_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert grew("tuili:prefix_cache_hits_total") == cached + (first.usage.prompt_tokens_details.cached_tokens or 0)
    assert grew("tuili:prefix_cache_device_hits_total") == grew("tuili:prefix_cache_hits_total")
    assert grew("tuili:prefix_cache_host_hits_total") == 0
