"""The AMX and panel linears against the product in float64: tuili.kernels.linear_amx (bf16
x @ weight.T + bias, the weight row-major) and linear_packed (the weight laid out once in 16-row
panels, the AMX B-tile layout: its GEMV at 1-4 rows, AMX tiles or, without AMX, the GEMV's dot
products from 5), and the PanelLinear module that holds such a weight.

Tolerance: AMX's TDPBF16PS multiplies bf16 pairs exactly and accumulates in float32; the kernel
adds 32-value slices of K into one float32 accumulator per output, then the bias, so each
result carries at most about K / 2 + 2 float32 roundings (unit 2^-24) of sum |x| |w| + |b|
(a deliberately loose count: the hardware's order inside one instruction is not specified),
and then one rounding to bfloat16, half a unit in the last place (2^-8 of the magnitude).
test_cpu_kernels.py reruns the availability test on libraries built without AMX.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tuili import kernels
from tuili.layers.linear import AMX_MAX_ROWS, NATIVE_MAX_ROWS, Linear, PanelLinear, linear, panel_holds
from tuili.platform import Platform


def cpu_has_amx_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and " amx_bf16" in cpuinfo.read_text()


def built_for_another_cpu() -> bool:
    """test_cpu_kernels.py's variants build with -march=x86-64-v3 (no AMX) after -march=native."""
    return "-march=" in os.environ.get("TUILI_KERNEL_CFLAGS", "")


needs_amx = pytest.mark.skipif(
    not (kernels.available() and kernels.amx_available()),
    reason="this CPU, compiler or OS gives no AMX-BF16 (test_amx_is_available_where_the_cpu_has_it checks it)",
)
needs_panels = pytest.mark.skipif(
    not (kernels.available() and kernels.linear_packed_available()),
    reason="this build has neither AVX512-BF16 nor AMX (test_panels_are_available_where_the_cpu_has_bf16 checks it)",
)


