"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax, in
float32: each prompt token's logprob and rank and the top-k, scored chunk by chunk as the
prefill runs (budgets that split prompts at odd positions), the same with a warm prefix cache,
under preemption, with n > 1, and on a hybrid model (Qwen3.5) with state checkpoints. Also the
vLLM `Logprob` objects of generated tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from tuili import LLM, Logprob, SamplingParams
from tuili.engine import prompt_logprobs as scoring
from tuili.errors import RequestError

TOLERANCE = dict(atol=2e-5, rtol=1e-5)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # tiny_llama: K+V x 2 layers x 4 tokens x 2 KV heads x 16 dims x fp32


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 320) for _ in range(21)]
    return [
        shared + [rng.randrange(1, 320) for _ in range(9)],
        [rng.randrange(1, 320) for _ in range(37)],
        shared + [rng.randrange(1, 320) for _ in range(4)],
        [rng.randrange(1, 320) for _ in range(2)],
        [rng.randrange(1, 320)],  # one token: nothing to score but None
    ]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    """transformers' log_softmax of the logits of every prompt position, per prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def reference(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return reference


def _llm(path, **options) -> LLM:
    return LLM(model=str(path), **{"dtype": "float32", "device": "cpu", "block_size": 4, "max_model_len": 64,
                                   "kv_cache_memory": 512 * BLOCK_BYTES} | options)


def _assert_matches(prompt: list[int], got, reference: torch.Tensor, k: int) -> None:
    """`got` (RequestOutput.prompt_logprobs) against transformers' log_softmax rows."""
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = got[position], reference[position - 1], prompt[position]
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        torch.testing.assert_close(torch.tensor(entry[token].logprob), row[token], **TOLERANCE)
        assert entry[token].rank == int((row >= row[token]).sum())
        values, ids = row.topk(k)
        assert set(ids.tolist()) <= set(entry), f"position {position}: top-{k} missing"
        for rank, (t, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
            assert entry[t].rank == rank
            torch.testing.assert_close(torch.tensor(entry[t].logprob), torch.tensor(value), **TOLERANCE)
        assert len(entry) == k + (token not in ids.tolist())


@pytest.mark.parametrize("budget", [7, 13])
def test_prompt_logprobs_match_transformers_with_prompts_split_at_odd_positions(tiny_llama, hf_logprobs, budget,
                                                                                 monkeypatch):
    monkeypatch.setattr(scoring, "PROJECT_ROWS", 5)  # several projection blocks per chunk, cut mid-chunk
    llm = _llm(tiny_llama, max_num_batched_tokens=budget, enable_prefix_caching=False)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_matches(prompt, out.prompt_logprobs, hf_logprobs(prompt), 3)
        assert len(out.outputs[0].token_ids) == 3


def test_zero_alternatives_give_the_prompt_token_alone(tiny_llama, hf_logprobs):
    prompt = _prompts()[1]
    out = _llm(tiny_llama).generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    reference = hf_logprobs(prompt)
    for position in range(1, len(prompt)):
        assert list(out.prompt_logprobs[position]) == [prompt[position]]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[position][prompt[position]].logprob),
                                   reference[position - 1, prompt[position]], **TOLERANCE)
    assert _llm(tiny_llama).generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))[0].prompt_logprobs \
        is None


