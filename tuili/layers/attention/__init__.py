"""Attention over the paged KV cache for a flat batch that mixes prefill chunks and decodes.

One backend is chosen per engine from the platform (`attention_backend`) and shared by every
layer: base.py holds the cache, the batch layout and the interface; each other file is one
backend. A GPU or linear-attention backend is one new file registered here.
"""

from __future__ import annotations

import torch

from tuili.layers.attention.base import (
    FP8_HEADROOM,
    FP8_MAX,
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    CausalSpan,
    KVCache,
    PagedBatch,
)
from tuili.layers.attention.native_cpu import NativeCpuAttention
from tuili.layers.attention.torch_fixed_order import FixedOrderAttention
from tuili.layers.attention.torch_sdpa import TorchAttention
from tuili.platform import Platform


def attention_backend(platform: Platform, dtype: torch.dtype) -> AttentionBackend:
    """The backend for activations of `dtype` on `platform`: the native CPU kernels where they
    run and take the dtype, else PyTorch: on a CPU in the batch-invariant mode in one fixed order
    per token, otherwise SDPA (GPUs: not batch invariant)."""
    if platform.native_kernels and dtype in (torch.float32, torch.bfloat16):
        return NativeCpuAttention(amx=platform.amx, batch_invariant=platform.batch_invariant)
    if platform.batch_invariant and platform.device.type == "cpu":
        return FixedOrderAttention()
    return TorchAttention()


__all__ = [
    "FP8_HEADROOM",
    "FP8_MAX",
    "FixedOrderAttention",
    "AttentionBackend",
    "AttentionGroup",
    "AttentionMetadata",
    "CausalSpan",
    "KVCache",
    "NativeCpuAttention",
    "PagedBatch",
    "TorchAttention",
    "attention_backend",
]