def make_inputs(m: int, n: int, k: int, with_bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    return x, weight, bias


def assert_matches_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    x64, w64 = x.double(), weight.double()
    b64 = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.double()
    expected = x64 @ w64.T + b64
    limit = (x.shape[1] / 2 + 2) * 2**-24 * (x64.abs() @ w64.abs().T + b64.abs())
    if out.dtype == torch.bfloat16:
        limit = 2 * limit + 2**-8 * expected.abs()
    error = (out.double() - expected).abs()
    assert (error <= limit).all(), (
        f"shape {list(x.shape)} x {list(weight.shape)}: worst error {error.max().item():.3g}, "
        f"worst error/limit {(error / limit).max().item():.3g}"
    )


def test_amx_is_available_where_the_cpu_has_it():
    assert kernels.available(), kernels.unavailable_reason()
    if built_for_another_cpu():
        assert not kernels.amx_available()  # a build for a CPU without AMX has no AMX code
    elif cpu_has_amx_bf16() and os.uname().sysname == "Linux":
        assert kernels.amx_available()
    else:
        assert not kernels.amx_available()


# Rows: one, a partial tile, two tiles (a pair), an odd number of tiles, more than one chunk
# of 128 with a ragged end. N: whole tile pairs, an odd tile count, a ragged end of 1..15 rows,
# fewer rows than a tile.
@needs_amx
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("m", [1, 5, 16, 32, 48, 131, 300])
def test_linear_amx_matches_float64(m, with_bias):
    for n, k in [(64, 32), (48, 96), (37, 64), (7, 32), (130, 576)]:
        x, weight, bias = make_inputs(m, n, k, with_bias, seed=m * n + k)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        assert kernels.linear_amx(x, weight, bias, out) is out
        assert_matches_float64(x, weight, bias, out)


@needs_amx
@pytest.mark.parametrize("m", [5, 33, 131])
def test_linear_amx_into_float32_skips_only_the_last_rounding(m):
    # Float32 output: the unrounded sum, within float32's bound of the exact product, and
    # rounded to bf16 exactly the bf16 output (ragged N included: the scalar tail too).
    for n, k in [(48, 96), (37, 64), (130, 576)]:
        x, weight, bias = make_inputs(m, n, k, True, seed=m + n + k)
        wide = torch.full((m, n), float("nan"))
        narrow = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        kernels.linear_amx(x, weight, bias, wide)
        kernels.linear_amx(x, weight, bias, narrow)
        assert_matches_float64(x, weight, bias, wide)
        assert torch.equal(wide.bfloat16(), narrow)


@needs_amx
@pytest.mark.parametrize("threads", [1, 3])
def test_linear_amx_any_thread_count_gives_the_same_bits(threads):
    x, weight, bias = make_inputs(40, 100, 128, True, seed=threads)
    reference = torch.empty(40, 100, dtype=torch.bfloat16)
    kernels.linear_amx(x, weight, bias, reference)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(reference)
        kernels.linear_amx(x, weight, bias, out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out, reference)  # each output is one thread's, in a fixed order


@needs_amx
def test_each_row_is_independent_of_the_others():
    """A row's result does not depend on the batch around it: the same bits at 1, 16, 40, 300 and
    600 rows (two and three chunks of x)."""
    x, weight, _ = make_inputs(600, 64, 256, False)
    alone = torch.empty(1, 64, dtype=torch.bfloat16)
    kernels.linear_amx(x[7:8].contiguous(), weight, None, alone)
    for rows in (16, 40, 300, 600):
        out = torch.empty(rows, 64, dtype=torch.bfloat16)
        kernels.linear_amx(x[:rows].contiguous(), weight, None, out)
        assert torch.equal(out[7], alone[0])


def test_linear_amx_rejects_bad_input_naming_the_argument():
    x, weight, bias = make_inputs(2, 16, 64, True)
    out = torch.empty(2, 16, dtype=torch.bfloat16)
    bad = [
        (r"x has 48 columns; linear_amx takes a multiple of 32", (x[:, :48].contiguous(), weight, bias, out)),
        (r"x has dtype torch\.float32; expected torch\.bfloat16", (x.float(), weight, bias, out)),
        (r"weight has shape \[16, 32\]; expected \[N, 64\]", (x, weight[:, :32].contiguous(), bias, out)),
        (r"weight must be contiguous", (x, torch.zeros(64, 16, dtype=torch.bfloat16).T, bias, out)),
        (r"bias has shape \[15\]; expected \[16\]", (x, weight, bias[:15], out)),
        (r"out has shape \[2, 15\]; expected \[2, 16\]", (x, weight, bias, out[:, :15].contiguous())),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            kernels.linear_amx(*args)


@needs_amx
def test_linear_takes_amx_between_the_gemv_and_onednn(monkeypatch):
    """The fastest kernel per row count (batch_invariant=False); the batch-invariant mode takes
    one kernel at every row count instead (tests/engine/test_batch_invariance.py)."""
    calls = []
    original = kernels.linear_amx
    monkeypatch.setattr(kernels, "linear_amx", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    weight = torch.randn(64, 32).bfloat16()
    fastest = Platform.detect(batch_invariant=False)
    for rows in (1, NATIVE_MAX_ROWS[torch.bfloat16], NATIVE_MAX_ROWS[torch.bfloat16] + 1, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        linear(torch.randn(rows, 32).bfloat16(), weight, platform=fastest)
    linear(torch.randn(8, 48).bfloat16(), torch.randn(64, 48).bfloat16(), platform=fastest)  # K not a multiple of 32: oneDNN
    assert calls == [NATIVE_MAX_ROWS[torch.bfloat16] + 1, AMX_MAX_ROWS]


# -- linear_packed and PanelLinear ---------------------------------------------------------------


def test_pack_weight_lays_out_16_row_panels_of_k_pairs():
    weight = torch.arange(48 * 64, dtype=torch.float32).reshape(48, 64).bfloat16()
    packed = kernels.pack_weight(weight)
    assert packed.shape == (3, 32, 16, 2) and packed.is_contiguous()
    for b, p, c, e in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 3, 1), (2, 31, 15, 0)]:
        assert packed[b, p, c, e] == weight[16 * b + c, 2 * p + e]
    assert torch.equal(kernels.unpack_weight(packed), weight)
    with pytest.raises(ValueError, match=r"weight has shape \[40, 64\]; packing takes N a multiple of 16"):
        kernels.pack_weight(weight[:40])


# Rows: the GEMV's 1-4, then AMX tiles: a partial tile, a ragged pair, an odd number of tiles,
# more than one chunk of 256 with a ragged end. N: whole panel pairs, an odd panel count.
@needs_panels
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 48, 131, 300])
def test_linear_packed_matches_float64(m, with_bias):
    for n, k in [(64, 32), (48, 96), (16, 64), (144, 576)]:
        x, weight, bias = make_inputs(m, n, k, with_bias, seed=m * n + k)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        assert kernels.linear_packed(x, kernels.pack_weight(weight), bias, out) is out
        assert_matches_float64(x, weight, bias, out)


