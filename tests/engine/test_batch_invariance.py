"""Batch invariance (issue 20, part 1): in the default dtype (bf16), a request's tokens and their
log-probabilities are bitwise the same whatever else is in the batch, whether its prefix came
from the prefix cache (device or host tier) or was computed, however its prompt was split into
chunks, and after preemption.

The reference is each request run alone, its prompt in one chunk, with prefix caching off. The
log-probabilities are compared as well as the tokens: a tiny random model rarely has a near tie
for a rounding difference to flip, but every rounding difference shows in a float.

The paths other CPUs take run in fresh processes, with the kernels built for them: without AMX
(on an Intel CPU with AMX, its AVX512-BF16 path; what AMD Zen 4/5 run anyway), for AVX2 only
(no packed linears: the row-major ones through linear_small, the portable C attention and int4
code), and without native kernels at all (the portable torch path: PyTorch's matmuls on blocks of
one fixed shape, the fixed-order attention, the DeltaNet rule token by token in torch). GPUs are
not batch invariant and are not claimed to be (docs/engine.md, "Batch invariance").
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams

BLOCK_SIZE = 4
MAX_LEN = 96


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with 32-wide heads (the bf16 score path of the attention kernel)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("invariance") / "llama"
    model.save_pretrained(path)
    return path


def _llm(path, options, num_blocks=256, **kw) -> LLM:
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 32 * 2  # K+V x layers x tokens x KV heads x dims x bf16
    defaults = dict(dtype="bfloat16", device="cpu", block_size=BLOCK_SIZE, max_model_len=MAX_LEN,
                   kv_cache_memory=num_blocks * block_bytes, max_num_batched_tokens=512)
    return LLM(model=str(path), **(defaults | options | kw))


def _prompts(count=8, seed=0):
    """Prompts of 9 to 40 tokens, half of them sharing a 14-token system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 320) for _ in range(14)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(1, 320) for _ in range(rng.randrange(9, 27))]
        prompts.append({"prompt_token_ids": (system if i % 2 else []) + tail})
    return prompts


def _params(i: int) -> SamplingParams:
    """Greedy for even prompts; odd ones sample with a seed of their own."""
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=8, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _run(llm: LLM, prompts, indices) -> dict[int, tuple]:
    """Outputs by prompt index: (token ids, the chosen tokens' logprobs as float bits)."""
    outs = llm.generate([prompts[i] for i in indices], [_params(i) for i in indices])
    result = {}
    for i, out in zip(indices, outs, strict=True):
        c = out.outputs[0]
        logprobs = tuple(step[token].logprob for step, token in zip(c.logprobs, c.token_ids, strict=True))
        result[i] = (tuple(c.token_ids), logprobs)
    return result


def _scenarios(path, every_scenario: bool, **options) -> dict[str, dict[int, tuple]]:
    """Each scenario's outputs; the quantized models (whose attention and scheduling are the
    float model's) run the batch, chunk and cache scenarios only."""
    prompts = _prompts()
    every = list(range(len(prompts)))
    alone = _llm(path, options, enable_prefix_caching=False)
    runs = {"alone": {}}
    for i in every:
        runs["alone"] |= _run(alone, prompts, [i])
    batched = _llm(path, options, enable_prefix_caching=False)
    runs["batch of 8"] = _run(batched, prompts, every)
    if every_scenario:
        runs["batches of 3"] = {}
        for first in range(0, len(every), 3):
            runs["batches of 3"] |= _run(batched, prompts, every[first : first + 3])
    # Budgets that cut prompts at odd positions, chunks mixed with other sequences' decodes.
    for budget in (7, 13) if every_scenario else (7,):
        chunked = _llm(path, options, enable_prefix_caching=False, max_num_batched_tokens=budget)
        runs[f"budget {budget}"] = _run(chunked, prompts, every)
    # Warm device cache: the second pass reads every prompt's full blocks from the cache.
    cached = _llm(path, options)
    _run(cached, prompts, every)
    runs["device cache"] = _run(cached, prompts, every[::-1])
    assert cached.engine.stats().prefix_cache.device_hit_tokens > 0
    if not every_scenario:
        return runs
    # Host tier: a device pool of about two sequences evicts to host memory and reloads.
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 32 * 2
    host = _llm(path, options, num_blocks=30, enable_prefix_caching=True, kv_offload_memory=200 * block_bytes,
                max_num_seqs=1)
    _run(host, prompts, every)
    runs["host cache"] = _run(host, prompts, every)
    assert host.engine.stats().prefix_cache.host_hit_tokens > 0
    # Preemption: too few blocks for all eight at once.
    small = _llm(path, options, num_blocks=40, enable_prefix_caching=False, max_num_batched_tokens=24)
    runs["preemption"] = _run(small, prompts, every)
    assert small.engine.stats().num_preemptions > 0
    return runs


