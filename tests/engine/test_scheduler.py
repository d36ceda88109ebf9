"""Continuous batching, chunked prefill and preemption, observed through the engine."""

from __future__ import annotations

from tuili import LLM, SamplingParams

BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K+V x 2 layers x 4 tokens x 2 KV heads x 16 dims x fp32

PROMPTS = [list(range(10 + i, 22 + 2 * i)) for i in range(6)]


class _Steps(list):
    """An engine observer keeping every StepRecord."""

    wants_device_time = False

    def on_step(self, record):
        self.append(record)


def _llm(path, num_blocks, **kw):
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=4,
               kv_cache_memory=num_blocks * BLOCK_BYTES, **kw)


def test_preempted_requests_finish_with_identical_outputs(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    reference = _llm(tiny_llama, 512).generate(prompts, params)

    small = _llm(tiny_llama, 14, max_model_len=48, max_num_batched_tokens=32)
    outs = small.generate(prompts, params)
    stats = small.engine.stats()
    assert stats.num_preemptions, "the pool was meant to be too small for all requests at once"
    for ref, out in zip(reference, outs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 24
    assert stats.num_free_blocks == stats.num_blocks


def test_seeded_sampling_survives_preemption(tiny_llama):
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(6)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    reference = _llm(tiny_llama, 512).generate(prompts, params)
    small = _llm(tiny_llama, 14, max_model_len=48, max_num_batched_tokens=32)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]


def test_steps_mix_decodes_with_prompt_chunks_within_budget(tiny_llama):
    llm = _llm(tiny_llama, 512, max_num_batched_tokens=8, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    steps = _Steps()
    llm.engine.add_observer(steps)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(s.num_tokens <= 8 for s in steps)
    assert all(len(s.prefill_chunks) + len(s.decode_context_lens) <= 3 for s in steps)
    mixed = [s for s in steps if s.decode_context_lens and any(n > 1 for _, n in s.prefill_chunks)]
    assert mixed, "some step should carry both decodes and a prompt chunk"
    # No prompt shares a first block with another, so a chunk past position 0 continues a prompt.
    chunked = [s for s in steps for start, n in s.prefill_chunks if n > 1 and start > 0]
    assert chunked, "prompts longer than the budget are prefilled in several chunks"


def test_continuous_batching_admits_new_requests_while_others_run(tiny_llama):
    llm = _llm(tiny_llama, 512)
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], long)[0].outputs[0].token_ids

    first = engine.add_request({"prompt_token_ids": PROMPTS[0]}, long)
    for _ in range(5):
        engine.step()
    second = engine.add_request({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0.0, max_tokens=3))
    order, results = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                results[out.request_id] = out
    assert order == [second, first], "the short late request joins the running batch and leaves first"
    assert results[first].outputs[0].token_ids == alone


def _steps_until_finished(engine, request_id, limit=200):
    """Step the engine until `request_id` finishes; return how many steps that took."""
    for step in range(1, limit + 1):
        if any(out.request_id == request_id and out.finished for out in engine.step()):
            return step
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


def test_a_call_holding_every_slot_makes_room_for_a_small_request(tiny_llama):
    """Eight requests of one call (group) take all four slots; a 2-token request that comes
    later gets a slot at once (a sequence of the call is preempted), not after the call."""
    llm = _llm(tiny_llama, 512, max_num_seqs=4)
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]] * 4, long)]
    call = [engine.add_request({"prompt_token_ids": p}, long, f"call-{i}", group="call")
            for i, p in enumerate(PROMPTS[:2] * 4)]
    for _ in range(3):
        engine.step()
    small = engine.add_request({"prompt_token_ids": PROMPTS[5]}, SamplingParams(temperature=0.0, max_tokens=2))
    assert _steps_until_finished(engine, small) <= 3
    assert engine.stats().num_preemptions >= 1
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert [results[r].outputs[0].token_ids for r in call] == alone, "preemption changed no output"


def test_a_call_prefilling_long_prompts_leaves_a_share_of_the_budget(tiny_llama):
    """Four long prompts of one call being prefilled would take the whole token budget for
    many steps; a small request gets its share and finishes in a few."""
    llm = _llm(tiny_llama, 512, max_num_batched_tokens=16, max_num_seqs=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(4):
        engine.add_request({"prompt_token_ids": list(range(1 + i, 121 + i))}, params, f"long-{i}", group="call")
    engine.step()
    small = engine.add_request({"prompt_token_ids": PROMPTS[0][:6]}, SamplingParams(temperature=0.0, max_tokens=2))
    assert _steps_until_finished(engine, small) <= 3
    assert engine.has_unfinished_requests(), "the long prompts are still being prefilled"


def test_fair_shares_under_preemption_keep_outputs_and_invariants(tiny_llama):
    """Three groups arriving over time, a pool small enough to preempt, few slots and a small
    budget: every request's output equals its run alone, the budget and slots hold, and the
    pool ends empty."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(3 + i, 15 + 3 * i)) for i in range(9)]
    reference = [o.outputs[0].token_ids for o in _llm(tiny_llama, 512).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    llm = _llm(tiny_llama, 20, max_model_len=48, max_num_batched_tokens=12, max_num_seqs=3)
    engine, steps = llm.engine, _Steps()
    engine.add_observer(steps)
    results, pending = {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):  # two requests arrive every step, in groups a, b, c
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request({"prompt_token_ids": prompt}, params, f"r{i}", group="abc"[i % 3])
        for out in engine.step():
            results[out.request_id] = out
    assert [results[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == reference
    assert all(s.num_tokens <= 12 and len(s.prefill_chunks) + len(s.decode_context_lens) <= 3 for s in steps)
    stats = engine.stats()
    assert stats.num_preemptions and stats.num_free_blocks == stats.num_blocks
