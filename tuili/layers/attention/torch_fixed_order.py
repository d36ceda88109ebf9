"""The portable backend's batch-invariant mode: attention in one fixed order per token, in PyTorch.

SDPA splits queries and keys into blocks whose sizes follow the lengths of the call, so a
token's attention would depend on whether its prompt arrived in one chunk or several, on whether
its prefix was read from the cache, and on the other sequences padded into its group. Here every
sequence of every step (fresh prompts, continuing chunks, decodes) is read back from the paged
cache after `store` (as the native backend does in this mode) and attended with shapes that do
not depend on the step:

- queries in blocks of `QUERY_BLOCK` rows of one sequence, the last block padded;
- keys in parts of `KEY_PART` positions starting at absolute position 0 (the last padded and
  masked), merged in order by the online softmax, in float32.

Every matmul then has one of two shapes, and a token's result depends only on its query, its
keys and its position. Slower than SDPA (a Python loop over sequences and key parts): it is the
fallback of CPUs without the native kernels, where the invariance is the point.
"""

from __future__ import annotations

import torch

from tuili.layers.attention.base import KVCache, PagedBatch
from tuili.layers.attention.torch_sdpa import TorchAttention

QUERY_BLOCK = 16
KEY_PART = 256


class FixedOrderAttention(TorchAttention):
    name = "torch-fixed-order"
    reads_paged_decodes = True
    reads_paged_prompts = True

    def attend_paged(
        self, q: torch.Tensor, cache: KVCache, paged: PagedBatch, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        block_size = cache.key.shape[1]
        for row, (first, num_queries, position) in enumerate(paged.seq_info.tolist()):
            context = position + num_queries
            blocks = paged.block_tables[row, : -(-context // block_size)].long()
            keys, values = (_read(part, blocks, scale_, context) for part, scale_ in
                            ((cache.key, cache.key_scale), (cache.value, cache.value_scale)))  # fmt: skip
            rows = slice(first, first + num_queries)
            out[rows] = _attend(q[rows], keys, values, position, scale).to(out.dtype)
        return out


def _read(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None, context: int) -> torch.Tensor:
    """One sequence's keys or values [context, Hkv, D] in float32, padded with zeros to whole
    KEY_PARTs."""
    values = cache[blocks].flatten(0, 1)[:context].float()
    if scale is not None:
        values = values * scale[:, None]
    return torch.cat([values, values.new_zeros(-context % KEY_PART, *values.shape[1:])])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, scale: float) -> torch.Tensor:
    """Queries q [n, Hq, D] at positions position.. position + n - 1 over keys and values
    [parts * KEY_PART, Hkv, D] (zeros past the context) -> [n, Hq, D] float32."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    per_kv = num_heads // num_kv_heads
    pad = -n % QUERY_BLOCK
    queries = torch.cat([q.float(), q.new_zeros(pad, num_heads, head_dim, dtype=torch.float32)])
    # [blocks, Hkv, per_kv * QUERY_BLOCK, D]: each KV head's query heads side by side.
    blocks = queries.view(-1, QUERY_BLOCK, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
    blocks = blocks.reshape(-1, num_kv_heads, per_kv * QUERY_BLOCK, head_dim)
    # Each query row's position; padded rows take the last real one (their output is dropped).
    positions = (position + torch.arange(n + pad).clamp_max(n - 1)).view(-1, 1, QUERY_BLOCK)
    offsets = torch.arange(KEY_PART).view(1, 1, -1)  # a part's key positions, from its start
    out = []
    for b, block in enumerate(blocks):
        last = int(positions[b].max())  # parts wholly past the block's last query hold no key it reads
        m = block.new_full((num_kv_heads, per_kv * QUERY_BLOCK, 1), float("-inf"))
        total = block.new_zeros(m.shape)
        acc = block.new_zeros(block.shape)
        where = positions[b].expand(per_kv, QUERY_BLOCK).reshape(1, -1, 1)
        for start in range(0, last + 1, KEY_PART):
            part = slice(start, start + KEY_PART)
            k, v = keys[part].transpose(0, 1), values[part].transpose(0, 1)  # [Hkv, KEY_PART, D]
            scores = torch.matmul(block, k.transpose(1, 2)) * scale
            visible = offsets <= where - start
            scores = scores.masked_fill(~visible, float("-inf"))
            # Key 0 is visible to every row, so m is finite from the first part on (its
            # rescale, exp(-inf), is 0). A part wholly after a row's position adds exp(-inf) = 0
            # to its sums and rescales them by exp(0) = 1: the row's bits do not change, so a
            # row gets the same result whatever the block's last position.
            new_m = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            p = (scores - new_m).exp()
            rescale = (m - new_m).exp()
            total = total * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p, v)
            m = new_m
        out.append(acc / total)
    # [blocks, Hkv, per_kv, QUERY_BLOCK, D] -> [n, Hq, D]
    merged = torch.stack(out).view(-1, num_kv_heads, per_kv, QUERY_BLOCK, head_dim).permute(0, 3, 1, 2, 4)
    return merged.reshape(-1, num_heads, head_dim)[:n]
