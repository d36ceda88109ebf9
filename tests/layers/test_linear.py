"""`linear`: the native GEMV for decode-sized inputs, F.linear otherwise, the same product."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tuili import kernels
from tuili.layers.linear import NATIVE_MAX_ROWS, Linear, linear
from tuili.platform import Platform

HERE = Platform.detect()  # batch invariant, the default
FASTEST = Platform.detect(batch_invariant=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 11])
@pytest.mark.parametrize("native", ["on", "off"])
def test_linear_is_the_float64_product(dtype, rows, native):
    platform = HERE if native == "on" else Platform.portable()
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 100, generator=generator).to(dtype)  # K not a multiple of 32
    bias = torch.randn(200, generator=generator).to(dtype)
    x = torch.randn(1, rows, 100, generator=generator).to(dtype)  # any leading shape
    got = linear(x, weight, bias, platform=platform)
    assert got.shape == (1, rows, 200) and got.dtype == dtype
    exact = x.double() @ weight.double().T + bias.double()
    # One rounding of the output to the dtype (float32 accumulation in both paths).
    eps = torch.finfo(dtype).eps
    bound = eps * exact.abs() + 1e-5 * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(16, 8, bias=True, platform=HERE)
    assert isinstance(layer, torch.nn.Linear) and set(dict(layer.named_parameters())) == {"weight", "bias"}
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_native_path_is_taken_where_the_kernels_build(monkeypatch):
    """Shows the dispatch: with the kernels available, a decode-sized bf16 product goes through
    linear_small (counted), a prefill-sized one does not (AMX or F.linear) where the CPU has bf16
    arithmetic, else linear_rows; in the batch-invariant mode every row count takes linear_rows
    (linear_small's arithmetic per row, all rows in one call) unless AMX takes them all."""
    if not kernels.available():
        pytest.skip(f"native kernels unavailable here: {kernels.unavailable_reason()}")
    calls = []
    for name in ("linear_small", "linear_rows"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, n=name, f=original: calls.append((n, a[0].shape)) or f(*a))
    weight = torch.randn(64, 32).bfloat16()
    linear(torch.randn(1, 32).bfloat16(), weight, platform=FASTEST)
    linear(torch.randn(NATIVE_MAX_ROWS[torch.bfloat16] + 1, 32).bfloat16(), weight, platform=FASTEST)
    prefill = [] if FASTEST.bf16_arithmetic else [("linear_rows", (NATIVE_MAX_ROWS[torch.bfloat16] + 1, 32))]
    assert calls == [("linear_small", (1, 32)), *prefill]
    calls.clear()
    without_bf16 = dataclasses.replace(FASTEST, amx=False, panel_linear=False, bf16_arithmetic=False)  # AVX2's
    linear(torch.randn(200, 32).bfloat16(), weight, platform=without_bf16)
    linear(torch.randn(200, 32), weight.float(), platform=without_bf16)  # float32: F.linear (MKL)
    assert calls == [("linear_rows", (200, 32))]
    calls.clear()
    linear(torch.randn(20, 100), torch.randn(64, 100), platform=HERE)
    assert calls == [("linear_rows", (20, 100))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_batch_invariant_rows_are_their_own(dtype, out_dtype):
    """In the batch-invariant mode a row's bits do not depend on how many rows share the call."""
    if not HERE.native_kernels:
        pytest.skip(f"native kernels unavailable here: {kernels.unavailable_reason()}")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(40, 128, generator=generator).to(dtype)
    alone = torch.cat([linear(x[i : i + 1], weight, bias, out_dtype, platform=HERE) for i in range(40)])
    for rows in (2, 5, 9, 17, 40):
        assert torch.equal(linear(x[:rows], weight, bias, out_dtype, platform=HERE), alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 3, 20, 100])
@pytest.mark.parametrize("native", ["on", "off"])
def test_float32_output_from_bf16_operands(rows, native):
    # Logits ask for float32 from bf16 weights. The native kernels skip the last rounding (GEMV at
    # any K; AMX, where the CPU has it, at K % 32 == 0 and any row count); elsewhere the bf16
    # product is widened, one bf16 rounding away from the exact value.
    platform = HERE if native == "on" else Platform.portable()
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=generator).bfloat16()
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    got = linear(x, weight, out_dtype=torch.float32, platform=platform)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    exact = x.double() @ weight.double().T
    float32_bound = 64 * 2**-24 * (x.double().abs() @ weight.double().abs().T)
    unrounded = platform.native_kernels and (
        rows <= NATIVE_MAX_ROWS[torch.bfloat16] or platform.amx or platform.batch_invariant
    )
    bound = float32_bound if unrounded else 2**-8 * exact.abs() + 2 * float32_bound
    assert ((got.double() - exact).abs() <= bound).all()
