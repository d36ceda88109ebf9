"""tuili.kernels.linear_int4 (x @ W^T for a few rows, W in Int4Linear's packed layout) against the
float64 product with the module's own dequantized weight.

Tolerance: on CPUs with AVX512-VNNI the kernel writes x per group as two int8 parts (x ~ sx *
(254 xq + xq_low) with sx = max |x_g| / (127 * 254), so |x - sx * (254 xq + xq_low)| <= sx / 2,
plus float32's rounding of x * 127 / max) before multiplying by the codes q (0..15) times the
group's scale, the zero term using the exact sum of x (int4), or by the int8 values q times the
scale (Q8_0). So each output is off by at most sum_g sx_g / 2 * sum_{k in g} |m_k| from that
rounding (m = scale * q), plus float32 rounding of
the sums (c * |x| @ |W|^T with c = 2^-20), plus half a bf16 unit when the output is bf16. Other
CPUs compute in float32 and stay inside the same bound. Inputs whose groups are exactly
representable (integers, largest 127) leave only float32 rounding: that checks the layout to
float32 precision. test_cpu_kernels.py reruns this file on builds without VNNI and without
AVX-512.
"""

from __future__ import annotations

import pytest
import torch

from tuili import kernels
from tuili.layers.quant import (
    Int4Linear,
    Int4Weight,
    Int6GroupLinear,
    Int8GroupLinear,
    Int8GroupWeight,
    make_linear,
    quantize_int4,
)
from tuili.platform import Platform

HERE = Platform.detect()

FP32_BOUND = 2**-20


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


def int4_module(n: int, k: int, group: int, seed: int) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    return Int4Linear(quantize_int4(torch.randn(n, k, generator=generator), group), platform=HERE)


