"""Structured output in the engine: every row of a batch that has a grammar follows it, the
grammar state survives preemption and is freed on every path, grammars are compiled once."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch
import transformers

from tuili import LLM, SamplingParams, StructuredOutputsParams
from tuili.errors import RequestError

# Bounded everywhere, so that even a random model's output completes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K+V x 2 layers x 4 tokens x 2 KV heads x 16 dims x fp32


@pytest.fixture(scope="module")
def tiny_qwen3_with_tokenizer(tmp_path_factory, real_tokenizer_dirs):
    """A tiny random Qwen3 with Qwen3's real tokenizer (151k tokens): a grammar needs one."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=151645,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qwen3-tok") / "model"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, path / name)
    return path


def _llm(path, num_blocks=1024, **options) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=4,
               kv_cache_memory=num_blocks * BLOCK_BYTES, **options)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_with_tokenizer) -> LLM:
    return _llm(tiny_qwen3_with_tokenizer)


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def test_constrained_rows_follow_their_grammar_beside_free_rows(llm):
    compiled_before = llm.engine.grammars.compilations
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    params = [_json(temperature=1.0, seed=i) for i in range(4)] + [free] + [
        SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,5}-\d\d")),
        SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"])),
    ]
    outs = llm.generate(["Hello"] * len(params), params)
    for out in outs[:4]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert len(outs[4].outputs[0].token_ids) == 20  # the free row was not masked into stopping
    assert re.fullmatch(r"[a-c]{2,5}-\d\d", outs[5].outputs[0].text)
    assert outs[6].outputs[0].text in ("alpha", "beta gamma")
    assert not llm.engine.runner._grammar_states, "grammar states outlived their sequences"
    # The schema once for four requests (once at all if an earlier test compiled it).
    assert llm.engine.grammars.compilations - compiled_before <= 3


def test_grammar_state_survives_preemption(tiny_qwen3_with_tokenizer):
    params = [_json(temperature=1.0, seed=10 + i) for i in range(4)]
    small = _llm(tiny_qwen3_with_tokenizer, 12, max_model_len=40, max_num_batched_tokens=16)
    outs = small.generate(["Hi"] * 4, params)
    reference = [small.generate(["Hi"], p)[0] for p in params]  # one at a time: no preemption
    assert small.engine.stats().num_preemptions, "the pool was meant to be too small for all requests at once"
    for ref, out in zip(reference, outs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert not small.engine.runner._grammar_states


def test_aborted_sequences_free_their_grammar_state(llm):
    engine = llm.engine
    request_id = engine.add_request("Hi", _json(n=2))
    engine.step()
    engine.step()
    assert len(engine.runner._grammar_states) == 2
    engine.abort_request(request_id)
    engine.step()
    assert not engine.runner._grammar_states


@pytest.mark.parametrize(("spec", "expected"), [
    (dict(regex="(unclosed"), "structured_outputs.regex does not compile"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json does not compile"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar does not compile"),
])
def test_a_grammar_that_does_not_compile_is_refused_by_name(llm, spec, expected):
    with pytest.raises(RequestError, match=re.escape(expected)):
        llm.engine.add_request("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_needs_exactly_one_constraint():
    with pytest.raises(RequestError, match="exactly one of json, regex"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()


def test_a_complete_match_is_followed_only_by_stop_tokens(llm):
    """ignore_eos past a complete match: the sequence goes on, and may only repeat EOS."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = llm.generate(["Hi"], params)[0].outputs[0]
    eos = llm.engine.eos_token_ids
    assert out.text == "yes" and len(out.token_ids) == 6
    first_eos = next(i for i, token in enumerate(out.token_ids) if token in eos)
    assert all(token in eos for token in out.token_ids[first_eos:])
