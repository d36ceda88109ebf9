"""Speculative decoding with a hybrid target (Qwen3.5: Gated DeltaNet layers beside full
attention): a verification chunk saves the linear-attention state after each of its positions,
and a rejection leaves the sequence's slot at the last accepted one (tuili/engine/runner.py).

Greedy outputs are token for token those without speculation — in float32, with preemption and
prefix-cache hits (state checkpoints) in the mix, and in bf16 on the native CPU path, whose
DeltaNet kernels compute token by token (tests/engine/test_batch_invariance.py) — and nothing
is held after many rejections and aborts. The models are tiny random Qwen3.5s whose greedy text
falls into cycles (small initial weights), so prompt lookup both hits and misses."""

from __future__ import annotations

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.errors import TuiliError

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7],
    [1, 2, 3, 4] * 6 + [1, 2],
    list(range(40, 80)),
    [100 + (i * 37) % 150 for i in range(30)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
INIT = 0.02  # the checkpoints' initializer_range: greedy text with cycles

# float32 sizes of the tiny Qwen3.5 (tests/engine/conftest.py), block size 16
BLOCK = 2 * 16 * 2 * 32 * 4  # K+V x tokens x KV heads x head dim x float32, one attention layer
SLOT = 3 * (256 * 3 * 4 + 4 * 32 * 32 * 4)  # three DeltaNet layers: conv window + recurrent state


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def prompts(order=slice(None)) -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS[order]]


def assert_nothing_held(llm: LLM) -> None:
    """Every KV block, state slot and draft-side block is free again."""
    engine = llm.engine
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    slots = engine.scheduler.state_slots
    assert slots.num_free == slots.num_slots
    checkpoints = engine.scheduler.checkpoints
    if checkpoints is not None:
        assert checkpoints.num_pending == 0
        assert checkpoints.num_free + checkpoints.num_filed == checkpoints.num_checkpoints
    proposer = engine.speculator.proposer
    draft_blocks = getattr(proposer, "blocks", None)
    if draft_blocks is not None:
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
        assert not proposer._shadows


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_checkpoint):
    return tiny_hybrid_checkpoint("dense", INIT)


@pytest.fixture(scope="module")
def hybrid_draft(hybrid, tmp_path_factory):
    """A one-layer full-attention Qwen3 with the target's embedding and output head, its layer
    adding nothing (zero output projections): a bigram model of the target that agrees with it
    about one time in five (its vocabulary is the target's)."""
    target = transformers.AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32)
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=INIT,
        tie_word_embeddings=False,
    )  # fmt: skip
    draft = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.layers[0].self_attn.o_proj.weight.zero_()
        draft.model.layers[0].mlp.down_proj.weight.zero_()
    path = tmp_path_factory.mktemp("hybrid") / "draft"
    draft.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(hybrid):
    return token_ids(LLM(str(hybrid), dtype="float32").generate(prompts(), GREEDY))


def spec_config(method: str, draft) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    return {"model": str(draft), "num_speculative_tokens": 3, "adaptive": False}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_with_preemption_and_state_checkpoint_hits(method, hybrid, hybrid_draft,
                                                                              reference):
    k = 4 if method == "ngram" else 3
    # State for 4 sequences (a slot and k verification rows each), 4 checkpoints and 12 KV blocks
    # for 4 sequences growing to 50-64 tokens (4 blocks each): preemption is certain.
    memory = 4 * SLOT * (1 + k) + 4 * SLOT + 12 * BLOCK
    llm = LLM(str(hybrid), dtype="float32", kv_cache_memory=memory, max_model_len=128, max_num_seqs=4,
              state_checkpoint_interval=1, speculative_config=spec_config(method, hybrid_draft))
    assert llm.engine.pool.num_blocks == 12 and llm.engine.pool.num_state_checkpoints == 4
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert token_ids(llm.generate(prompts(slice(None, None, -1)), GREEDY)) == reference[::-1]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.state_checkpoints.restored > 0
    spec = stats.spec
    assert spec.num_accepted_tokens > 10, spec  # proposals kept, ...
    assert spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec  # ... and rejected
    assert_nothing_held(llm)


def test_a_mixture_of_experts_target(tiny_hybrid_checkpoint):
    path = str(tiny_hybrid_checkpoint("moe", INIT))
    want = token_ids(LLM(path, dtype="float32").generate(prompts()[:2], GREEDY))
    llm = LLM(path, dtype="float32", speculative_config=spec_config("ngram", None))
    assert token_ids(llm.generate(prompts()[:2], GREEDY)) == want
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 5 and spec.num_proposed_tokens - spec.num_accepted_tokens > 5, spec
    assert_nothing_held(llm)


def test_bf16_on_the_native_path_is_unchanged_too(hybrid):
    """The DeltaNet kernels run a verification chunk token by token, as decodes: in bf16 the
    tokens and their logprobs are the same bits as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = LLM(str(hybrid), dtype="bfloat16").generate(prompts(), params)
    llm = LLM(str(hybrid), dtype="bfloat16", speculative_config=spec_config("ngram", None))
    got = llm.generate(prompts(), params)
    assert token_ids(got) == token_ids(base)
    for mine, theirs in zip(got, base, strict=True):
        assert [{t: p.logprob for t, p in row.items()} for row in mine.outputs[0].logprobs] == [
            {t: p.logprob for t, p in row.items()} for row in theirs.outputs[0].logprobs]
    assert llm.engine.stats().spec.num_accepted_tokens > 5
    assert_nothing_held(llm)


def test_nothing_leaks_after_aborts_mid_draft_rejections_and_errors(hybrid, reference):
    llm = LLM(str(hybrid), dtype="float32", max_model_len=128, state_checkpoint_interval=1,
              speculative_config=spec_config("ngram", None))
    engine = llm.engine
    aborted = set()

    def abort_some(outputs):
        for out in outputs:
            if out.request_id not in aborted and len(out.outputs[0].token_ids) >= 5 and int(out.request_id.split("-")[-1]) % 2:
                aborted.add(out.request_id)
                engine.abort_request(out.request_id)

    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=s)
              for s, t in enumerate([0, 0.8, 0, 1.0])]
    outs = llm.generate(prompts(), params, on_step=abort_some)
    assert aborted and any(o.outputs[0].finish_reason == "abort" for o in outs)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(prompts()[:2], [SamplingParams(), SamplingParams(max_tokens=0)])
    spec = engine.stats().spec
    assert spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec
    assert_nothing_held(llm)
    # The engine still serves, and greedy text is still the target's.
    assert token_ids(llm.generate(prompts()[2:3], GREEDY)) == reference[2:3]


def test_a_hybrid_draft_model_is_refused_by_name(hybrid):
    with pytest.raises(TuiliError, match="is a hybrid model .*draft model must be full attention"):
        LLM(str(hybrid), dtype="float32",
            speculative_config={"model": "self", "quantization": "int4", "num_speculative_tokens": 2})
