"""Prefix caching for a hybrid model (Qwen3-Next): KV shared by blocks, linear-attention state
restored from checkpoints at block boundaries (tuili/engine/state_checkpoints.py).

A tiny random Qwen3-Next checkpoint written with `save_pretrained`; prompts that share
prefixes of several depths with one run before them must hit exactly as deep as the deepest
checkpoint at or below their cached KV, and give the same greedy tokens as a cold engine
(prefix caching off) and as transformers, in float32. With a 7-token step budget the
checkpoints fall inside prefill chunks (the chunk is cut there) and at their ends. Also: a
~200-token shared prefix hits with the default block size and interval; slots, checkpoints
and blocks are all returned after finish, abort, preemption and a failed step; LRU eviction;
`tuili plan` counts the checkpoint bytes the pool plan reserves.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.config import EngineConfig, ModelConfig
from tuili.engine.block_manager import BlockCopies
from tuili.engine.cli import add_engine_args, engine_kwargs
from tuili.engine.pool import kv_bytes_per_block, plan_pool, state_bytes_per_slot
from tuili.engine.request import Sequence
from tuili.engine.state_checkpoints import StateCheckpoints
from tuili.errors import TuiliError
from tuili.perf.cost import ModelCost
from tuili.perf.plan import state_checkpoint_bytes

CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1,
    rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
STEPS = 12
BASE = [int(t) for t in torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(1))]
# (prompt, tokens cached when it runs after BASE, at block size 4 and a checkpoint every 8 tokens):
# the cached KV is cut to the deepest checkpoint at or below it. Each one's greedy tokens lead
# the runner-up by >= 0.018 logits at every step: the CUDA variant (fla's kernels, whose triangular
# solve multiplies in TF32, ~1e-3 off) must not meet a near-tie (`[5] * 6` had one of 0.0007).
FOLLOWERS = [
    (BASE[:45] + [1, 2, 3], 40),  # 44 tokens of KV match (11 blocks), the checkpoint at 40
    (BASE[:20] + [9] * 10, 16),  # 20 tokens of KV, the checkpoint at 16
    (BASE[:9] + [4, 4], 8),  # the shallowest checkpoint
    (BASE[:7] + [6] * 6, 0),  # one block of KV but no checkpoint below it: computed in full
    (BASE + [5, 6, 7], 56),  # extends BASE: 60 tokens of KV (the 63rd is computed), checkpoint at 56
]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3NextConfig(**CONFIG), attn_implementation="eager"
    ).float().eval()
    path = tmp_path_factory.mktemp("qwen3next")
    model.save_pretrained(path)
    greedy = {}
    with torch.no_grad():  # transformers' greedy decoding with its own (recurrent) cache
        for prompt in [BASE] + [f for f, _ in FOLLOWERS]:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
            greedy[tuple(prompt)] = out[0, len(prompt) :].tolist()
    return path, greedy


@pytest.fixture(scope="module")
def sizes(hybrid):
    """(bytes of one KV block of 4 tokens, bytes of one sequence's state) in float32."""
    cfg = ModelConfig.from_hf_config(transformers.Qwen3NextConfig(**CONFIG).to_dict()
                                     | {"architectures": ["Qwen3NextForCausalLM"]})  # fmt: skip
    return kv_bytes_per_block(cfg, 4, torch.float32), state_bytes_per_slot(cfg, torch.float32)


def _llm(path, **options) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=4, state_checkpoint_interval=2,
                   kv_cache_memory=1 << 20) | options  # fmt: skip
    return LLM(model=str(path), **options)


PARAMS = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def _run(llm: LLM, prompt: list[int], max_tokens: int = STEPS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params)[0]


def _assert_all_returned(llm: LLM) -> None:
    """Every state slot and KV block free; every checkpoint free or filed, none pending."""
    scheduler = llm.engine.scheduler
    assert scheduler.state_slots.num_free == scheduler.state_slots.num_slots
    checkpoints = scheduler.checkpoints
    assert checkpoints.num_pending == 0
    assert checkpoints.num_free + checkpoints.num_filed == checkpoints.num_checkpoints
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
)
@pytest.mark.parametrize("budget", [7, 512])
def test_hits_at_several_depths_give_the_cold_output(hybrid, budget, device):
    """On a CUDA GPU with fla-core, checkpoints inside chunks cut fla's chunked kernel into pieces."""
    path, greedy = hybrid
    llm = _llm(path, max_num_batched_tokens=budget, device=device)
    cold = _llm(path, max_num_batched_tokens=budget, enable_prefix_caching=False, device=device)
    assert llm.engine.pool.num_state_checkpoints > 0
    out = _run(llm, BASE)
    assert out.metrics.num_cached_tokens == 0 and out.outputs[0].token_ids == greedy[tuple(BASE)]
    assert llm.engine.scheduler.checkpoints.num_filed == 7  # 8, 16, ..., 56: inside BASE's 60 tokens
    hits = 0
    for prompt, cached in FOLLOWERS:
        out = _run(llm, prompt)
        assert out.metrics.num_cached_tokens == cached, prompt
        tokens = out.outputs[0].token_ids
        assert tokens == greedy[tuple(prompt)] == _run(cold, prompt).outputs[0].token_ids
        hits += cached
    stats = llm.engine.stats()
    assert stats.prefix_cache.hit_tokens == hits and stats.prefix_cache.device_hit_tokens == hits
    # the counters the server exports (tuili:state_checkpoints_* in /metrics)
    checkpoints = llm.engine.scheduler.checkpoints
    assert stats.state_checkpoints.restored == sum(1 for _, c in FOLLOWERS if c)
    assert stats.state_checkpoints.saved >= 7 and stats.state_checkpoints.filed == checkpoints.num_filed
    assert stats.state_checkpoints.capacity == llm.engine.pool.num_state_checkpoints
    assert cold.engine.stats().state_checkpoints is None
    _assert_all_returned(llm)


