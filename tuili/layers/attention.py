"""Attention over the paged KV cache for a flat batch that mixes prefill chunks and decodes.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's slot is `block_id * block_size + offset`; `slot_mapping` says where each new
token's key and value go, and each sequence's block table lists its blocks in order, so
the sequence's key at absolute position p lives in block `block_table[p // block_size]`.

One call per layer handles the whole batch: the new keys/values are scattered into the
cache, then every sequence's context is gathered through its block table into a padded
`[B, max_context, ...]` view and one masked scaled-dot-product attention runs over it.
Portable (CPU, any CUDA GPU incl. compute capability 7.0); faster kernels can replace
`paged_attention` without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the runner and shared by every layer.

    Invariants: tokens of one sequence are contiguous in the flat batch and in position
    order; `context_lens[b]` counts every cached token of sequence b including this
    step's; `token_index[b, i]` is the flat index of sequence b's i-th new token, and
    padding entries (i >= query_lens[b]) point at index 0 and are masked out.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [B] int64
    token_index: torch.Tensor  # [B, max_query_len] int64
    token_valid: torch.Tensor  # [B, max_query_len] bool
    mask: torch.Tensor  # [B, 1, max_query_len, max_context] bool, True = may attend

    @property
    def max_query_len(self) -> int:
        return self.token_index.shape[1]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys/values ([T, Hkv, D]) at their slots."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] for this step's tokens -> output [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch, max_q = meta.token_index.shape
    max_ctx = meta.mask.shape[-1]

    # Gather each sequence's context: [B, max_blocks * block_size, Hkv, D] -> [B, Hkv, ctx, D].
    keys = k_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)
    values = v_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)

    # Queries padded per sequence, grouped under their KV head so K/V are never repeated:
    # [B, max_q, Hkv, group, D] -> [B, Hkv, group * max_q, D]. A pure decode step has one
    # query per sequence, already in order: no gather, no scatter back.
    decode_only = max_q == 1
    padded_q = q if decode_only else q[meta.token_index]
    padded_q = padded_q.view(batch, max_q, num_kv_heads, group, head_dim)
    padded_q = padded_q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * max_q, head_dim)
    mask = meta.mask.expand(batch, group, max_q, max_ctx).reshape(batch, 1, group * max_q, max_ctx)
    out = F.scaled_dot_product_attention(padded_q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale)

    # Back to the flat layout, dropping padding.
    out = out.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * max_q, num_heads, head_dim)
    if decode_only:
        return out
    flat_index = meta.token_index.reshape(-1)[meta.token_valid.reshape(-1)]
    result = q.new_empty(num_tokens, num_heads, head_dim)
    result[flat_index] = out[meta.token_valid.reshape(-1)]
    return result
