"""Attention over the paged KV cache for a flat batch that mixes prefill chunks and decodes.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's slot is `block_id * block_size + offset`; `slot_mapping` says where each new
token's key and value go, and each sequence's block table lists its blocks in order, so
the sequence's key at absolute position p lives in block `block_table[p // block_size]`.

The new keys/values are scattered into the cache first. A prompt chunk with no earlier
context (the first chunk of an uncached prompt) then attends causally to its own keys and
values, without reading the cache. Every other sequence's context is gathered through its
block table into a padded `[B, max_context, ...]` view and one masked scaled-dot-product
attention runs per group: all decodes together, each continuing prefill chunk on its own.
On a CPU where tuili's native kernels build (tuili/kernels), the decodes are instead one
kernel call that reads the blocks in place (`PagedBatch`); continuing chunks stay with SDPA,
whose AMX matmuls beat the kernel's vector loops once there are many queries per sequence.
Portable (CPU, any CUDA GPU incl. compute capability 7.0); faster kernels can replace
`paged_attention` without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tuili import kernels

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
FP8_HEADROOM = 4.0  # calibrated fp8 scales leave room for values 4x the first ones seen


@dataclass
class KVCache:
    """One layer's paged keys and values, `[num_blocks, block_size, Hkv, D]` each.

    fp8 (float8_e4m3fn) caches store value / scale with one float32 scale per KV head. The
    scales are set from the first keys and values the layer writes (their largest magnitude per
    head, with FP8_HEADROOM to spare; larger values later saturate at +-448 * scale) and never
    change afterwards, so every block — shared, cached, or spilled to host memory and back — is
    read with the scale it was written with. e4m3 keeps 3 mantissa bits: about 6% relative
    error per element, spread evenly over the head's range."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None  # [Hkv] float32, fp8 caches only
    value_scale: torch.Tensor | None = None
    calibrated: bool = field(default=False)

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> KVCache:
        cache = cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        if dtype == torch.float8_e4m3fn:
            cache.key_scale = torch.ones(shape[2], dtype=torch.float32, device=device)
            cache.value_scale = torch.ones(shape[2], dtype=torch.float32, device=device)
        return cache

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys/values ([T, Hkv, D]) at their slots."""
        if k.dtype == self.key.dtype and k.dtype in _NATIVE_DTYPES and k.is_cpu and kernels.available():
            kernels.kv_store(k, v, self.key, self.value, slot_mapping)  # k, v read in place: no copies
            return
        if self.key_scale is not None and self.value_scale is not None:
            if not self.calibrated:
                self.key_scale.copy_(_fp8_scale(k))
                self.value_scale.copy_(_fp8_scale(v))
                self.calibrated = True
            k, v = _to_fp8(k, self.key_scale), _to_fp8(v, self.value_scale)
        for cache, new in ((self.key, k), (self.value, v)):
            # Integer views of the same element size: index_copy_ has no float8 kernel, a copy
            # of bits is exact, and whole elements copy several times faster than their bytes.
            as_int = _SAME_SIZE_INT[cache.element_size()]
            flat = cache.view(as_int).view(-1, *cache.shape[2:])
            flat.index_copy_(0, slot_mapping, new.to(cache.dtype).contiguous().view(as_int))

    def gather(self, block_tables: torch.Tensor, max_ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each row's blocks in order, [B, Hkv, max_ctx, D] in `dtype`."""
        out = []
        for cache, scale in ((self.key, self.key_scale), (self.value, self.value_scale)):
            gathered = cache[block_tables].flatten(1, 2)[:, :max_ctx].to(dtype)
            if scale is not None:
                gathered = gathered * scale.to(dtype)[:, None]
            out.append(gathered.transpose(1, 2))
        return out[0], out[1]


