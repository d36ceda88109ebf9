"""tuili/config.py: the working dtype that "auto" resolves to on each platform."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tuili import LLM
from tuili.config import resolve_dtype
from tuili.errors import TuiliError
from tuili.platform import Platform

PORTABLE = Platform.portable("cpu")
# tuili's kernels on a CPU without bf16 arithmetic (an AVX2 CPU: AMD Zen 3, Intel before Cooper
# Lake), and on one with it (AVX512-BF16 or AMX)
NATIVE = dataclasses.replace(PORTABLE, native_kernels=True)
NATIVE_BF16 = dataclasses.replace(NATIVE, bf16_arithmetic=True)


def test_auto_is_bf16_wherever_the_native_kernels_run():
    # They read bf16 in place on every CPU, so bf16 halves what a decode step reads (machine C,
    # a Zen 3: a bf16 Qwen3-0.6B-shape checkpoint 14.7 -> 21.3 tokens/s at batch 1, docs/benchmarks.md)
    for dtype in ("auto", None):
        assert resolve_dtype(dtype, NATIVE) == torch.bfloat16
        assert resolve_dtype(dtype, NATIVE_BF16) == torch.bfloat16


def test_auto_is_float32_on_the_portable_cpu_path():
    # PyTorch's own bf16 products are slower than its float32 ones on most CPUs
    assert resolve_dtype("auto", PORTABLE) == torch.float32


def test_an_explicit_dtype_is_kept_and_a_bad_one_named():
    assert resolve_dtype("float32", NATIVE) == torch.float32
    assert resolve_dtype(torch.bfloat16, PORTABLE) == torch.bfloat16
    with pytest.raises(TuiliError, match="dtype='float64' is not supported: expected auto, float32"):
        resolve_dtype("float64", NATIVE)


def test_the_engine_on_this_machine_follows_its_platform(tmp_path):
    """The engine's own choice, on this CPU: bf16 where the native kernels built and run."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), max_model_len=32, kv_cache_memory=1 << 20)
    expected = torch.bfloat16 if Platform.detect("cpu").native_kernels else torch.float32
    assert llm.engine.dtype == expected