@needs_panels
@pytest.mark.parametrize("m", [1, 4, 5, 33])
def test_linear_packed_into_float32_skips_only_the_last_rounding(m):
    x, weight, bias = make_inputs(m, 144, 576, True, seed=m)
    packed = kernels.pack_weight(weight)
    wide = torch.full((m, 144), float("nan"))
    narrow = torch.full((m, 144), float("nan"), dtype=torch.bfloat16)
    kernels.linear_packed(x, packed, bias, wide)
    kernels.linear_packed(x, packed, bias, narrow)
    assert_matches_float64(x, weight, bias, wide)
    assert torch.equal(wide.bfloat16(), narrow)


@needs_panels
@pytest.mark.parametrize("m", [3, 40, 300])
@pytest.mark.parametrize("threads", [1, 3])
def test_linear_packed_any_thread_count_gives_the_same_bits(m, threads):
    x, weight, bias = make_inputs(m, 112, 128, True, seed=threads)
    packed = kernels.pack_weight(weight)
    reference = torch.empty(m, 112, dtype=torch.bfloat16)
    kernels.linear_packed(x, packed, bias, reference)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(reference)
        kernels.linear_packed(x, packed, bias, out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out, reference)


@needs_panels
@pytest.mark.skipif(kernels.available() and kernels.amx_available(),
                    reason="AMX takes 5 rows and more here; test_cpu_kernels.py reruns this on a build without AMX")
def test_without_amx_a_row_never_depends_on_the_batch():
    """One path for every row count: the GEMV's dot products, in register blocks from 5 rows, so a
    row gets the same bits alone, in any batch and at any thread count (the engine's batch
    invariance rests on it)."""
    x, weight, bias = make_inputs(600, 80, 192, True, seed=7)
    packed = kernels.pack_weight(weight)

    def run(rows: int, threads: int = 1) -> torch.Tensor:
        out = torch.empty(rows, 80, dtype=torch.bfloat16)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return kernels.linear_packed(x[:rows].contiguous(), packed, bias, out)
        finally:
            torch.set_num_threads(previous)

    alone = [run(1)[0]] + [run(i + 1)[i] for i in range(1, 9)]
    for rows in (5, 9, 16, 17, 131, 600):
        batch = run(rows, threads=2)
        for i in range(min(rows, 9)):
            assert torch.equal(batch[i], alone[i]), (rows, i)
    assert_matches_float64(x, weight, bias, run(600))


@needs_panels
def test_one_path_rows_never_depend_on_the_batch():
    """one_path (the engine's batch-invariant mode): the same arithmetic at every row count on
    every CPU, AMX tiles from the first row where the CPU has them; still the float64 product."""
    x, weight, bias = make_inputs(300, 80, 192, True, seed=8)
    packed = kernels.pack_weight(weight)

    def run(rows: int) -> torch.Tensor:
        out = torch.empty(rows, 80, dtype=torch.bfloat16)
        return kernels.linear_packed(x[:rows].contiguous(), packed, bias, out, one_path=True)

    alone = torch.cat([kernels.linear_packed(x[i : i + 1], packed, bias, torch.empty(1, 80, dtype=torch.bfloat16),
                                             one_path=True) for i in range(20)])
    for rows in (1, 2, 4, 5, 16, 17, 131, 300):
        batch = run(rows)
        assert torch.equal(batch[: min(rows, 20)], alone[: min(rows, 20)]), rows
    assert_matches_float64(x, weight, bias, run(300))