def _fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-head scale, [Hkv], for values x: [T, Hkv, D]."""
    return (x.detach().float().abs().amax(dim=(0, 2)) * FP8_HEADROOM / FP8_MAX).clamp_min(1e-12)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Clamp first: where a cast of an out-of-range value does not saturate, it gives NaN.
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # caches kernels.kv_store writes (fp8 quantizes in torch)
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


@dataclass
class AttentionGroup:
    """Sequences attended in one scaled-dot-product call, queries padded to the longest.

    Invariants: tokens of one sequence are contiguous in the flat batch and in position
    order; `token_index[b, i]` is the flat index of sequence b's i-th new token, and padding
    entries (i >= that sequence's query length) point at index 0 and are masked out.
    """

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    token_index: torch.Tensor  # [B, max_query_len] int64
    token_valid: torch.Tensor  # [B, max_query_len] bool
    mask: torch.Tensor  # [B, 1, max_query_len, max_context] bool, True = may attend


@dataclass(frozen=True)
class CausalSpan:
    """A prefill chunk that starts at position 0: tokens first .. first + length - 1 of the flat
    batch are its whole context, so it attends causally to its own new keys and values."""

    first: int
    length: int


@dataclass
class PagedBatch:
    """The decodes of a step, for the native kernel (tuili/kernels/__init__.py): block tables
    [B, max_blocks] and, per sequence, (first row in the flat batch, its number of query rows,
    the absolute position of its first query) [B, 3]."""

    block_tables: torch.Tensor  # int32
    seq_info: torch.Tensor  # int32


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the runner and shared by every layer. Decodes
    (one query each) share one group; each continuing prefill chunk has its own, so a long
    chunk never pads a batch of decodes to its length; fresh prefill chunks are spans.
    Invariant: every token of the step is in exactly one group or span."""

    slot_mapping: torch.Tensor  # [T] int64
    groups: list[AttentionGroup]
    spans: list[CausalSpan]
    paged: PagedBatch | None = None  # the decodes, when the native kernel runs them


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] for this step's tokens (already stored in `cache`)
    -> output [T, Hq, D]. Fresh prompt chunks attend to k, v as computed (not as stored)."""
    if meta.paged is not None and not meta.groups and not meta.spans:  # a pure decode step
        return _attend_native(q, cache, meta.paged, scale, q.new_empty(q.shape))
    if len(meta.groups) == 1 and not meta.spans and meta.paged is None:
        group = meta.groups[0]
        if group.token_index.shape[0] == q.shape[0]:  # a pure decode step: rows already in order
            return _attend(q, cache, group, scale)
    if len(meta.spans) == 1 and not meta.groups and meta.paged is None:  # one fresh prompt chunk
        return causal_attention(q, k, v, scale)
    result = q.new_empty(q.shape)
    if meta.paged is not None:
        _attend_native(q, cache, meta.paged, scale, result)
    for span in meta.spans:
        rows = slice(span.first, span.first + span.length)
        result[rows] = causal_attention(q[rows], k[rows], v[rows], scale)
    for group in meta.groups:
        valid = group.token_valid.reshape(-1)
        result[group.token_index.reshape(-1)[valid]] = _attend(q[group.token_index], cache, group, scale)[valid]
    return result


def _attend_native(q: torch.Tensor, cache: KVCache, paged: PagedBatch, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The native kernel over the decodes' rows of `out` (other rows untouched)."""
    return kernels.paged_attention(
        q, cache.key, cache.value, paged.block_tables, paged.seq_info, scale, out,
        cache.key_scale, cache.value_scale,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's L tokens over themselves: [L, H, D] -> [L, Hq, D].
    In bf16 on a CPU with AMX, tuili's kernel (kernels.prompt_attention, 1.2-1.6x SDPA's speed
    at 256-2048 tokens, docs/kernels.md) reads q, k and v in place from the qkv product.
    Otherwise SDPA's fused causal kernel runs without a mask tensor; it takes 4-D input only
    (3-D falls back to the unfused math path, several times slower). On CPU its grouped-query
    mode reads each KV head for its query heads (measured 1.2-1.4x faster than repeating K/V at
    512 tokens); elsewhere K/V are repeated per query head, a small copy next to the L^2 work,
    which every fused GPU kernel takes."""
    if _native_prompt_attention(q, k, v):
        return kernels.prompt_attention(q, k, v, scale, q.new_empty(q.shape))
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


def _native_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether kernels.prompt_attention takes these (bf16 on a CPU with AMX, its head dims, each
    token's heads contiguous as the qkv product's views are, k and v a token apart alike)."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
        and k.stride(0) == v.stride(0)
        and kernels.amx_available()
    )


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
