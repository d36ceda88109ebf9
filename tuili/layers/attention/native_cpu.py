"""The CPU attention backend on tuili's native kernels (tuili/kernels): the torch backend's
algorithm, with three of its parts replaced where the tensors fit.

- Keys and values of a float32/bf16 cache are written by one kernel reading k and v in place
  from the qkv product (an fp8 cache quantizes in torch).
- The decodes of a step are one kernel call that reads the blocks in place through the block
  tables (the runner hands them over as a PagedBatch); continuing prefill chunks stay with SDPA,
  whose AMX matmuls beat the kernel's vector loops once there are many queries per sequence.
- On a CPU with AMX, a fresh bf16 prompt's causal attention runs on AMX tiles
  (kernels.prompt_attention), reading q, k and v in place from the qkv product.

Batch-invariant mode (`Platform.batch_invariant`, the default): SDPA, the AMX prompt kernel and
the paged kernel each sum a token's scores in their own order, and the paged kernel splits a
sequence's keys by how many threads the batch leaves idle; so a token's attention would depend
on whether its prefix was computed in this step, read from the cache or split into chunks, and
on the batch. In this mode every sequence of every step (fresh prompts, continuing chunks,
decodes) is one paged-kernel call over the cache, with the keys split at fixed positions
(INVARIANT_SPLIT_KEYS): a token's result depends only on its query, its keys and its position.
"""

from __future__ import annotations

import torch

from tuili import kernels
from tuili.layers.attention.base import KVCache, PagedBatch
from tuili.layers.attention.torch_sdpa import TorchAttention

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # caches kernels.kv_store writes
_PROMPT_MAX_HEAD_DIM = 256  # MAX_HEAD_DIM of csrc/prompt_attention.c
# Keys per part of a sequence's keys in the batch-invariant mode: the parts (and so the partial
# sums merged) are the same at every batch, and a decode at batch 1 over a long context still
# spreads over the threads, one part each.
INVARIANT_SPLIT_KEYS = 256


class NativeCpuAttention(TorchAttention):
    name = "native-cpu"
    reads_paged_decodes = True

    def __init__(self, amx: bool, batch_invariant: bool = False) -> None:
        self.amx = amx
        self.reads_paged_prompts = batch_invariant
        self.split_keys = INVARIANT_SPLIT_KEYS if batch_invariant else 0

    def store(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if k.dtype == cache.key.dtype and k.dtype in _NATIVE_DTYPES and k.is_cpu:
            kernels.kv_store(k, v, cache.key, cache.value, slot_mapping)  # k, v read in place: no copies
        else:
            cache.store(k, v, slot_mapping)

    def attend_paged(
        self, q: torch.Tensor, cache: KVCache, paged: PagedBatch, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        """The native kernel over the decodes' rows of `out` (other rows untouched)."""
        return kernels.paged_attention(
            q, cache.key, cache.value, paged.block_tables, paged.seq_info, scale, out,
            cache.key_scale, cache.value_scale, self.split_keys,
        )  # fmt: skip

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.amx and _prompt_kernel_takes(q, k, v):
            return kernels.prompt_attention(q, k, v, scale, q.new_empty(q.shape))
        return super().causal(q, k, v, scale)


def _prompt_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether kernels.prompt_attention takes these: bf16 on the CPU, its head dims, each token's
    heads contiguous as the qkv product's views are, k and v a token apart alike."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= _PROMPT_MAX_HEAD_DIM
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
        and k.stride(0) == v.stride(0)
    )