def test_a_200_token_shared_prefix_hits_with_the_defaults(hybrid):
    """Block size 16 and a checkpoint every 4 blocks: a 200-token system prompt hits at 192."""
    path, _ = hybrid
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory=4 << 20)
    cold = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory=4 << 20, enable_prefix_caching=False)
    assert llm.engine.pool.block_size == 16 and llm.engine.config.state_checkpoint_interval == 4
    system = [int(t) for t in torch.randint(0, 320, (200,), generator=torch.Generator().manual_seed(2))]
    for i, question in enumerate(([10, 11, 12], [20, 21, 22, 23])):
        out = _run(llm, system + question)
        assert out.metrics.num_cached_tokens == (192 if i else 0)
        assert out.outputs[0].token_ids == _run(cold, system + question).outputs[0].token_ids
    _assert_all_returned(llm)


def test_everything_is_returned_after_preemption_abort_and_a_failed_step(hybrid, sizes, monkeypatch):
    path, greedy = hybrid
    block, state = sizes
    # A pool too small for all prompts at once (3 slots, 1 checkpoint, 20 blocks): the newest
    # sequences are preempted and, readmitted, restore what checkpoint is left.
    llm = _llm(path, kv_cache_memory=20 * block + 4 * state, max_model_len=80, max_num_seqs=3,
               max_num_batched_tokens=9)  # fmt: skip
    engine = llm.engine
    assert (engine.pool.num_state_slots, engine.pool.num_state_checkpoints, engine.pool.num_blocks) == (3, 1, 20)
    prompts = [BASE] + [f for f, _ in FOLLOWERS[:3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == greedy[tuple(prompt)]
    _assert_all_returned(llm)

    # Abort mid-prefill, with checkpoints reserved for the chunk in flight.
    ids = [engine.add_request({"prompt_token_ids": [7] + p}, PARAMS) for p in prompts[:2]]
    engine.step()
    assert engine.scheduler.checkpoints.num_pending == 0  # filed by update()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_returned(llm)

    # A step whose forward raises: its reserved checkpoints are given back by the next schedule.
    request_id = engine.add_request({"prompt_token_ids": [8] + BASE}, PARAMS)
    runner_execute = engine.runner.execute

    def fail(batch, proposals=None):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "execute", fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.scheduler.checkpoints.num_pending > 0
    monkeypatch.setattr(engine.runner, "execute", runner_execute)
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_returned(llm)
    assert _run(llm, BASE).outputs[0].token_ids == greedy[tuple(BASE)]


def test_eviction_under_memory_pressure_keeps_outputs_right(hybrid, sizes):
    """A quarter of the budget holds 3 checkpoints. BASE, one chunk, crosses 7 boundaries: the
    3 deepest are saved. A later save evicts the least recently used of them."""
    path, greedy = hybrid
    llm = _llm(path, kv_cache_memory=13 * sizes[1], max_num_seqs=1)
    engine = llm.engine
    assert engine.pool.num_state_checkpoints == 3
    _run(llm, BASE)
    checkpoints = engine.scheduler.checkpoints
    assert checkpoints.num_filed == 3 and checkpoints.stats.saved == 3  # 40, 48, 56
    cold = _llm(path, enable_prefix_caching=False)
    for prompt, cached in (
        (FOLLOWERS[4][0], 56),  # extends BASE: uses 56 (LRU now 40, 48, 56)
        (FOLLOWERS[0][0], 40),  # uses 40 (LRU 48, 56, 40); saving its own 48 evicts BASE's 48
        (BASE[:50] + [3, 3], 40),  # 48 tokens of KV match, BASE's 48 is gone; saving it again evicts 56
        (BASE + [9], 48),  # 60 tokens of KV match: 56 is gone, 48 is back; saving 56 again evicts 48'
    ):  # fmt: skip
        out = _run(llm, prompt, max_tokens=4)  # the hits are the point here; outputs: the test above
        assert out.metrics.num_cached_tokens == cached
        assert out.outputs[0].token_ids == _run(cold, prompt, max_tokens=4).outputs[0].token_ids
    assert (checkpoints.stats.saved, checkpoints.stats.evicted, checkpoints.num_filed) == (6, 3, 3)
    _assert_all_returned(llm)


def _sequence(seq_id: int, digests: list[bytes]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(range(4 * len(digests) + 1)), 4 * len(digests) + 1, PARAMS)
    seq.block_digests = digests
    return seq


def test_checkpoints_are_evicted_least_recently_used_first():
    checkpoints = StateCheckpoints(num_checkpoints=2, block_size=4, interval_blocks=1)
    a, b, c = (_sequence(i, [bytes([i])]) for i in range(3))
    for seq in (a, b):
        assert [depth for depth, _ in checkpoints.reserve(seq, 0, 4)] == [4]
        checkpoints.commit()
    assert checkpoints.deepest([bytes([0])]) == (4, 0)  # a hit on a: b is now the oldest
    checkpoints.reserve(c, 0, 5)
    checkpoints.commit()
    assert checkpoints.deepest([bytes([1])]) is None  # b evicted
    assert checkpoints.deepest([bytes([0])]) == (4, 0) and checkpoints.deepest([bytes([2])]) == (4, 1)
    assert checkpoints.stats.evicted == 1
    checkpoints.commit()  # the step that restored them ends: they may be evicted again
    # Every id pending in one step: the deepest boundaries get them, no pending one is overwritten.
    d = _sequence(3, [bytes([3]), bytes([4]), bytes([5])])
    assert [depth for depth, _ in checkpoints.reserve(d, 0, 12)] == [8, 12] and checkpoints.num_free == 0
    checkpoints.reset_pending()  # that step failed
    assert checkpoints.num_free == 2 and checkpoints.num_filed == 0 and checkpoints.num_pending == 0


def test_evicted_checkpoints_spill_to_the_host_tier_and_come_back():
    """With a host tier, eviction copies a checkpoint to a host slot first, and a lookup that
    finds it there only takes a device id for it and has it copied back. A checkpoint handed out
    for a restore is not evicted in the same step (its row is read by the forward, after the
    copies), and the copies are handed over once, spills before loads."""
    checkpoints = StateCheckpoints(num_checkpoints=1, block_size=4, interval_blocks=1, num_host_checkpoints=2)
    a, b = (_sequence(i, [bytes([i])]) for i in range(2))
    checkpoints.reserve(a, 0, 4)
    checkpoints.commit()  # a's checkpoint in id 0
    assert checkpoints.reserve(b, 0, 4) == ((4, 0),)  # evicts a's: spilled to host slot 1
    copies = BlockCopies()
    checkpoints.take_copies(copies)
    assert copies.states_to_host == [(0, 1)] and copies.states_to_device == []
    checkpoints.commit()  # b's checkpoint in id 0
    assert checkpoints.deepest([bytes([0])]) == (4, 0)  # a's, back from the host: b's spilled first
    copies = BlockCopies()
    checkpoints.take_copies(copies)
    assert copies.states_to_host == [(0, 0)] and copies.states_to_device == [(1, 0)]
    assert checkpoints.reserve(_sequence(2, [bytes([2])]), 0, 4) == ()  # id 0 is being restored from
    checkpoints.commit()
    assert checkpoints.deepest([bytes([1])]) == (4, 0)  # b's, from host slot 0; evicting a's copies nothing
    copies = BlockCopies()
    checkpoints.take_copies(copies)
    assert copies.states_to_host == [] and copies.states_to_device == [(0, 0)]
    stats = checkpoints.snapshot()
    assert (stats.spilled, stats.host_restored, stats.evicted, stats.host_capacity) == (2, 2, 3, 2)


@pytest.mark.parametrize("budget_mib", [1, 8, 64])
def test_tuili_plan_counts_the_checkpoint_bytes_the_pool_plan_reserves(budget_mib):
    """bf16 working dtype (the ruler's conv state dtype), default block size and interval; the
    KV floor does not bind (no max_model_len, two slots), so both are the share rule alone."""
    raw = transformers.Qwen3NextConfig(**CONFIG).to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}
    cfg = ModelConfig.from_hf_config(raw)
    budget = budget_mib << 20
    pool = plan_pool(cfg, EngineConfig(kv_cache_memory=budget, max_num_seqs=2), torch.bfloat16, torch.device("cpu"))
    cost = ModelCost.from_config(raw)
    assert cost.state_bytes_per_sequence() == pool.state_bytes_per_slot
    assert cost.kv_bytes_per_token("bf16") == pool.kv_bytes_per_token
    expected = state_checkpoint_bytes(budget, cost.kv_bytes_per_token("bf16"), cost.state_bytes_per_sequence())
    assert pool.num_state_checkpoints > 0
    assert pool.num_state_checkpoints * pool.state_bytes_per_slot == expected


def test_the_interval_is_a_flag_and_is_checked():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig(**engine_kwargs(parser.parse_args([]))).state_checkpoint_interval == 4
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--state-checkpoint-interval", "2"])))
    assert config.state_checkpoint_interval == 2
    for bad in (0, -1, 1.5):
        with pytest.raises(TuiliError, match=rf"state_checkpoint_interval={bad!r} is invalid: expected an integer >= 1"):
            EngineConfig(state_checkpoint_interval=bad).validate()