def test_panels_are_available_where_the_cpu_has_bf16():
    """AVX512-BF16 in the CPU (as PyTorch reads it) means the panel kernel is built, unless the
    build was told not to use it (the variant builds of test_cpu_kernels.py)."""
    flags = os.environ.get("TUILI_KERNEL_CFLAGS", "")
    if not kernels.available() or "no-avx512bf16" in flags or "x86-64-v3" in flags:
        pytest.skip("no native kernels, or a build told not to use AVX512-BF16")
    has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    assert kernels.linear_packed_available() == (has_bf16 or kernels.amx_available())


@needs_panels
def test_each_row_is_independent_of_the_others_within_a_path():
    """The same bits for row 2 at 3 and 4 rows (the GEMV) and for row 7 at 8, 16, 40, 300 and 600
    rows (AMX: one partial tile, pairs, two and three chunks of x)."""
    x, weight, _ = make_inputs(600, 64, 256, False)
    packed = kernels.pack_weight(weight)

    def run(rows: int) -> torch.Tensor:
        out = torch.empty(rows, 64, dtype=torch.bfloat16)
        return kernels.linear_packed(x[:rows].contiguous(), packed, None, out)

    assert torch.equal(run(3)[2], run(4)[2])
    alone = run(8)[7]
    for rows in (16, 40, 300, 600):
        assert torch.equal(run(rows)[7], alone)


def test_linear_packed_rejects_bad_input_naming_the_argument():
    x, weight, bias = make_inputs(2, 16, 64, True)
    packed = kernels.pack_weight(weight)
    out = torch.empty(2, 16, dtype=torch.bfloat16)
    bad = [
        (r"x has 48 columns; linear_packed takes a multiple of 32", (x[:, :48].contiguous(), packed, bias, out)),
        (r"x has dtype torch\.float32; expected torch\.bfloat16", (x.float(), packed, bias, out)),
        (r"packed has shape \[1, 16, 16, 2\]; expected \[N / 16, 32, 16, 2\]", (x, packed[:, :16].contiguous(), bias, out)),
        (r"packed has dtype torch\.float32", (x, packed.float(), bias, out)),
        (r"bias has shape \[15\]; expected \[16\]", (x, packed, bias[:15], out)),
        (r"out has shape \[2, 15\]; expected \[2, 16\]", (x, packed, bias, out[:, :15].contiguous())),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            kernels.linear_packed(*args)


@needs_panels
def test_panel_holds_the_linears_the_layout_takes():
    """The weight plan's test for a PanelLinear: bf16 where linear_packed runs (AVX512-BF16 or
    AMX), N a multiple of 16, K of 32; the layer then holds the same weight, laid out."""
    here, portable = Platform.detect(), Platform.portable()
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    assert panel_holds(weight, bias, here) and panel_holds(weight[:16, :32], None, here)
    assert not panel_holds(weight, bias, portable)  # no native kernels on the portable platform
    assert not panel_holds(weight[:, :40], None, here)  # K not a multiple of 32
    assert not panel_holds(weight[:40], None, here)  # N not a multiple of 16
    assert not panel_holds(weight.float(), None, here)  # float32 weights stay row-major
    assert torch.equal(PanelLinear(weight, bias).weight(), weight)


@needs_panels
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_panel_linear_equals_its_product_and_the_portable_one(rows):
    torch.manual_seed(rows)
    dense = Linear(96, 80, bias=True, platform=Platform.portable()).bfloat16()
    packed = PanelLinear(dense.weight, dense.bias)
    x = torch.randn(2, rows, 96).bfloat16()
    out = packed(x)
    assert out.shape == (2, rows, 80) and out.dtype == torch.bfloat16
    assert_matches_float64(x.reshape(-1, 96), dense.weight, dense.bias, out.reshape(-1, 80))
    wide = packed(x, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), out)
    assert torch.equal(dense(x), F.linear(x, dense.weight, dense.bias))  # the portable path: torch
    with pytest.raises(ValueError, match="input has 95 features, this layer expects 96"):
        packed(x[..., :95])
