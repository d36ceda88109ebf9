"""tuili.kernels.linear_small (x @ weight.T + bias for 1..8 rows) against the product in float64, and
linear_rows (any number of rows) against linear_small row by row.

Tolerances: the kernel sums K products (exact for bf16 inputs) in 16 float32 lanes of about
K / 16 terms each, then adds the lanes and the bias: each result carries at most about
K / 16 + 32 float32 roundings (unit 2^-24), each at most that unit of sum |x| |w| + |b|. That
bound is far below one missing or doubled term. A bfloat16 output is then rounded once to
nearest, which moves it by at most half a unit in the last place, 2^-8 of its magnitude.
test_cpu_kernels.py reruns this file on libraries built without AVX512-BF16 and without AVX-512.
"""

from __future__ import annotations

import pytest
import torch

from tuili import kernels

# (N, K): K with tails after 32 (bf16 step) and 16 (fp32 step) or shorter than both, N not a
# multiple of the 4 or 2 rows taken at a time, and an empty K (out = bias).
SHAPES = [(37, 1000), (64, 64), (5, 31), (130, 576), (3, 1), (6, 17), (4, 0)]


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


def assert_matches_float64(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=out_dtype or x.dtype)
    assert kernels.linear_small(x, weight, bias, out) is out
    x64, w64 = x.double(), weight.double()
    b64 = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.double()
    expected = x64 @ w64.T + b64
    roundings = x.shape[1] / 16 + 32
    limit = roundings * 2**-24 * (x64.abs() @ w64.abs().T + b64.abs())
    if out.dtype == torch.bfloat16:
        limit = 2 * limit + 2**-8 * expected.abs()
    error = (out.double() - expected).abs()
    assert (error <= limit).all(), (
        f"shape {list(x.shape)} x {list(weight.shape)}: worst error {error.max().item():.3g}, "
        f"worst error/limit {(error / limit).max().item():.3g}"
    )
    return out


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", range(1, 9))
def test_linear_small_matches_float64(m, dtype, with_bias):
    for n, k in SHAPES:
        assert_matches_float64(*make_inputs(m, n, k, dtype, with_bias, seed=n * k + m))


@pytest.mark.parametrize("m", [1, 4, 8])
def test_linear_small_bf16_into_float32_skips_only_the_last_rounding(m):
    # The float32 output is the sum before its rounding: within float32's bound of the exact
    # product, and rounded to bf16 it is the bf16 output bit for bit.
    for n, k in SHAPES:
        x, weight, bias = make_inputs(m, n, k, torch.bfloat16, True, seed=n + k + m)
        wide = assert_matches_float64(x, weight, bias, out_dtype=torch.float32)
        assert torch.equal(wide.bfloat16(), assert_matches_float64(x, weight, bias))


@pytest.mark.parametrize("threads", [2, 3])
def test_linear_small_splits_rows_across_threads(threads):
    # Chunks of whole 4-row (M <= 4) or 2-row (M > 4) steps: with 5 rows and 3 threads the last
    # thread gets none, with 130 rows the last chunk ends in leftover rows.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 5, 8):
            for n in (5, 130):
                for dtype in (torch.float32, torch.bfloat16):
                    assert_matches_float64(*make_inputs(m, n, 96, dtype, True, seed=threads))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_weight_rows_bits_do_not_depend_on_the_rows_read_beside_it(threads):
    # A step reads several weight rows at once, adjacent or (without AVX-512) one from each part
    # of a thread's range: each output must be what that weight row gives alone, bit for bit, at
    # every row count of x whose steps take several weight rows (1 and 2), for N that leaves rows
    # over after the steps and one that does not.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2):
            for n in (64, 203):
                for dtype in (torch.float32, torch.bfloat16):
                    x, weight, bias = make_inputs(m, n, 80, dtype, True, seed=n + m)
                    got = kernels.linear_small(x, weight, bias, torch.full((m, n), float("nan"), dtype=dtype))
                    alone = [kernels.linear_small(x, weight[j : j + 1], bias[j : j + 1], torch.empty(m, 1, dtype=dtype))
                             for j in range(n)]  # fmt: skip
                    assert torch.equal(got, torch.cat(alone, dim=1)), (m, n, dtype)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_gives_each_row_linear_smalls_bits(dtype, threads):
    # Row counts from 8 (the tiled path's first without AVX-512) past one 8-row block, some not
    # multiples of the tiled path's 5 rows; N past its tiles of weight rows (32 at K = 1000) and
    # odd; float32 and bf16 outputs, with and without bias.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m, (n, k) in zip((8, 17, 40, 100, 9, 11, 12), SHAPES, strict=True):
            for with_bias in (True, False):
                x, weight, bias = make_inputs(m, n, k, dtype, with_bias, seed=m * n + k)
                for out_dtype in {dtype, torch.float32}:
                    got = kernels.linear_rows(x, weight, bias, torch.full((m, n), float("nan"), dtype=out_dtype))
                    alone = [kernels.linear_small(x[i : i + 1], weight, bias, torch.empty(1, n, dtype=out_dtype))
                             for i in range(m)]  # fmt: skip
                    assert torch.equal(got, torch.cat(alone)), (m, n, k, with_bias, out_dtype)
    finally:
        torch.set_num_threads(previous)


def test_linear_small_rejects_bad_input_naming_the_argument():
    x, weight, bias = make_inputs(2, 8, 16, torch.bfloat16, True)
    out = torch.empty(2, 8, dtype=torch.bfloat16)
    nine = torch.zeros(9, 16, dtype=torch.bfloat16)
    bad = [
        (r"x has 9 rows; linear_small takes 1 to 8", (nine, weight, bias, out)),
        (r"x has 0 rows; linear_small takes 1 to 8", (nine[:0], weight, bias, out)),
        (r"x has shape \[2, 16, 1\]; expected 2 dimensions", (x[..., None], weight, bias, out)),
        (r"x has dtype torch\.float16", (x.half(), weight, bias, out)),
        (r"weight has dtype torch\.float32; expected torch\.bfloat16", (x, weight.float(), bias, out)),
        (r"weight must be contiguous", (x, torch.zeros(16, 8, dtype=torch.bfloat16).T, bias, out)),
        (r"weight has shape \[8, 15\]; expected \[N, 16\]", (x, weight[:, :15].contiguous(), bias, out)),
        (r"bias has shape \[7\]; expected \[8\]", (x, weight, bias[:7], out)),
        (r"bias has dtype torch\.float32", (x, weight, bias.float(), out)),
        (r"out has shape \[2, 7\]; expected \[2, 8\]", (x, weight, bias, out[:, :7].contiguous())),
        (r"out has dtype torch\.float16; expected torch\.bfloat16 or torch\.float32", (x, weight, bias, out.half())),
        (r"out has dtype torch\.bfloat16; expected torch\.float32", (x.float(), weight.float(), bias.float(), out)),
        (r"bias must be a torch\.Tensor, got float", (x, weight, 0.5, out)),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            kernels.linear_small(*args)


def test_linear_small_unavailable_when_disabled(monkeypatch):
    monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    x, weight, bias = make_inputs(1, 4, 8, torch.float32, False)
    with pytest.raises(RuntimeError, match="unavailable"):
        kernels.linear_small(x, weight, bias, torch.empty(1, 4))
