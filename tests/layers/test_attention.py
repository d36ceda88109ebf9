"""Causal prefill attention against attention written out in float64: scores, mask, softmax."""

import pytest
import torch

from tuili.layers import attention
from tuili.layers.attention import torch_sdpa


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    per_kv = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
    scores = q @ k.transpose(1, 2) * scale
    length = q.shape[1]
    scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("grouped_query_kernel", [True, False])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_causal_attention_matches_the_written_out_softmax(monkeypatch, grouped_query_kernel, dtype, tolerance,
                                                          heads, kv_heads):
    if grouped_query_kernel and not torch_sdpa._SDPA_GQA:
        pytest.skip("this torch has no grouped-query SDPA; the repeat path is tested by the other case")
    monkeypatch.setattr(torch_sdpa, "_SDPA_GQA", grouped_query_kernel)
    # SDPA's paths (the torch backend): tests/kernels/test_prompt_attention.py checks the native kernel
    generator = torch.Generator().manual_seed(0)
    length, head_dim = 37, 64
    q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    out = attention.TorchAttention().causal(q, k, v, scale)
    assert out.shape == (length, heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, scale), atol=tolerance, rtol=tolerance)


def _paged(lengths_and_positions, kv_heads, head_dim, block_size, generator, dtype):
    """A shuffled paged cache holding each sequence's keys and values up to its last query, and
    the PagedBatch naming (first row, query rows, first position) per sequence."""
    contexts = [position + rows for rows, position in lengths_and_positions]
    blocks_each = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(blocks_each), generator=generator)
    shape = (len(order), block_size, kv_heads, head_dim)
    cache = attention.KVCache(torch.randn(shape, generator=generator).to(dtype),
                              torch.randn(shape, generator=generator).to(dtype))  # fmt: skip
    tables, info, first, used = [], [], 0, 0
    for (rows, position), count in zip(lengths_and_positions, blocks_each, strict=True):
        tables.append(order[used : used + count].tolist() + [0] * (max(blocks_each) - count))
        info.append((first, rows, position))
        first, used = first + rows, used + count
    paged = attention.PagedBatch(torch.tensor(tables, dtype=torch.int32), torch.tensor(info, dtype=torch.int32))
    return cache, paged, first


def _paged_reference(q, cache, paged, scale):
    out = []
    for (first, rows, position), table in zip(paged.seq_info.tolist(), paged.block_tables.long(), strict=True):
        context = position + rows
        k, v = (c[table].flatten(0, 1)[:context].double() for c in (cache.key, cache.value))
        per_kv = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(per_kv, 1).transpose(0, 1) for t in (k, v))  # [H, ctx, D]
        scores = q[first : first + rows].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        later = torch.arange(context)[None, :] > position + torch.arange(rows)[:, None]
        out.append((scores.masked_fill(later, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fixed_order_attention_matches_the_written_out_softmax_and_is_batch_invariant(dtype, tolerance):
    """The portable backend's batch-invariant mode over a paged cache: decodes, a prompt of 300
    tokens (two key parts, queries past one block), a chunk continuing at position 270; the same
    result as float64 softmax, and each token's bits the same when it is attended alone at its
    position (a decode) as inside a long chunk beside other sequences."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 16
    layout = [(1, 40), (300, 0), (1, 511), (37, 270)]
    cache, paged, rows = _paged(layout, kv_heads, head_dim, block_size, generator, dtype)
    q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    backend = attention.FixedOrderAttention()
    out = backend.attend_paged(q, cache, paged, scale, torch.empty_like(q))
    torch.testing.assert_close(out.double(), _paged_reference(q, cache, paged, scale), atol=tolerance, rtol=tolerance)
    for row in (0, 1, 17, 255, 299, 300, 301, rows - 1):  # alone, as a decode at that row's position
        seq = max(i for i, (first, _, _) in enumerate(paged.seq_info.tolist()) if first <= row)
        first, _, position = paged.seq_info[seq].tolist()
        alone = attention.PagedBatch(paged.block_tables[seq : seq + 1],
                                     torch.tensor([[0, 1, position + row - first]], dtype=torch.int32))  # fmt: skip
        single = backend.attend_paged(q[row : row + 1], cache, alone, scale, torch.empty_like(q[:1]))
        assert torch.equal(single[0], out[row]), f"row {row}"
