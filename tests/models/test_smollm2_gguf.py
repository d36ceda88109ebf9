"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF against transformers loading the same file (its
own GGUF reader and dequantizer, its own Llama forward): the tensors and the config as loaded,
then end to end. (One file, so that transformers loads it once: ~20 s.)"""

from __future__ import annotations

import pytest
import torch

from tuili import LLM, SamplingParams
from tuili.models.default_model import default_model_path
from tuili.models.gguf import open_gguf

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "用一句话介绍长城。",
]
STEPS = 24


@pytest.fixture(scope="module")
def checkpoint():
    return open_gguf(default_model_path())


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_loading(checkpoint, transformers_smollm2):
    reference = transformers_smollm2.state_dict()
    assert checkpoint.config["tie_word_embeddings"]
    assert sorted(checkpoint.tensor_names()) == sorted(set(reference) - {"lm_head.weight"})
    differing = [
        name for name in checkpoint.tensor_names() if not torch.equal(checkpoint.load_tensor(name), reference[name])
    ]
    assert differing == []


@pytest.mark.slow
def test_smollm2_config_matches_transformers(checkpoint, transformers_smollm2):
    reference = transformers_smollm2.config
    ours = checkpoint.config
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "model_type", "attention_bias"]:  # fmt: skip
        assert ours[key] == getattr(reference, key), key
    assert (
        ours["architectures"] == ["LlamaForCausalLM"]
        and type(transformers_smollm2).__name__ == "LlamaForCausalLM"
    )
    assert ours["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    reference_theta = getattr(reference, "rope_parameters", None) or {"rope_theta": reference.rope_theta}
    assert ours["rope_theta"] == reference_theta["rope_theta"]
    assert ours["rope_scaling"] is None


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
