"""The portable attention backend: PyTorch's scaled_dot_product_attention, on any device (CPU,
any CUDA GPU incl. compute capability 7.0).

A prompt chunk with no earlier context (the first chunk of an uncached prompt) attends causally
to its own keys and values, without reading the cache. Every other sequence's context is
gathered through its block table into a padded `[B, max_context, ...]` view and one masked
attention runs per group: all decodes together, each continuing prefill chunk on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tuili.layers.attention.base import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    KVCache,
    PagedBatch,
)

_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


class TorchAttention(AttentionBackend):
    name = "torch"

    def store(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cache.store(k, v, slot_mapping)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if meta.paged is not None and not meta.groups and not meta.spans:  # a pure decode step
            return self.attend_paged(q, cache, meta.paged, scale, q.new_empty(q.shape))
        if len(meta.groups) == 1 and not meta.spans and meta.paged is None:
            group = meta.groups[0]
            if group.token_index.shape[0] == q.shape[0]:  # a pure decode step: rows already in order
                return _attend(q, cache, group, scale)
        if len(meta.spans) == 1 and not meta.groups and meta.paged is None:  # one fresh prompt chunk
            return self.causal(q, k, v, scale)
        result = q.new_empty(q.shape)
        if meta.paged is not None:
            self.attend_paged(q, cache, meta.paged, scale, result)
        for span in meta.spans:
            rows = slice(span.first, span.first + span.length)
            result[rows] = self.causal(q[rows], k[rows], v[rows], scale)
        for group in meta.groups:
            valid = group.token_valid.reshape(-1)
            result[group.token_index.reshape(-1)[valid]] = _attend(q[group.token_index], cache, group, scale)[valid]
        return result

    def attend_paged(
        self, q: torch.Tensor, cache: KVCache, paged: PagedBatch, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        """Decodes handed over as a PagedBatch: only backends with `reads_paged_decodes` get them."""
        raise NotImplementedError(f"the {self.name} attention backend does not read paged decodes")

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """SDPA's fused causal kernel, without a mask tensor; it takes 4-D input only (3-D falls
        back to the unfused math path, several times slower). On CPU its grouped-query mode reads
        each KV head for its query heads (faster than repeating K/V: docs/kernels.md); elsewhere
        K/V are repeated per query head, a small copy next to the L^2 work, which every fused GPU
        kernel takes."""
        per_kv = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
        k, v = k.to(q.dtype), v.to(q.dtype)
        if per_kv > 1 and q.device.type == "cpu" and _SDPA_GQA:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        if per_kv > 1:
            k, v = (t.repeat_interleave(per_kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)


def _attend(padded_q: torch.Tensor, cache: KVCache, group: AttentionGroup, scale: float) -> torch.Tensor:
    """padded_q: [B, max_q, Hq, D] (or [B, Hq, D] when max_q == 1) -> [B * max_q, Hq, D]."""
    batch, max_q = group.token_index.shape
    num_heads, head_dim = padded_q.shape[-2:]
    num_kv_heads = cache.key.shape[2]
    per_kv = num_heads // num_kv_heads
    max_ctx = group.mask.shape[-1]

    keys, values = cache.gather(group.block_tables, max_ctx, padded_q.dtype)  # [B, Hkv, ctx, D]

    # Queries grouped under their KV head so K/V are never repeated:
    # [B, max_q, Hkv, per_kv, D] -> [B, Hkv, per_kv * max_q, D].
    q = padded_q.reshape(batch, max_q, num_kv_heads, per_kv, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, per_kv * max_q, head_dim)
    mask = group.mask.expand(batch, per_kv, max_q, max_ctx).reshape(batch, 1, per_kv * max_q, max_ctx)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(batch, num_kv_heads, per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * max_q, num_heads, head_dim)
