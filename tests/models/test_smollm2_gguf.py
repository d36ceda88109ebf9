"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF, end to end, against transformers loading the
same file (its own GGUF reader and dequantizer, its own Llama forward)."""

from __future__ import annotations

import pytest
import torch

from tuili import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "用一句话介绍长城。",
]
STEPS = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=256 << 20)


def _hf_greedy(model, ids, steps, eos):
    """transformers' own greedy generate (with its KV cache), stopping at any EOS id."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


def test_greedy_chat_matches_transformers(llm, transformers_smollm2):
    tokenizer = llm.engine.tokenizer
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=STEPS))
    for conv, out in zip(conversations, outs, strict=True):
        ids = tokenizer.apply_chat_template(conv)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _hf_greedy(transformers_smollm2, ids, STEPS, llm.engine.eos_token_ids)


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_streamed_text_matches_final_text_for_chinese(llm):
    engine = llm.engine
    ids = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "请用中文介绍一下北京。"}])
    request_id = engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40))
    pieces, shown, final = [], 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith("".join(pieces))
            pieces.append(text[shown:])
            shown = len(text)
            final = out
    assert final.request_id == request_id
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].text == llm.engine.tokenizer.decode(
        [t for t in final.outputs[0].token_ids if t not in engine.eos_token_ids]
    )
    assert "\ufffd" not in final.outputs[0].text
