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
