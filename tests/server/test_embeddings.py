"""/v1/embeddings through the official openai client against a real `tuili serve`: text and token
ids, one or many, float and base64 (the client's own decoding and the raw bytes), equal to the
offline `LLM.embed` of the same model (whose vectors tests/models/test_embeddings.py checks
against transformers); bad input answered 400 naming the field; embedding calls beside a
streaming completion change neither."""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import openai
import pytest
import torch

from tuili import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "Hello", "one two three four five six seven"]


def _close(ours: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=1e-5, rtol=1e-4)


def test_openai_client_float_and_base64(client, offline_llm, model_name):
    expected = [out.outputs.embedding for out in offline_llm.embed(TEXTS)]
    tokenizer = offline_llm.get_tokenizer()
    prompt_tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)

    floats = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == model_name
    assert [d.index for d in floats.data] == [0, 1, 2]
    for data, vector in zip(floats.data, expected, strict=True):
        assert data.object == "embedding"
        _close(data.embedding, vector)
        assert abs(float(torch.tensor(data.embedding).norm()) - 1.0) < 1e-5  # LAST, normalised: the default
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == prompt_tokens

    raw = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="base64")
    for data, vector in zip(raw.data, expected, strict=True):
        assert isinstance(data.embedding, str)
        decoded = base64.b64decode(data.embedding)
        _close(list(struct.unpack(f"<{len(decoded) // 4}f", decoded)), vector)

    # Without encoding_format the client asks for base64 itself and decodes it to floats.
    default = client.embeddings.create(model=model_name, input=TEXTS[0])
    assert len(default.data) == 1
    _close(default.data[0].embedding, expected[0])


def test_token_ids_one_and_many(client, offline_llm, model_name):
    ids = [[1, 2, 3, 4, 5], [42], list(range(100, 140))]
    expected = [out.outputs.embedding for out in offline_llm.embed([{"prompt_token_ids": p} for p in ids])]
    many = client.embeddings.create(model=model_name, input=ids, encoding_format="float")
    for data, vector in zip(many.data, expected, strict=True):
        _close(data.embedding, vector)
    assert many.usage.prompt_tokens == sum(len(p) for p in ids)
    one = client.embeddings.create(model=model_name, input=ids[2], encoding_format="float")
    _close(one.data[0].embedding, expected[2])
    # vLLM's normalize=false: the raw last hidden state, in the same direction
    raw = client.embeddings.create(model=model_name, input=ids[2], encoding_format="float",
                                   extra_body={"normalize": False}).data[0].embedding
    norm = float(torch.tensor(raw).norm())
    assert norm > 1.5
    _close([x / norm for x in raw], expected[2])


def test_the_whole_context_is_allowed(client, model_name, max_model_len):
    """Nothing is generated, so an input may fill the context (completions need one token more)."""
    out = client.embeddings.create(model=model_name, input=[7] * max_model_len, encoding_format="float")
    assert out.usage.prompt_tokens == max_model_len and len(out.data[0].embedding) > 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, offline_llm, model_name, max_model_len):
    ids = list(range(10, 30))
    expected = offline_llm.embed({"prompt_token_ids": ids[-5:]})[0].outputs.embedding
    out = client.embeddings.create(model=model_name, input=ids, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    _close(out.data[0].embedding, expected)
    whole = client.embeddings.create(model=model_name, input=[3] * (max_model_len + 9), encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == max_model_len
    text = client.embeddings.create(model=model_name, input="word " * (10 * max_model_len), encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": -1})
    assert text.usage.prompt_tokens == max_model_len


def _refused(server, auth, body: dict, param: str, text: str) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=auth, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert text in error["message"], error
    assert "Traceback" not in response.text


def test_bad_input_is_refused_naming_the_field(server, auth, client, model_name, max_model_len, offline_llm):
    hidden = offline_llm.engine.model_config.hidden_size
    _refused(server, auth, {"input": ""}, "input", "input is empty")
    _refused(server, auth, {"input": []}, "input", "input=[] is invalid")
    _refused(server, auth, {"input": ["fine", ""]}, "input", "input[1] is empty")
    _refused(server, auth, {"input": [[1, 2], []]}, "input", "input[1] is empty")
    _refused(server, auth, {"input": [1] * (max_model_len + 1)}, "input",
             f"has {max_model_len + 1} tokens but the context holds {max_model_len}")
    _refused(server, auth, {"input": "word " * (10 * max_model_len)}, "input", "input")
    _refused(server, auth, {"input": 5}, "input", "input=5 is invalid")
    _refused(server, auth, {"input": [1, "a"]}, "input", "is invalid")
    _refused(server, auth, {"input": [10**9]}, "input", "token id 1000000000")
    _refused(server, auth, {"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format")
    _refused(server, auth, {"input": "hi", "dimensions": 7}, "dimensions",
             f"dimensions=7 is not supported: this model's embeddings have {hidden} dimensions")
    _refused(server, auth, {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
             "truncate_prompt_tokens=0 is invalid")
    _refused(server, auth, {"input": "hi", "truncate_prompt_tokens": max_model_len + 1}, "truncate_prompt_tokens",
             f"truncate_prompt_tokens={max_model_len + 1} is invalid")
    _refused(server, auth, {"input": "hi", "chat_template": "{{ x }}"}, "chat_template", "chat_template")
    missing = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", "model": "nope"}, headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    # `dimensions` equal to the model's size is the model's vector; the server is still serving
    same = client.embeddings.create(model=model_name, input="hi", dimensions=hidden, encoding_format="float")
    assert len(same.data[0].embedding) == hidden


def test_embeddings_beside_a_stream_change_nothing(async_client, model_name, offline_llm):
    """Embedding calls, good and bad, while a greedy completion streams: the stream's text is the
    offline text, and the good embeddings are the offline vectors."""
    prompt = "Write a short story about a robot who learns to paint."
    expected_text = offline_llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0))[0].outputs[0].text
    expected_vectors = [out.outputs.embedding for out in offline_llm.embed(TEXTS)]

    async def stream() -> str:
        chunks = await async_client.completions.create(model=model_name, prompt=prompt, max_tokens=48,
                                                       temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def embeddings() -> tuple[list, int]:
        good, refused = [], 0
        for _ in range(3):
            response = await async_client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
            good.append([d.embedding for d in response.data])
            try:
                await async_client.embeddings.create(model=model_name, input="")
            except openai.BadRequestError:
                refused += 1
        return good, refused

    async def both():
        return await asyncio.gather(stream(), embeddings())

    text, (good, refused) = asyncio.run(both())
    assert text == expected_text
    assert refused == 3
    for vectors in good:
        for ours, expected in zip(vectors, expected_vectors, strict=True):
            _close(ours, expected)
