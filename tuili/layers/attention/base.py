"""What every attention backend shares: the paged KV cache of a layer, the per-step batch
layout the runner builds, and the interface a backend implements.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's slot is `block_id * block_size + offset`; `slot_mapping` says where each new
token's key and value go, and each sequence's block table lists its blocks in order, so
the sequence's key at absolute position p lives in block `block_table[p // block_size]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from tuili.layers.deltanet import StateBatch

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
        """Write this step's keys/values ([T, Hkv, D]) at their slots, in torch (an fp8 cache
        quantizes them with its per-head scales, calibrated on the first call)."""
        if self.key_scale is not None and self.value_scale is not None:
            if not self.calibrated:
                self.key_scale.copy_(_fp8_scale(k))
                self.value_scale.copy_(_fp8_scale(v))
                self.calibrated = True
            k, v = _to_fp8(k, self.key_scale), _to_fp8(v, self.value_scale)
        for cache, new in ((self.key, k), (self.value, v)):
            # Integer views of the same element size: index_copy_ has no float8 kernel, a copy
            # of bits is exact, and whole elements copy faster than their bytes.
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


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """The decodes of a step (with `reads_paged_prompts`, all its sequences), for the native
    kernel (tuili/kernels/__init__.py): block tables [B, max_blocks] and, per sequence, (first
    row in the flat batch, its number of query rows, the absolute position of its first query)
    [B, 3]."""

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
    # Hybrid models: each sequence's state slot for the linear-attention layers (None otherwise).
    states: StateBatch | None = None


class AttentionBackend(ABC):
    """How a layer stores this step's keys and values and attends: chosen once per engine
    (`tuili.layers.attention.attention_backend`) and shared by every layer."""

    name: str
    # Whether the runner should hand this backend a step's decodes as one PagedBatch (block
    # tables read in place by a kernel) rather than as an AttentionGroup for gathering.
    reads_paged_decodes: bool = False
    # ... and every other sequence of the step too (prompt chunks, fresh or continuing), read
    # back from the cache after `store`: one kernel for every token (batch invariance).
    reads_paged_prompts: bool = False

    @abstractmethod
    def store(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys and values ([T, Hkv, D]) at their slots of `cache`."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] for this step's tokens (already stored in `cache`)
        -> output [T, Hq, D]. Fresh prompt chunks attend to k, v as computed (not as stored)."""

    @abstractmethod
    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of one sequence's L tokens over themselves: [L, H, D] -> [L, Hq, D]."""