def test_a_warm_prefix_cache_gives_the_cold_prompt_logprobs(tiny_llama, hf_logprobs):
    prompts = _prompts(seed=1)
    llm = _llm(tiny_llama, max_num_batched_tokens=11)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], plain)  # every prompt's full blocks cached
    queried_before = llm.engine.stats().prefix_cache.queried_tokens
    cached_before = llm.engine.stats().prefix_cache.device_hit_tokens
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_matches(prompt, out.prompt_logprobs, hf_logprobs(prompt), 2)
        assert out.metrics.num_cached_tokens == 0  # it took no cached prefix ...
    assert llm.engine.stats().prefix_cache.device_hit_tokens == cached_before
    assert llm.engine.stats().prefix_cache.queried_tokens == queried_before  # no lookup, so no query counted
    again = llm.generate([{"prompt_token_ids": prompts[1]}], plain)[0]  # ... and the cache still serves others
    assert again.metrics.num_cached_tokens == 36
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_preemption_and_n_keep_prompt_logprobs_right(tiny_llama, hf_logprobs):
    prompts = _prompts(seed=2)[:4]
    # 24 blocks (96 tokens) for 4 prompts x n=2 of up to 58 tokens each: sequences are preempted
    # mid-prefill and after it, and recompute.
    llm = _llm(tiny_llama, kv_cache_memory=24 * BLOCK_BYTES, max_num_batched_tokens=9)
    params = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_matches(prompt, out.prompt_logprobs, hf_logprobs(prompt), 1)
        assert [len(c.token_ids) for c in out.outputs] == [20, 20]
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_generated_logprobs_are_logprob_objects(tiny_llama):
    out = _llm(tiny_llama).generate({"prompt_token_ids": [5, 6, 7]},
                                    SamplingParams(temperature=1.0, seed=0, max_tokens=12, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 12
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
        top = [t for t, lp in ranked if lp.rank <= 2]
        assert [entry[t].rank for t in top[:2]] == [1, 2]
        assert entry[token].rank >= 1 and (token in top or entry[token].rank > 2)
        assert entry[token].decoded_token is None  # no tokenizer files
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_prompt_logprobs_are_refused_by_name(value):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_hybrid_model_with_state_checkpoints(tmp_path):
    """Qwen3.5 (Gated DeltaNet + full attention): the cache holds state checkpoints, which a
    scoring request must not restore from either."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=320, hidden_size=48, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, initializer_range=0.1,
        rms_norm_eps=1e-6, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
        linear_num_key_heads=2, linear_num_value_heads=6,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model.save_pretrained(tmp_path)
    prompts = _prompts(seed=4)[:3]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, state_checkpoint_interval=2,
              kv_cache_memory=1 << 20, max_num_batched_tokens=7)
    assert llm.engine.scheduler.checkpoints is not None
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))  # warm the cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=2))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        _assert_matches(prompt, out.prompt_logprobs, reference, 2)
    assert llm.engine.scheduler.state_slots.num_free == llm.engine.scheduler.state_slots.num_slots


def test_tensor_parallel_workers_project_the_same_blocks(tiny_llama, hf_logprobs):
    """TP=2 (gloo, real processes): each block of prompt rows is a collective (the logits are
    gathered to rank 0), so a 150-token prompt (two blocks) must match on every rank."""
    prompt = [int(t) for t in torch.randint(1, 320, (150,), generator=torch.Generator().manual_seed(5))]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=256,
              kv_cache_memory=1 << 22, max_num_batched_tokens=256)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
        follow = llm.generate({"prompt_token_ids": prompt[:20]}, SamplingParams(max_tokens=3, temperature=0))[0]
    finally:
        llm.engine.close()
    assert len(prompt) - 1 > scoring.PROJECT_ROWS
    _assert_matches(prompt, out.prompt_logprobs, hf_logprobs(prompt), 2)
    assert len(follow.outputs[0].token_ids) == 3  # the ranks are still in step


def test_no_more_than_a_block_of_prompt_logits_exists_at_once(tiny_llama, hf_logprobs, monkeypatch):
    """A 200-token prompt in one 256-token chunk: the head is asked for at most PROJECT_ROWS
    rows at a time (here 16), never the chunk's 199 scoring rows."""
    monkeypatch.setattr(scoring, "PROJECT_ROWS", 16)
    llm = _llm(tiny_llama, max_model_len=256, max_num_batched_tokens=256)
    head = llm.engine.model.compute_logits
    rows_asked: list[int] = []

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows_asked.append(hidden.shape[0])
        return head(hidden)

    monkeypatch.setattr(llm.engine.model, "compute_logits", counting)
    prompt = [int(t) for t in torch.randint(1, 320, (200,), generator=torch.Generator().manual_seed(6))]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    _assert_matches(prompt, out.prompt_logprobs, hf_logprobs(prompt), 1)
    assert max(rows_asked) == 16 and sum(r for r in rows_asked if r > 1) >= 199
