"""The fused elementwise kernels (csrc/elementwise.c) against the torch code of tuili/layers that
they replace, run with the kernels disabled: RMSNorm with and without the residual add, q/k
RMSNorm with the rotary embedding, SiLU(gate) * up.

Both round at the same points; they may differ in the order of a float32 sum and in the last bits
of sqrt and exp, so a bfloat16 result may land one unit in the last place away (when the float32
value sits near a rounding boundary), rarely."""

from __future__ import annotations

import copy

import pytest
import torch

from tuili import kernels
from tuili.layers.activation import silu_and_mul
from tuili.layers.norm import OffsetRMSNorm, RMSNorm
from tuili.layers.rotary import RotaryEmbedding, apply_partial_rotary, norm_and_rotate
from tuili.platform import Platform

HERE = Platform.detect()


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


def torch_path(monkeypatch, fn):
    """fn(platform) on the portable platform (the torch code of tuili/layers)."""
    return fn(Platform.portable())


def portable(norms):
    """The same norm modules (one, or a tuple), computing on the portable platform."""
    if norms is None or isinstance(norms, tuple):
        return norms and tuple(portable(n) for n in norms)
    twin = copy.copy(norms)
    twin.platform = Platform.portable()
    return twin


def assert_close_to_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
        return
    ulp = 2.0**-7 * expected.float().abs().clamp_min(1e-30)
    off = (got.float() - expected.float()).abs()
    assert (off <= ulp).all(), f"worst difference {(off / ulp).max().item():.2f} units in the last place"
    assert (off > 0).float().mean() < 0.01, "more than 1% of the values differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1024, 576, 7])
def test_rms_norm_and_the_fused_residual_add(dtype, dim, monkeypatch):
    generator = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, HERE).to(dtype)
    norm.weight.data = torch.randn(dim, generator=generator).to(dtype)
    x = (torch.randn(3, 5, dim, generator=generator) * 4).to(dtype)
    residual = torch.randn(3, 5, dim, generator=generator).to(dtype)
    assert_close_to_torch(norm(x), torch_path(monkeypatch, lambda p: portable(norm)(x)))
    expected_out, expected_sum = torch_path(monkeypatch, lambda p: portable(norm)(x, residual.clone()))
    got_out, got_sum = norm(x, residual.clone())
    assert torch.equal(got_sum, expected_sum)  # one rounding of the same sum
    assert_close_to_torch(got_out, expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_and_rotary(dtype, qk_norm, monkeypatch):
    generator = torch.Generator().manual_seed(int(qk_norm))
    heads, kv_heads, head_dim, tokens = 6, 2, 64, 9
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim, 1e-6, HERE).to(dtype), RMSNorm(head_dim, 1e-6, HERE).to(dtype))
        for n in norms:
            n.weight.data = torch.randn(head_dim, generator=generator).to(dtype)
    tables = RotaryEmbedding(head_dim, 4096, 10000.0, None).tables(torch.randint(0, 4096, (tokens,), generator=generator))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    expected = torch_path(monkeypatch, lambda p: norm_and_rotate(qkv.clone(), heads, kv_heads, portable(norms), tables, p))
    got = norm_and_rotate(qkv.clone(), heads, kv_heads, norms, tables, HERE)
    for g, e in zip(got, expected, strict=True):
        assert_close_to_torch(g.contiguous(), e.contiguous())
    assert torch.equal(got[2], qkv[:, heads + kv_heads :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [256, 24], ids=["fast", "generic"])
def test_gated_attention_qk_norm_partial_rotary_and_output_gate(dtype, head_dim):
    """Qwen3-Next's form: q heads interleaved with their output gates ([q0, g0, q1, g1, ..., k, v]),
    offset norms, a quarter of each head rotated, q written apart; then x * sigmoid(gate). Against
    the torch code the model runs off the native kernels."""
    generator = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens, rotary_dim = 4, 2, 5, head_dim // 4
    norms = [OffsetRMSNorm(head_dim, 1e-6, Platform.portable()).to(dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.randn(head_dim, generator=generator) * 0.3).to(dtype)
    tables = RotaryEmbedding(rotary_dim, 4096, 1e7, None).tables(torch.randint(0, 4096, (tokens,), generator=generator))
    qkv = (torch.randn(tokens, 2 * heads + 2 * kv_heads, head_dim, generator=generator) * 3).to(dtype)
    q_gate = qkv[:, : 2 * heads].reshape(tokens, heads, 2, head_dim)
    expected_q = apply_partial_rotary(norms[0](q_gate[:, :, 0]), tables)
    expected_k = apply_partial_rotary(norms[1](qkv[:, 2 * heads : 2 * heads + kv_heads]), tables)
    got, q = qkv.clone(), qkv.new_empty(tokens, heads, head_dim)
    cos, sin = (t.view(tokens, -1) for t in tables)
    kernels.qk_norm_rope(got, heads, norms[0].weight, norms[1].weight, cos, sin, 1e-6, offset=True, q_step=2, q_out=q)
    assert_close_to_torch(q, expected_q)
    assert_close_to_torch(got[:, 2 * heads : 2 * heads + kv_heads], expected_k)
    untouched = torch.ones(2 * heads + 2 * kv_heads, dtype=torch.bool)
    untouched[[*range(0, 2 * heads, 2), *range(2 * heads, 2 * heads + kv_heads)]] = False
    assert torch.equal(got[:, untouched], qkv[:, untouched])  # the gates, v, and q where it was
    out = (torch.randn(tokens, heads, head_dim, generator=generator) * 2).to(dtype)
    expected_out = out * torch.sigmoid(q_gate[:, :, 1])
    assert_close_to_torch(kernels.sigmoid_gate(out, q_gate[:, :, 1]), expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(4, 3, 2 * 1500, generator=generator) * 6).to(dtype)  # both signs, past exp's range
    gate_up[0, 0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    assert_close_to_torch(silu_and_mul(gate_up, HERE), torch_path(monkeypatch, lambda p: silu_and_mul(gate_up, p)))


def test_elementwise_kernels_reject_bad_input_naming_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight has shape \[7\]; expected \[8\]"):
        kernels.rms_norm(x, torch.ones(7), 1e-6, torch.empty(2, 8))
    with pytest.raises(ValueError, match=r"residual has dtype torch\.bfloat16"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, torch.empty(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="qkv has 5 heads; expected 2 q heads"):
        kernels.qk_norm_rope(torch.randn(3, 5, 8), 2, None, None, torch.ones(3, 4), torch.ones(3, 4), 1e-6)
    with pytest.raises(ValueError, match=r"cos has shape \[3, 5\]; expected \[3, rotary_dim / 2 <= 4\]"):
        kernels.qk_norm_rope(torch.randn(3, 4, 8), 2, None, None, torch.ones(3, 5), torch.ones(3, 5), 1e-6)
    with pytest.raises(ValueError, match=r"sin has shape \[3, 4\]; expected \[3, 3\]"):
        kernels.qk_norm_rope(torch.randn(3, 4, 8), 2, None, None, torch.ones(3, 3), torch.ones(3, 4), 1e-6)
    with pytest.raises(ValueError, match="gate must be a CPU torch.float32 tensor"):
        kernels.sigmoid_gate(torch.randn(3, 2, 8), torch.randn(3, 2, 16)[..., ::2])
    with pytest.raises(ValueError, match="gate_up has 7 columns"):
        kernels.silu_mul(torch.randn(2, 7), torch.empty(2, 3))