def _differences(runs) -> list[str]:
    reference = runs["alone"]
    return [f"{name}: prompt {i}" for name, run in runs.items() for i in reference if run[i] != reference[i]]


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_outputs_do_not_depend_on_the_batch_and_the_cache_or_the_chunks(tiny_model, quantization):
    runs = _scenarios(tiny_model, quantization is None, quantization=quantization)
    assert _differences(runs) == []


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny_hybrid(request, tiny_hybrid_checkpoint):
    """A tiny random Qwen3.5, dense or with a mixture of experts (tests/engine/conftest.py)."""
    return tiny_hybrid_checkpoint(request.param)


def test_a_hybrid_models_outputs_do_not_depend_on_the_batch_the_chunks_the_cache_or_preemption(tiny_hybrid):
    """The DeltaNet layers compute each sequence alone and token by token (csrc/deltanet.c: a
    prompt chunk of n tokens is n decode steps), so neither the batch, nor where a token budget
    splits a prompt, nor restoring a prefix-cache checkpoint of the state, nor recomputing after a
    preemption changes a bit, nor bringing KV blocks and a state checkpoint back from the host tier."""
    prompts = _prompts()
    every = list(range(len(prompts)))
    block = 2 * BLOCK_SIZE * 2 * 32 * 2  # K+V x one attention layer x tokens x KV heads x dims x bf16
    slot = 3 * (256 * 3 * 2 + 4 * 32 * 32 * 4)  # three DeltaNet layers: conv window (bf16) + float32 state
    plenty = dict(kv_cache_memory=64 << 20)
    alone = _llm(tiny_hybrid, {}, enable_prefix_caching=False, **plenty)
    runs = {"alone": {}, "batches of 3": {}}
    for i in every:
        runs["alone"] |= _run(alone, prompts, [i])
    batched = _llm(tiny_hybrid, {}, enable_prefix_caching=False, **plenty)
    runs["batch of 8"] = _run(batched, prompts, every)
    for first in range(0, len(every), 3):
        runs["batches of 3"] |= _run(batched, prompts, every[first : first + 3])
    if "moe" not in tiny_hybrid.name and batched.engine.platform.native_kernels:  # MoE routing runs eagerly
        assert batched.engine.runner.graphs.captured_batch_sizes()  # decodes replayed in graphs, too
    for budget in (7, 13):  # prompts cut at odd positions, chunks beside other sequences' decodes
        chunked = _llm(tiny_hybrid, {}, enable_prefix_caching=False, max_num_batched_tokens=budget, **plenty)
        runs[f"budget {budget}"] = _run(chunked, prompts, every)
    # Warm cache: the second pass restores state checkpoints at block boundaries; with a budget of
    # 7 tokens, checkpoints are also taken inside chunks.
    for budget in (512, 7):
        cached = _llm(tiny_hybrid, {}, state_checkpoint_interval=1, max_num_batched_tokens=budget, **plenty)
        _run(cached, prompts, every)
        runs[f"device cache, budget {budget}"] = _run(cached, prompts, every[::-1])
        assert cached.engine.stats().state_checkpoints.restored > 0
    # Host tier: a device pool with one checkpoint and ~100 blocks; two other sets of prompts in
    # between push the first set's blocks and checkpoints to host memory, which a hit copies back.
    host = _llm(tiny_hybrid, {}, state_checkpoint_interval=1, kv_cache_memory=105 * block + 2 * slot,
                kv_offload_memory=16 << 20, max_num_seqs=1)  # fmt: skip
    for seed in (0, 1, 2):
        _run(host, _prompts(seed=seed), every)
    runs["host cache"] = _run(host, prompts, every)
    stats = host.engine.stats()
    assert stats.prefix_cache.host_hit_tokens > 0 and stats.state_checkpoints.host_restored > 0
    # Preemption: state slots for all eight, KV blocks for fewer.
    small = _llm(tiny_hybrid, {}, enable_prefix_caching=False, max_num_batched_tokens=24,
                 kv_cache_memory=40 * block + 8 * slot)  # fmt: skip
    runs["preemption"] = _run(small, prompts, every)
    assert small.engine.stats().num_preemptions > 0
    assert _differences(runs) == []


