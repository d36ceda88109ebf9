"""tuili.kernels.prompt_attention (a prompt's causal attention on AMX tiles) against the written-out
softmax in float64 on the same bf16 inputs, and against torch's own CPU flash attention.

Tolerance: the kernel rounds the probabilities to bf16 before multiplying by v (as torch's CPU
flash attention does) and rounds its output to bf16, so it must agree with the float64
reference about as well as SDPA does: within twice SDPA's largest error, plus a little.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tuili import kernels
from tuili.layers import attention
from tuili.layers.attention import native_cpu
from tuili.platform import Platform

needs_amx = pytest.mark.skipif(
    not (kernels.available() and kernels.amx_available()),
    reason="this CPU, compiler or OS gives no AMX-BF16 (test_amx_is_available_where_the_cpu_has_it checks it)",
)


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0, magnitude: float = 1.0):
    """q, k, v as the model has them: views into one fused [T, (Hq + 2 Hkv) * D] product."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * magnitude).bfloat16()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    per_kv = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
    scores = q @ k.transpose(1, 2) * scale
    length = q.shape[1]
    scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    per_kv = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    k, v = k.repeat_interleave(per_kv, 1), v.repeat_interleave(per_kv, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)


@needs_amx
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 2, 1, 32), (31, 4, 4, 64), (32, 4, 2, 64), (33, 8, 2, 128), (100, 9, 3, 64), (300, 16, 8, 128),
     (65, 2, 1, 256)],
)  # fmt: skip
def test_prompt_attention_matches_the_softmax_as_well_as_sdpa(tokens, heads, kv_heads, head_dim):
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = kernels.prompt_attention(q, k, v, scale, torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16))
    expected = reference(q, k, v, scale)
    error = (out.double() - expected).abs().max().item()
    sdpa_error = (sdpa(q, k, v, scale).double() - expected).abs().max().item()
    assert error <= 2 * sdpa_error + 1e-3, (error, sdpa_error)
    # contiguous copies give the same bits as the strided views
    copies = [t.contiguous() for t in (q, k, v)]
    assert torch.equal(kernels.prompt_attention(*copies, scale, torch.empty_like(out)), out)


@needs_amx
def test_large_scores_stay_finite_and_exact_to_bf16():
    """Scores of several hundred: the online softmax subtracts each row's running max."""
    q, k, v = qkv_views(130, 4, 2, 64, seed=1, magnitude=12.0)
    scale = 64**-0.5
    out = kernels.prompt_attention(q, k, v, scale, torch.empty(130, 4, 64, dtype=torch.bfloat16))
    assert torch.isfinite(out).all()
    expected = reference(q, k, v, scale)
    sdpa_error = (sdpa(q, k, v, scale).double() - expected).abs().max().item()
    assert (out.double() - expected).abs().max().item() <= 2 * sdpa_error + 1e-2


@needs_amx
def test_any_thread_count_gives_the_same_bits():
    q, k, v = qkv_views(200, 8, 2, 128, seed=2)
    outs = []
    for threads in (1, 2, 3):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(kernels.prompt_attention(q, k, v, 0.1, torch.empty(200, 8, 128, dtype=torch.bfloat16)))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_amx
def test_the_prefill_layer_takes_the_kernel_for_bf16_and_sdpa_otherwise():
    q, k, v = qkv_views(70, 4, 2, 64, seed=3)
    assert native_cpu._prompt_kernel_takes(q, k, v)
    backend = attention.attention_backend(Platform.detect(), torch.bfloat16)
    assert torch.equal(backend.causal(q, k, v, 0.125),
                       kernels.prompt_attention(q, k, v, 0.125, torch.empty(70, 4, 64, dtype=torch.bfloat16)))
    assert not native_cpu._prompt_kernel_takes(q.float(), k.float(), v.float())
    assert not native_cpu._prompt_kernel_takes(*qkv_views(70, 4, 2, 48))  # head dim not a multiple of 32


def test_the_prefill_layer_in_bf16_matches_the_softmax_on_any_build():
    """The kernel where the build has AMX, SDPA where not (test_cpu_kernels.py reruns this file on
    builds without AMX): the same answer either way."""
    q, k, v = qkv_views(90, 8, 2, 64, seed=4)
    expected = reference(q, k, v, 0.125)
    sdpa_error = (sdpa(q, k, v, 0.125).double() - expected).abs().max().item()
    causal = attention.attention_backend(Platform.detect(), torch.bfloat16).causal
    assert (causal(q, k, v, 0.125).double() - expected).abs().max().item() <= 2 * sdpa_error + 1e-3


def test_bad_input_is_named():
    q, k, v = qkv_views(8, 4, 2, 64)
    out = torch.empty(8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q has dtype torch.float32"):
        kernels.prompt_attention(q.float(), k, v, 0.1, out)
    with pytest.raises(ValueError, match="KV heads dividing 4"):
        kernels.prompt_attention(q, *qkv_views(8, 3, 3, 64)[1:], 0.1, out)
    with pytest.raises(ValueError, match="multiple of 32 up to 256, got 48"):
        q48, k48, v48 = qkv_views(8, 4, 2, 48)
        kernels.prompt_attention(q48, k48, v48, 0.1, torch.empty(8, 4, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out has shape"):
        kernels.prompt_attention(q, k, v, 0.1, out[:4])
    with pytest.raises(ValueError, match="scale must be positive, got -0.1"):
        kernels.prompt_attention(q, k, v, -0.1, out)
    with pytest.raises(ValueError, match="v has shape"):
        kernels.prompt_attention(q, k, v[:4], 0.1, out)
