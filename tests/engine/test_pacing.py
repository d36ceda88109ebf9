"""Pacing: prompt chunks beside decodes are cut so the decoding sequences are not stalled."""

from __future__ import annotations

import pytest

from tuili import LLM, SamplingParams
from tuili.engine.block_manager import BlockManager
from tuili.engine.pacing import StepPacer
from tuili.engine.request import Sequence
from tuili.engine.scheduler import Scheduler
from tuili.engine.stats import StepRecord
from tuili.errors import TuiliError


def _record(seconds: float, prompt_tokens: int = 0, decodes: int = 0) -> StepRecord:
    chunks = [(0, prompt_tokens)] if prompt_tokens else []
    return StepRecord(chunks, [100] * decodes, decodes, 0, prompt_tokens, seconds, synchronized=True)


def test_pacer_budget_is_the_stretch_over_the_measured_cost_of_a_prompt_token():
    pacer = StepPacer(stretch=2.0)
    assert pacer.prefill_limit() is None  # nothing measured: no limit
    pacer.on_step(_record(0.010, decodes=4))
    assert pacer.prefill_limit() is None  # the cost of a prompt token is not known yet
    pacer.on_step(_record(0.060, prompt_tokens=100, decodes=4))  # 50 ms over a decode step: 0.5 ms a token
    assert pacer.prefill_limit() == 20  # (2 - 1) x 10 ms / 0.5 ms
    assert StepPacer(stretch=3.0).prefill_limit() is None
    slower = StepPacer(stretch=3.0)
    for record in (_record(0.010, decodes=4), _record(0.060, prompt_tokens=100, decodes=4)):
        slower.on_step(record)
    assert slower.prefill_limit() == 40
    unsynchronized = StepRecord([], [100], 1, 0, 0, 5.0, synchronized=False)
    pacer.on_step(unsynchronized)  # a GPU step timed without its device work says nothing
    assert pacer.prefill_limit() == 20


def test_pacer_follows_the_load_and_always_lets_prompts_progress():
    pacer = StepPacer(stretch=2.0)
    pacer.on_step(_record(0.010, decodes=4))
    pacer.on_step(_record(1.010, prompt_tokens=100, decodes=4))  # 10 ms a prompt token
    assert pacer.prefill_limit() == 1  # at least one token a step
    for _ in range(30):
        pacer.on_step(_record(0.100, decodes=64))  # a heavier batch: slower decode steps
    assert pacer.prefill_limit() >= 9


@pytest.mark.parametrize("stretch", [1.0, 0.5, True, "2"])
def test_a_stretch_that_is_not_above_one_is_refused(tiny_llama, stretch):
    with pytest.raises(TuiliError, match="max_itl_stretch"):
        LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_itl_stretch=stretch)


def _sequence(seq_id: int, prompt_len: int, group: str) -> Sequence:
    from tuili.sampling import SamplingParams as Params

    return Sequence(seq_id, f"r{seq_id}", 0, list(range(1, prompt_len + 1)), prompt_len, Params(), group=group)


def test_a_prefill_limit_cuts_prompt_work_only_beside_decodes_and_shares_it_between_groups():
    scheduler = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), max_num_batched_tokens=64,
                          max_num_seqs=8)
    first = _sequence(0, 6, "a")
    scheduler.add(first)
    out = scheduler.schedule(prefill_limit=4)  # nothing decodes yet: the whole prompt
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(first, 6)]
    scheduler.update(out)
    first.token_ids.append(7)  # its first generated token: it decodes from now on

    long_b, long_c = _sequence(1, 40, "b"), _sequence(2, 40, "c")
    scheduler.add(long_b)
    scheduler.add(long_c)
    out = scheduler.schedule(prefill_limit=4)
    planned = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
    # The decode, and the limit's 4 prompt tokens: a share (4 // 3 groups) for each group that
    # waits, the rest to the oldest.
    assert planned == {0: 1, 1: 3, 2: 1}
    scheduler.update(out)
    first.token_ids.append(8)

    out = scheduler.schedule(prefill_limit=None)  # no limit: the budget, shared as before
    planned = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
    assert planned[0] == 1 and sum(planned.values()) == 64


def test_paced_engine_keeps_prompt_chunks_within_the_pacers_budget_and_outputs_unchanged(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 60 + 7 * i))} for i in range(5)]
    reference = LLM(model=str(tiny_llama), device="cpu", dtype="float32", block_size=4).generate(prompts, params)

    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", block_size=4, max_itl_stretch=1.5)
    engine = llm.engine
    limits: list[int | None] = [None]  # the limit each step was scheduled with

    class Steps(list):
        wants_device_time = False

        def on_step(self, record):  # after the pacer (added first), so its figures include this step
            self.append(record)
            limits.append(engine.pacer.prefill_limit())

    steps = Steps()
    engine.add_observer(steps)
    request_ids, finished = [], {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out

    for i, prompt in enumerate(prompts):  # each prompt arrives while the ones before it decode
        request_ids.append(engine.add_request(prompt, params))
        for _ in range(3 + i):
            step()
    while engine.has_unfinished_requests():
        step()
    paced = [s for s, limit in zip(steps, limits, strict=False) if limit is not None and s.decode_context_lens]
    assert paced, "some step should have carried decodes with the pacer's budget known"
    for step, limit in zip(steps, limits, strict=False):
        if limit is not None and step.decode_context_lens:
            assert sum(n for _, n in step.prefill_chunks) <= limit
    got = [finished[request_id].outputs[0].token_ids for request_id in request_ids]
    assert got == [r.outputs[0].token_ids for r in reference]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