# Kernel builds for other x86 CPUs (TUILI_KERNEL_CFLAGS, as tests/kernels/test_cpu_kernels.py),
# and the portable torch path (no native kernels), each with the tests it runs.
_LLAMA = "batch_and_the_cache and not int8"
OTHER_PATHS = {
    "no AMX": ({"TUILI_KERNEL_CFLAGS": "-mno-amx-tile -mno-amx-bf16 -mno-amx-int8"}, _LLAMA),
    "AVX-512 without BF16 and VNNI": (
        {"TUILI_KERNEL_CFLAGS": "-mno-amx-tile -mno-amx-bf16 -mno-amx-int8 -mno-avx512bf16 -mno-avx512vnni"}, _LLAMA,
    ),
    # PyTorch's own kernels held to AVX2 too (ATEN_CPU_CAPABILITY, oneDNN's ISA cap): as on an
    # AVX2 CPU, tuili then computes dequantized weights in float32 (no bf16 dot products).
    "AVX2 only": ({"TUILI_KERNEL_CFLAGS": "-march=x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                   "ONEDNN_MAX_CPU_ISA": "AVX2"}, _LLAMA),
    # PyTorch's ops only: fixed-shape linears, the fixed-order attention, the DeltaNet step in torch.
    "portable torch path": ({"TUILI_NATIVE_KERNELS": "0"}, f"({_LLAMA}) or (hybrid and dense)"),
}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the variant flags are x86 ones")
def test_the_paths_of_other_cpus_are_batch_invariant_too(kernel_isa):
    """This file's tests in fresh processes, on kernels built for the other CPUs and on the
    portable path, side by side. A build whose instruction-set macros are this CPU's own (with
    PyTorch at its own capability) runs the code this file's tests just ran natively: skipped."""
    import torch

    def native_already(variables: dict[str, str]) -> bool:
        flags = variables.get("TUILI_KERNEL_CFLAGS")
        torch_cap = variables.get("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability()).lower()
        return (flags is not None and kernel_isa(flags) == kernel_isa("")
                and torch_cap == torch.backends.cpu.get_cpu_capability().lower())

    # Up to four processes of two threads on the cores: their idle threads sleep (OMP_WAIT_POLICY,
    # tests/conftest.py) instead of spinning on cores the others need.
    environment = {k: v for k, v in os.environ.items() if k not in ("TUILI_NATIVE_KERNELS", "TUILI_KERNEL_CFLAGS")}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection],
            env=environment | variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, (variables, selection) in OTHER_PATHS.items()
        if not native_already(variables)
    }
    assert "portable torch path" in runs
    for name, run in runs.items():
        output = run.communicate(timeout=1200)[0]
        assert run.returncode == 0 and " passed" in output, f"{name}:\n{output[-3000:]}"


def test_the_fastest_mode_is_a_documented_option():
    """`--no-batch-invariant` reaches the engine's config; a bad value is refused by name."""
    import argparse

    from tuili.config import EngineConfig
    from tuili.engine.cli import add_engine_args, engine_kwargs
    from tuili.errors import TuiliError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args(["--no-batch-invariant"]))["batch_invariant"] is False
    with pytest.raises(TuiliError, match="batch_invariant='yes' is invalid"):
        EngineConfig(batch_invariant="yes").validate()