def q8_module(n: int, k: int, seed: int) -> Int8GroupLinear:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    return Int8GroupLinear(Int8GroupWeight(q, torch.rand(n, k // 32, generator=generator) / 50, 32), platform=HERE)


def q4_0_module(n: int, k: int, group: int, seed: int) -> Int4Linear:
    """A symmetric int4 weight, every zero 0 (GGUF Q4_0's blocks)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale = torch.rand(n, k // group, generator=generator) / 50
    return Int4Linear(Int4Weight(q, scale, torch.zeros_like(scale), group), platform=HERE)


def copies(module: Int4Linear) -> int:
    return module._input_copies


def run(module: Int4Linear, x: torch.Tensor, out_dtype: torch.dtype, exact: bool = False) -> torch.Tensor:
    out = torch.full((x.shape[0], module.out_features), float("nan"), dtype=out_dtype)
    assert kernels.linear_int4(x, module.packed, module.kernel_scales, out, copies(module), exact) is out
    return out


def quantization_bound(module: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """sum_g sx_g / 2 * sum_{k in g} |m_k|, m the multiplier of x's rounding: scale * q with the
    codes q = 0..15 over the packed K' (int4, x repeated), and the weight s * q itself for Q8_0
    (whose kernel multiplies x by q = 16h + l - 128 over K)."""
    n = module.out_features
    if copies(module) == 2:
        magnitude, group = module.dequantize().double().abs(), module.group_size
    else:
        weight = module._row_weight(torch.arange(n))  # the stored codes and scales of every row
        group = weight.group_size
        magnitude = (weight.q[:n].double().view(n, -1, group) * weight.scale[:n].double()[..., None]).abs()
    magnitude = magnitude.reshape(n, -1, group)
    # [M, groups]: the low part's half step, and float32's rounding of x * 127 / max (2^-24 of 127)
    half_step = x.double().view(x.shape[0], -1, group).abs().amax(-1) / (127 * 254) * (0.5 + 2**-12)
    return half_step @ magnitude.sum(-1).T


def assert_close(module: Int4Linear, x: torch.Tensor, out: torch.Tensor) -> None:
    w = module.dequantize().double()
    exact = x.double() @ w.T
    limit = quantization_bound(module, x) + FP32_BOUND * (x.double().abs() @ w.abs().T)
    if out.dtype == torch.bfloat16:
        limit = limit + 2**-8 * exact.abs()
    error = (out.double() - exact).abs()
    assert (error <= limit).all(), f"worst error / limit {(error / limit).max().item():.3g}"


# N: whole tiles, a padded last tile; K: one group, several; groups of 32 to 256.
SHAPES = [(64, 32, 32), (100, 64, 32), (130, 256, 64), (200, 512, 256)]


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 33])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_int4_matches_float64(m, x_dtype):
    for n, k, group in SHAPES:
        module = int4_module(n, k, group, seed=n + k + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
        for out_dtype in (torch.float32, torch.bfloat16):
            assert_close(module, x, run(module, x, out_dtype))


@pytest.mark.parametrize("m", [1, 4, 6, 17])  # 17: a prompt (the unpacked tile)
def test_q8_0_halves_match_float64(m):
    for n, k in [(64, 32), (100, 96), (130, 1024)]:
        module = q8_module(n, k, seed=n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        wide = run(module, x, torch.float32)
        assert_close(module, x, wide)
        assert torch.equal(run(module, x, torch.bfloat16), wide.bfloat16())  # one rounding of the same sums


@pytest.mark.parametrize("m", [1, 4, 17])
def test_q4_0_scales_alone_give_the_bits_of_zero_pairs(m):
    """Every zero 0: the module holds its scales alone (0.5625 bytes per value, Q4_0's own size),
    and the product and the tile dequantizer read them to the bits they give with (scale, 0)
    pairs, in the default and the exact sums."""
    for n, k, group in SHAPES:
        module = q4_0_module(n, k, group, seed=n + k + m)
        tiles = module.packed.shape[0]
        assert "scale_zero" not in module._buffers and module.scale.shape == (k // group, 64 * tiles)
        assert module.weight_bytes == module.packed.numel() + 2 * module.scale.numel()
        pairs = torch.stack([module.scale, torch.zeros_like(module.scale)], dim=-1)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        for out_dtype in (torch.float32, torch.bfloat16):
            for exact in (False, True):
                alone = run(module, x, out_dtype, exact)
                with_pairs = torch.full_like(alone, float("nan"))
                kernels.linear_int4(x, module.packed, pairs, with_pairs, 1, exact)
                assert torch.equal(alone, with_pairs)
        assert_close(module, x, run(module, x, torch.float32))
        w_t = kernels.dequantize_int4_tiles(module.packed, module.scale, 0, torch.empty(k, 64 * tiles))
        assert torch.equal(w_t, kernels.dequantize_int4_tiles(module.packed, pairs, 0, torch.empty(k, 64 * tiles)))
        assert torch.equal(w_t.t()[:n], module.dequantize())


def test_exactly_representable_input_leaves_only_float32_rounding():
    # Integer x with 127 the largest in every group: the int8 rounding of the VNNI path is exact,
    # so any misplaced code, scale or zero would show at float32 precision.
    for module in (int4_module(130, 128, 32, seed=1), q4_0_module(130, 128, 32, seed=1), q8_module(70, 64, seed=2)):
        k = module.in_features
        x = torch.randint(-127, 128, (3, k), generator=torch.Generator().manual_seed(3)).float()
        x[:, ::32] = 127.0
        w = module.dequantize().double()
        error = (run(module, x, torch.float32).double() - x.double() @ w.T).abs()
        assert (error <= FP32_BOUND * (x.double().abs() @ w.abs().T)).all()


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_same_bits(threads):
    module = int4_module(640, 128, 32, seed=4)  # 10 tiles over 3 threads: uneven
    x = torch.randn(2, 128).bfloat16()
    reference = run(module, x, torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(run(module, x, torch.float32), reference)  # each tile is one thread's
    finally:
        torch.set_num_threads(previous)


def test_module_takes_the_kernel_for_few_rows(monkeypatch):
    # Int4Linear.forward: bias added after, float32 logits on request, the same values as the
    # kernel called directly (its CPU's arithmetic in either mode: int8 rows of x on VNNI CPUs).
    module = Int4Linear(quantize_int4(torch.randn(96, 64), 32), bias=torch.randn(96), platform=HERE)
    x = torch.randn(2, 1, 64)
    assert module.kernel_for(2, torch.device("cpu")) == "gemv"
    y = module(x)
    assert y.dtype == torch.float32 and y.shape == (2, 1, 96)
    direct = run(module, x.view(2, 64), torch.float32) + module.bias.float()
    torch.testing.assert_close(y.view(2, 96), direct, rtol=0, atol=0)
    assert module(x.bfloat16(), out_dtype=torch.float32).dtype == torch.float32


def test_linear_int4_rejects_bad_input_naming_the_argument():
    module = int4_module(64, 64, 32, seed=5)
    x, packed, scale_zero = torch.randn(2, 64), module.packed, module.scale_zero
    q8 = q8_module(64, 32, seed=5)  # packed [1, 64, 32]: two halves of 32 inputs; scales [1, 64]
    out = torch.empty(2, 64)
    bad = [
        (rf"x has 0 rows; linear_int4 takes 1 to {kernels.LINEAR_INT4_MAX_ROWS}", (x[:0], packed, scale_zero, out)),
        (r"x has dtype torch\.float16", (x.half(), packed, scale_zero, out)),
        (rf"x has {kernels.LINEAR_INT4_MAX_ROWS + 1} rows; linear_int4 takes 1 to", (torch.randn(kernels.LINEAR_INT4_MAX_ROWS + 1, 64), packed, scale_zero, torch.empty(kernels.LINEAR_INT4_MAX_ROWS + 1, 64))),
        (r"packed has 64 inputs; expected 1 x 32", (x[:, :32].contiguous(), packed, scale_zero, out)),
        (r"scales has shape \[2, 64, 2\]; expected 2 dimensions", (x, packed, scale_zero, out, 2)),
        (r"packed has 64 inputs; expected 2 x 64", (x, q8.packed, q8.scale, out, 2)),
        (r"scales has shape \[1, 128\]; expected \[groups, 64\]", (x[:, :32].contiguous(), q8.packed, q8.scale.repeat(1, 2), out, 2)),
        (r"scales has 3 groups, which does not divide the packed weight's 32 inputs \(half of its rows",
         (x[:, :32].contiguous(), q8.packed, q8.scale.repeat(3, 1), out, 2)),
        (r"copies=4; expected 1", (x, packed, scale_zero, out, 4)),
        (r"scale_zero has dtype torch\.float32; expected torch\.bfloat16", (x, packed, scale_zero.float(), out)),
        (r"packed has dtype torch\.int8", (x, packed.view(torch.int8), scale_zero, out)),
        (r"out has shape \[2, 65\]; expected \[2, 1 \.\. 64\]", (x, packed, scale_zero, torch.empty(2, 65))),
        (r"out has dtype torch\.int32", (x, packed, scale_zero, out.int())),
        (r"groups of 2 inputs; linear_int4 takes groups of a multiple of 4", (x, packed, scale_zero[:1].expand(32, 64, 2).contiguous(), out)),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            kernels.linear_int4(*args)


@pytest.mark.parametrize("q8", [False, True], ids=["int4", "q8_0"])
def test_exact_sums_match_float64_and_never_depend_on_the_rows(q8):
    """exact: float32 sums of x as given on every CPU (no int8 rounding of x on VNNI CPUs), to
    float32 rounding of the float64 product, a row's bits the same in any block of rows."""
    module = q8_module(192, 128, seed=9) if q8 else int4_module(192, 128, 32, seed=9)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    every = run(module, x, torch.float32, exact=True)
    exact = x.double() @ module.dequantize().double().T
    assert ((every.double() - exact).abs() <= 1e-5 * (x.double().abs() @ module.dequantize().double().abs().T)).all()
    for rows in (1, 3, 5, 17):
        assert torch.equal(run(module, x[:rows].contiguous(), torch.float32, exact=True), every[:rows]), rows



@pytest.mark.parametrize("q8", [False, True], ids=["int4", "q8_0"])
def test_default_sums_never_depend_on_the_rows(q8):
    """The arithmetic the batch-invariant mode runs (two int8 parts of x on VNNI CPUs, else float32
    sums): a row's bits are the same alone, at any place in a block and in blocks of any size."""
    module = q8_module(192, 128, seed=10) if q8 else int4_module(192, 128, 32, seed=10)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(10)).bfloat16()
    every = run(module, x, torch.float32)
    for first, rows in ((0, 1), (0, 2), (0, 3), (1, 5), (3, 17), (7, 33)):
        part = run(module, x[first : first + rows].contiguous(), torch.float32)
        assert torch.equal(part, every[first : first + rows]), (first, rows)


@pytest.mark.parametrize("make", [lambda: int4_module(96, 128, 32, 5), lambda: q8_module(64, 128, 6)], ids=["int4", "q8"])
def test_output_rows_may_lie_apart_in_a_wider_tensor(make):
    # A stacked linear's part writes its columns of the whole output (StackedLinear), in place.
    module = make()
    x = torch.randn(5, module.in_features)
    alone = run(module, x, torch.float32)
    wide = torch.full((5, module.out_features + 40), float("nan"))
    kernels.linear_int4(x, module.packed, module.kernel_scales, wide[:, 24 : 24 + module.out_features], copies(module))
    assert torch.equal(wide[:, 24 : 24 + module.out_features], alone)
    assert wide[:, :24].isnan().all() and wide[:, 24 + module.out_features :].isnan().all()  # nothing else written
    with pytest.raises(ValueError, match="out"):  # columns apart: not a range of rows
        kernels.linear_int4(x, module.packed, module.kernel_scales, torch.empty(module.out_features, 5).t(), copies(module))


@pytest.mark.parametrize("m", [1, 4, 17, 33])  # 17, 33: a prompt's unpacked tile, and two blocks of rows
def test_6_bit_codes_give_the_bits_of_the_same_weight_as_q8_0_halves(m):
    """Codes in -32..31 (GGUF Q6_K, Q5_0) run at 6 bits on VNNI builds: the same integer sums as
    the 8-bit halves, so the same bits; elsewhere they stay 8-bit halves and copies 3 is refused."""
    for n, k, group in [(64, 32, 16), (100, 96, 32), (130, 1024, 16)]:
        generator = torch.Generator().manual_seed(n + k + m)
        q = torch.randint(-32, 32, (n, k), generator=generator, dtype=torch.int8)
        weight = Int8GroupWeight(q, torch.rand(n, k // group, generator=generator) / 50, group)
        module, halves = make_linear(weight, platform=HERE), Int8GroupLinear(weight, platform=HERE)
        x = torch.randn(m, k, generator=generator).bfloat16()
        if not kernels.linear_int6_available():  # builds without AVX512-VNNI and VBMI
            assert type(module) is Int8GroupLinear
            with pytest.raises(ValueError, match="6-bit codes"):
                kernels.linear_int4(x, halves.packed, halves.scale, torch.empty(m, n), 3)
            continue
        assert type(module) is Int6GroupLinear and torch.equal(module.dequantize(), halves.dequantize())
        tiles = -(-n // 64)
        assert module.weight_bytes == tiles * 64 * k * 3 // 4 + 2 * tiles * 64 * k // group  # 6 bits + scales
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(module(x, out_dtype), halves(x, out_dtype))
        with pytest.raises(ValueError, match="not exact"):
            kernels.linear_int4(x, module.packed, module.scale, torch.empty(m, n), 3, exact=True)
    # Codes outside -32..31 (Q8_0's) keep the 8-bit halves.
    assert type(make_linear(Int8GroupWeight(q * 0 + 40, weight.scale, group), platform=HERE)) is Int8GroupLinear


@pytest.mark.parametrize("m", [1, 5, 17])
def test_6_bit_codes_with_zeros_add_each_group_zero_times_the_sum_of_x(m):
    """GGUF Q5_1 and Q5_K: w = scale * q + zero per group. The product is the same codes' product
    without zeros plus sum_g zero_g * sum of x over g (float32 sums), where 6-bit codes run."""
    n, k, group = 130, 256, 32
    generator = torch.Generator().manual_seed(m)
    q = torch.randint(-16, 16, (n, k), generator=generator, dtype=torch.int8)
    scale, zero = torch.rand(n, k // group, generator=generator) / 50, torch.randn(n, k // group, generator=generator) / 10
    with_zeros = make_linear(Int8GroupWeight(q, scale, group, zero), platform=HERE) if kernels.linear_int6_available() else None
    if with_zeros is None:  # builds without AVX512-VNNI and VBMI: no module takes zeros, the loader dequantizes
        with pytest.raises(ValueError, match="run only as 6-bit codes"):
            make_linear(Int8GroupWeight(q, scale, group, zero), platform=HERE)
        return
    without = make_linear(Int8GroupWeight(q, scale, group), platform=HERE)
    assert type(with_zeros) is type(without) is Int6GroupLinear and with_zeros.kernel_scales.dim() == 3
    held = Int8GroupWeight(q, scale.bfloat16().float(), group, zero.bfloat16().float())  # as rounded once to bf16
    torch.testing.assert_close(with_zeros.dequantize(), held.dequantize(), rtol=0, atol=0)
    x = torch.randn(m, k, generator=generator).bfloat16()
    zero_bf16 = with_zeros.kernel_scales[..., 1].t()[:n].double()  # [n, groups] as held
    term = x.double().view(m, -1, group).sum(-1) @ zero_bf16.T
    difference = with_zeros(x, torch.float32).double() - without(x, torch.float32).double()
    bound = 2**-20 * (x.double().abs().view(m, -1, group).sum(-1) @ zero_bf16.abs().T + (x.double().abs() @ without.dequantize().double().abs().T))
    assert ((difference - term).abs() <= bound).all()
