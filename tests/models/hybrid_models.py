"""What the hybrid (Gated DeltaNet + full attention) model tests share: the prompts, a checkpoint
written by transformers with its greedy answers, and the engine checks that hold for every
hybrid family (Qwen3-Next in test_hybrid_vs_transformers.py, Qwen3.5 and Qwen3.5-MoE in
test_qwen35_vs_transformers.py): greedy answers equal transformers' with prompts split at odd
positions, under preemption, and after aborts, with every state slot and KV block returned."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.config import ModelConfig
from tuili.engine.pool import kv_bytes_per_block, state_bytes_per_slot
from tuili.perf.meter import UtilizationMeter

PROMPTS = [
    [5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13],
    [42],
    list(range(30, 53)),
    [7, 7, 7, 200, 201],
]
STEPS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def randomise_norms(model: transformers.PreTrainedModel) -> None:
    """transformers starts every norm at its identity: a norm loaded wrong would not show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if ".linear_attn.norm" in name else 0.0))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    hf: transformers.PreTrainedModel
    greedy: dict[tuple[int, ...], list[int]]  # transformers' STEPS greedy tokens per prompt

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_config(self.hf.config.to_dict() | {"architectures": self.hf.config.architectures})


def greedy_answers(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """transformers' STEPS greedy tokens after each prompt."""
    greedy = {}
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
            greedy[tuple(ids)] = out[0, len(ids) :].tolist()
    return greedy


def write_checkpoint(model: transformers.PreTrainedModel, path: Path) -> Checkpoint:
    """`model` saved with save_pretrained at `path`, with its greedy answers to PROMPTS."""
    model.save_pretrained(path)
    return Checkpoint(path, model, greedy_answers(model, PROMPTS))


def tuili_llm(path: Path, **options) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20) | options
    return LLM(model=str(path), **options)


def assert_all_state_free(llm: LLM) -> None:
    slots = llm.engine.scheduler.state_slots
    assert slots is not None and slots.num_free == slots.num_slots
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def check_greedy_with_split_prompts(checkpoint: Checkpoint, native: bool, mixed_steps, device: str = "cpu") -> None:
    """A 7-token budget: the prompts are split at odd positions (7, 14, ...) and most steps mix
    one sequence's prefill chunk with the others' decodes; the last steps, pure decodes, replay
    CPU graphs on the native kernels (not for a mixture of experts, whose routing is torch ops).
    The caller sets TUILI_NATIVE_KERNELS."""
    from tuili import kernels

    llm = tuili_llm(checkpoint.path, max_num_batched_tokens=7, device=device)
    native = native and kernels.available() and device == "cpu"
    assert llm.engine.platform.native_kernels == native
    graphs = llm.engine.runner.graphs
    assert (graphs is not None) == (native and checkpoint.model_config().moe is None)
    mixed = mixed_steps()
    llm.engine.add_observer(mixed)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], GREEDY)
    assert mixed.count > 0 and mixed.odd_splits > 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == checkpoint.greedy[tuple(ids)]
        assert out.outputs[0].finish_reason == "length"
    if graphs is not None:
        assert len(PROMPTS) in graphs.captured_batch_sizes() and not graphs.refused
    assert_all_state_free(llm)


def check_preemption_recomputes_state(checkpoint: Checkpoint) -> None:
    """Room for 16 KV blocks (64 tokens) while the four sequences need 171 tokens in all: the
    newest running ones are preempted, their slots freed, and they restart from position 0."""
    cfg = checkpoint.model_config()
    budget = 16 * kv_bytes_per_block(cfg, 4, torch.float32) + 4 * state_bytes_per_slot(cfg, torch.float32)
    llm = tuili_llm(checkpoint.path, kv_cache_memory=budget, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=9)
    assert llm.engine.pool.num_blocks == 16 and llm.engine.pool.num_state_slots == 4
    # live MBU counts each decoding sequence's state as the engine holds it, read and written
    meter = UtilizationMeter.for_engine(llm.engine, "h100")
    assert meter.state_bytes_per_sequence == state_bytes_per_slot(cfg, torch.float32) > 0
    assert meter.step_decode_bytes([5, 9]) - meter.step_decode_bytes([5]) >= 2 * meter.state_bytes_per_sequence
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == checkpoint.greedy[tuple(ids)]
    assert_all_state_free(llm)


def check_slots_freed_on_abort_and_reused(checkpoint: Checkpoint) -> None:
    greedy = checkpoint.greedy
    llm = tuili_llm(checkpoint.path, max_num_batched_tokens=5, max_num_seqs=2)
    engine = llm.engine
    assert engine.scheduler.state_slots.num_slots == 2
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS[:3]]
    for _ in range(3):  # the first two are running (one mid-prefill), the third waits for a slot
        engine.step()
    assert engine.scheduler.state_slots.num_free == 0 and len(engine.scheduler.waiting) == 1
    engine.abort_request(ids[0])
    engine.abort_request(ids[2])
    assert engine.scheduler.state_slots.num_free == 1
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].outputs[0].token_ids == greedy[tuple(PROMPTS[1])]
    assert_all_state_free(llm)
    # The freed slots carry the old sequences' state; a new sequence must not see it.
    out = llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY)[0]
    assert out.outputs[0].token_ids == greedy[tuple(PROMPTS[3])]
    assert_all_state_free(llm)
