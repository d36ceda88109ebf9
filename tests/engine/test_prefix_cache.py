"""Prefix caching and its host tier: same outputs, fewer computed tokens, no leaked blocks."""

from __future__ import annotations

import random

from tuili import LLM, SamplingParams

BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K+V x 2 layers x 4 tokens x 2 KV heads x 16 dims x fp32
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(path, num_blocks=512, max_model_len=64, **kw):
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=4,
               kv_cache_memory=num_blocks * BLOCK_BYTES, max_model_len=max_model_len, **kw)


def _shared_prefix_prompts(seed=0, count=8):
    rng = random.Random(seed)
    system = [rng.randrange(1, 320) for _ in range(13)]  # not a multiple of the block size
    return [{"prompt_token_ids": system + [rng.randrange(1, 320) for _ in range(rng.randrange(1, 7))]}
            for _ in range(count)]


def _texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_no_leaks(llm):
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert all(b.ref_count == 0 for b in llm.engine.block_manager.blocks)


def test_outputs_identical_with_caching_on_and_off(tiny_llama):
    prompts = _shared_prefix_prompts()
    off = _llm(tiny_llama, enable_prefix_caching=False)
    on = _llm(tiny_llama)
    reference = _texts(off.generate(prompts, GREEDY))
    first = on.generate(prompts[:1], GREEDY)  # warm the cache with the shared prefix
    rest = on.generate(prompts[1:], GREEDY)
    assert _texts(first + rest) == reference
    assert all(o.metrics.num_cached_tokens == 12 for o in rest)  # 3 full blocks of the 13 shared
    assert on.engine.stats().prefix_cache.device_hit_tokens == 12 * len(rest)
    _assert_no_leaks(on)
    assert on.engine.stats().num_cached_blocks > 0


def test_n_greater_than_one_and_seeds_with_caching(tiny_llama):
    prompts = _shared_prefix_prompts(seed=1, count=4)
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, ignore_eos=True)
    off = _texts(_llm(tiny_llama, enable_prefix_caching=False).generate(prompts, params))
    on_llm = _llm(tiny_llama)
    on_llm.generate(prompts, params)
    assert _texts(on_llm.generate(prompts, params)) == off  # second run: mostly cache hits
    _assert_no_leaks(on_llm)


def test_identical_under_preemption(tiny_llama):
    prompts = _shared_prefix_prompts(seed=2, count=8)
    reference = _texts(_llm(tiny_llama, enable_prefix_caching=False).generate(prompts, GREEDY))
    small = _llm(tiny_llama, num_blocks=20, max_num_batched_tokens=24)
    outs = small.generate(prompts, GREEDY)
    assert small.engine.stats().num_preemptions
    assert _texts(outs) == reference
    _assert_no_leaks(small)


def test_host_tier_serves_evicted_blocks_and_survives_thrashing(tiny_llama):
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 320) for _ in range(30)]} for _ in range(6)]
    reference = _texts(_llm(tiny_llama, enable_prefix_caching=False).generate(prompts, GREEDY))
    # 24 device blocks hold about two sequences (11 blocks each): every new prompt evicts
    # older cached blocks to the host tier, whose 20 slots are far fewer than the blocks
    # evicted, so it evicts too. Short reuse distances hit on the host, long ones miss.
    llm = _llm(tiny_llama, num_blocks=24, kv_offload_memory=20 * BLOCK_BYTES)
    for i in [0, 1, 2, 1, 3, 0, 4, 2, 5, 3, 1, 0, 5]:
        assert _texts(llm.generate([prompts[i]], GREEDY)) == [reference[i]]
    assert llm.engine.stats().prefix_cache.host_hit_tokens > 0
    assert len(llm.engine.block_manager.host) == 20
    _assert_no_leaks(llm)


def test_multi_turn_computes_only_new_tokens(tiny_llama):
    llm = _llm(tiny_llama, max_model_len=200, num_blocks=512)
    rng = random.Random(4)
    history: list[int] = []
    for turn in range(6):
        new = [rng.randrange(1, 320) for _ in range(rng.randrange(3, 9))]
        history = history + new
        before = llm.engine.stats().prompt_tokens_computed
        out = llm.generate([{"prompt_token_ids": history}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
        computed = llm.engine.stats().prompt_tokens_computed - before
        if turn == 0:
            assert computed == len(history)
        else:
            # Everything before this turn's new tokens was cached except the partial last block
            # (at most block_size - 1 tokens) and the last answer token, which never had its KV written.
            assert computed <= len(new) + 4
        history = history + out.outputs[0].token_ids
    _assert_no_leaks(llm)
