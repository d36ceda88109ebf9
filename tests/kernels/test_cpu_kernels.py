"""The native CPU kernels (tuili/kernels) against references computed by torch.

Paged attention is checked against torch's scaled_dot_product_attention, in float64, on each
sequence's keys and values gathered through its block table and dequantized, with the causal
mask. Tolerances: float32 inputs agree to float32 rounding (1e-5 on outputs of order 1); bfloat16
outputs to their own rounding (2^-8 relative), float8 caches like float32 (their values are
exact in float32). The dequantizers must reproduce the torch dequantization bit for bit.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tuili import kernels
from tuili.kernels import build
from tuili.layers.quant import Int8GroupWeight, make_linear, quantize_int4
from tuili.platform import Platform

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    """These tests are about the kernels themselves, whatever the caller's environment says."""
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


# -- paged attention -------------------------------------------------------------------------------


@dataclass
class Batch:
    """Inputs of one paged_attention call, built from (query rows, first position) per sequence."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_info: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    q_dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Batch:
    """Sequences (n query rows, first position p0) one after the other in q, after one row that
    belongs to no sequence; blocks drawn at random from a pool twice the size needed, table rows
    padded with -1 (never read)."""
    generator = torch.Generator().manual_seed(seed)
    needed = [math.ceil((n + p0) / block_size) if n else 0 for n, p0 in seqs]
    pool = 2 * sum(needed) + 1
    shape = (pool, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    k_scale = v_scale = None
    if cache_dtype == FP8:
        # Codes over all of e4m3's range, subnormals included; dequantized values of order 1.
        k_scale, v_scale = ((torch.rand(kv_heads, generator=generator) + 0.5) / 100 for _ in range(2))
        k_cache, v_cache = ((c * 100).clamp(-448, 448).to(FP8) for c in (k_cache, v_cache))
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    order = torch.randperm(pool, generator=generator)
    tables = torch.full((len(seqs), max(needed + [1])), -1, dtype=index_dtype)
    info, row, used = [], 1, 0
    for b, ((n, p0), count) in enumerate(zip(seqs, needed, strict=True)):
        tables[b, :count] = order[used : used + count]
        used += count
        info.append((row, n, p0))
        row += n
    q = torch.randn(row, heads, head_dim, generator=generator).to(q_dtype)
    return Batch(q, k_cache, v_cache, tables, torch.tensor(info, dtype=index_dtype), k_scale, v_scale)


def reference(batch: Batch) -> torch.Tensor:
    """SDPA in float64 per sequence on its gathered, dequantized keys and values."""
    block_size, kv_heads = batch.k_cache.shape[1:3]
    per_kv = batch.q.shape[1] // kv_heads
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    for b, (first, n, p0) in enumerate(batch.seq_info.tolist()):
        if n == 0:
            continue
        context = p0 + n
        blocks = batch.block_tables[b, : math.ceil(context / block_size)].long()
        k, v = (cache[blocks].flatten(0, 1)[:context].double() for cache in (batch.k_cache, batch.v_cache))
        if batch.k_scale is not None:
            k, v = k * batch.k_scale.double()[:, None], v * batch.v_scale.double()[:, None]
        k, v = (t.transpose(0, 1).repeat_interleave(per_kv, dim=0) for t in (k, v))  # [Hq, context, D]
        q = batch.q[first : first + n].double().transpose(0, 1)
        mask = torch.arange(context)[None, :] <= p0 + torch.arange(n)[:, None]
        out[first : first + n] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=batch.scale
        ).transpose(0, 1)
    return out


def run_kernel(batch: Batch) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    result = kernels.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_info, batch.scale, out,
        batch.k_scale, batch.v_scale,
    )  # fmt: skip
    assert result is out
    return out


def assert_matches_reference(batch: Batch, out: torch.Tensor) -> None:
    expected = reference(batch)
    covered = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    for first, n, _ in batch.seq_info.tolist():
        covered[first : first + n] = True
    assert out[~covered].isnan().all(), "rows of no sequence must be left untouched"
    got, expected = out[covered].double(), expected[covered]
    if out.dtype == torch.bfloat16:
        limit = 2**-8 * expected.abs() + 1e-5  # one rounding to bfloat16 of an fp32 result
    else:
        limit = 1e-5 * expected.abs() + 1e-5
    error = (got - expected).abs()
    assert (error <= limit).all(), (
        f"worst error {error.max().item():.3g}, worst error/limit {(error / limit).max().item():.3g}"
    )


# (n query rows, first position): a decode at context 1, a decode whose context is not a multiple
# of any block size, a prompt chunk continuing at position 11, an empty sequence, a fresh prompt
# chunk, a longer decode, a two-token chunk (with one or two query heads per KV head its rows, at
# two different contexts, take the decodes' path: at most four rows per KV head).
MIXED = [(1, 0), (1, 16 * 3), (5, 11), (0, 3), (7, 0), (1, 69), (2, 30)]

PRECISIONS = {  # q dtype, cache dtype
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8-cache": (torch.float32, FP8),
    "fp8-cache-bf16-q": (torch.bfloat16, FP8),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("per_kv", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_paged_attention_matches_sdpa(precision, per_kv, block_size, head_dim):
    q_dtype, cache_dtype = PRECISIONS[precision]
    batch = make_batch(MIXED, 2 * per_kv, 2, head_dim, block_size, q_dtype, cache_dtype)
    assert_matches_reference(batch, run_kernel(batch))


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_context_split_across_threads_matches_sdpa(threads):
    # Few sequences, long contexts: each unit's keys are split among threads and merged. A long
    # prompt chunk continuing at position 300 has more rows than a tile (several tiles).
    # Large logits (q scaled by 4) make the running maximum move, which the merge must respect.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seqs, cache_dtype in [([(1, 999)], torch.float32), ([(1, 520), (40, 300)], torch.bfloat16)]:
            batch = make_batch(seqs, 8, 2, 64, 16, cache_dtype, cache_dtype, seed=threads)
            batch.q *= 4
            assert_matches_reference(batch, run_kernel(batch))
    finally:
        torch.set_num_threads(previous)


def test_int64_indices_and_a_head_size_without_a_vector_path():
    # head_dim 40 is not a multiple of 16: the portable C path runs even on AVX-512 machines.
    for head_dim in (40, 64):
        batch = make_batch(MIXED, 6, 3, head_dim, 4, index_dtype=torch.int64, seed=head_dim)
        assert_matches_reference(batch, run_kernel(batch))


def call_with(batch: Batch, **changes) -> None:
    args = {
        "q": batch.q, "k_cache": batch.k_cache, "v_cache": batch.v_cache, "block_tables": batch.block_tables,
        "seq_info": batch.seq_info, "scale": batch.scale, "out": torch.empty_like(batch.q),
        "k_scale": batch.k_scale, "v_scale": batch.v_scale,
    }  # fmt: skip
    args.update(changes)
    kernels.paged_attention(**args)


def test_paged_attention_rejects_bad_input_naming_the_argument():
    batch = make_batch([(1, 5), (2, 3)], 4, 2, 64, 4)
    stray_block = batch.block_tables.clone()
    stray_block[1, 0] = 9999
    wide = torch.randn(*batch.k_cache.shape[:3], 128)
    fp8 = make_batch([(1, 5)], 4, 2, 64, 4, cache_dtype=FP8)
    bad = {
        r"q has dtype torch\.int32": {"q": batch.q.int()},
        r"k_cache must be contiguous": {"k_cache": wide[..., :64]},
        r"k_cache has shape .*KV heads dividing q's 4 heads": {
            "k_cache": batch.k_cache[:, :, :1].repeat(1, 1, 3, 1)
        },
        r"v_cache has dtype torch\.bfloat16": {"v_cache": batch.v_cache.bfloat16()},
        r"seq_info has shape \[2, 2\]; expected \[2, 3\]": {"seq_info": batch.seq_info[:, :2].contiguous()},
        r"out has dtype torch\.bfloat16": {"out": batch.q.bfloat16()},
        r"block_tables has dtype torch\.float32": {"block_tables": batch.block_tables.float()},
        r"block_tables: sequence 1 refers to block 9999, outside the cache's \[0, 9\)": {
            "block_tables": stray_block
        },
        r"block_tables: sequence 0's context needs 2 blocks, but the table has 1 columns": {
            "block_tables": batch.block_tables[:, :1].contiguous()
        },
        r"seq_info: sequence 1's query rows end at row 5, but q has 4 rows": {
            "seq_info": torch.tensor([[1, 1, 5], [2, 3, 3]], dtype=torch.int32)
        },
        r"seq_info: sequence 0 has the negative entry -2": {
            "seq_info": torch.tensor([[1, 1, -2], [2, 2, 3]], dtype=torch.int32)
        },
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            call_with(batch, **change)
    with pytest.raises(ValueError, match=r"k_scale and v_scale .* are required with a float8_e4m3fn cache"):
        call_with(fp8, k_scale=None)
    with pytest.raises(ValueError, match=r"k_scale has shape \[3\]; expected \[2\]"):
        call_with(fp8, k_scale=torch.ones(3))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_queries_read_in_place_from_the_fused_qkv_product(precision):
    # q as the model passes it: the first heads of each token's [q | k | v] row, tokens apart by
    # the whole row. Same bits as from a contiguous copy.
    q_dtype, cache_dtype = PRECISIONS[precision]
    batch = make_batch(MIXED, 4, 2, 64, 4, q_dtype, cache_dtype)
    qkv = torch.randn(batch.q.shape[0], 8, 64).to(q_dtype)
    qkv[:, :4] = batch.q
    view = qkv[:, :4]
    assert not view.is_contiguous()
    from_view = run_kernel(Batch(view, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_info))
    torch.testing.assert_close(from_view, run_kernel(batch), rtol=0, atol=0, equal_nan=True)


def test_queries_whose_heads_are_not_contiguous_are_refused():
    batch = make_batch([(1, 5)], 4, 2, 64, 4)
    with pytest.raises(ValueError, match="q must be contiguous"):
        call_with(batch, q=torch.randn(batch.q.shape[0], 64, 4).transpose(1, 2))


# -- writing the KV cache --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_kv_store_writes_each_token_at_its_slot(dtype):
    # k and v as the model passes them: views into the fused qkv rows. The reference is
    # index_copy_ on the flattened cache.
    tokens, kv_heads, head_dim = 5, 2, 16
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim).to(dtype)
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    k_cache, v_cache = (torch.randn(6, 4, kv_heads, head_dim).to(dtype) for _ in range(2))
    slots = torch.tensor([3, 0, 23, 9, 10])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for expected, new in ((expected_k, k), (expected_v, v)):
        expected.view(torch.uint8).view(24, kv_heads, -1).index_copy_(0, slots, new.contiguous().view(torch.uint8))
    kernels.kv_store(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


def test_kv_store_rejects_bad_input_and_writes_nothing():
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match=r"slot_mapping: token 1 has slot 12, outside the cache's \[0, 12\)"):
        kernels.kv_store(k, v, k_cache, v_cache, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=r"slot -1"):
        kernels.kv_store(k, v, k_cache, v_cache, torch.tensor([-1, 2]))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match=r"k_cache has dtype torch\.bfloat16"):
        kernels.kv_store(k, v, k_cache.bfloat16(), v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"k_cache has shape \[3, 4, 1, 16\]"):
        kernels.kv_store(k, v, k_cache.view(3, 4, 1, 16), v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"v has shape \[2, 1, 8\]"):
        kernels.kv_store(k, v[:, :1], k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slot_mapping has dtype torch\.int32"):
        kernels.kv_store(k, v, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))


# -- dequantizing packed int4 tiles ----------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int4_tiles_equal_the_torch_dequantization(group_size, compute_dtype):
    # 100 rows: two tiles of 64, the second one padded with zero weights.
    generator = torch.Generator().manual_seed(group_size)
    weight = torch.randn(100, 256, generator=generator) * torch.rand(100, 1, generator=generator)
    module = make_linear(quantize_int4(weight, group_size, compute_dtype), None, compute_dtype, platform=Platform.detect())
    expected = module.dequantize()  # [100, 256] float32
    for out_dtype in (torch.float32, torch.bfloat16):
        w_t = kernels.dequantize_int4_tiles(
            module.packed, module.scale_zero, 0, torch.empty(256, 128, dtype=out_dtype)
        )
        assert torch.equal(w_t.t()[:100], expected.to(out_dtype))
        assert not w_t[:, 100:].any(), "padding rows must dequantize to 0"
        second = kernels.dequantize_int4_tiles(
            module.packed, module.scale_zero, 1, torch.empty(256, 64, dtype=out_dtype)
        )
        assert torch.equal(second, w_t[:, 64:])


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int8_group_tiles_rebuild_q8_0_exactly(compute_dtype):
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (130, 96), dtype=torch.int8, generator=generator)
    scale = torch.rand(130, 3, generator=generator) * 1e-2
    weight = Int8GroupWeight(q, scale.to(compute_dtype).float(), 32)
    module = make_linear(weight, None, compute_dtype, platform=Platform.detect())
    expected = weight.dequantize()  # s * q, one float32 rounding
    if compute_dtype == torch.bfloat16:  # the module's own dequantization is then exact as well
        assert torch.equal(module.dequantize(), expected)
    for out_dtype in (torch.float32, torch.bfloat16):
        w_t = kernels.dequantize_int8_group_tiles(
            module.packed, module.scale, 0, torch.empty(96, 192, dtype=out_dtype)
        )
        assert torch.equal(w_t.t()[:130], expected.to(out_dtype))
        assert not w_t[:, 130:].any()


def test_dequantizers_reject_bad_input_naming_the_argument():
    module = make_linear(quantize_int4(torch.randn(128, 64), 32), platform=Platform.detect())
    packed, scale_zero = module.packed, module.scale_zero
    out = torch.empty(64, 128, dtype=torch.bfloat16)
    bad = [
        (r"packed has dtype torch\.int8", (packed.view(torch.int8), scale_zero, 0, out)),
        (
            r"scale_zero has shape \[2, 64, 2\]; expected \[groups, 128, 2\]",
            (packed, scale_zero[:, :64].contiguous(), 0, out),
        ),
        (
            r"scale_zero must be contiguous",
            (packed, scale_zero.transpose(0, 1).contiguous().transpose(0, 1), 0, out),
        ),
        (
            r"out has shape \[64, 100\]; expected \[64, a multiple of 64\]",
            (packed, scale_zero, 0, out[:, :100].contiguous()),
        ),
        (r"tiles 1 \.\. 2 are outside the weight's 2 tiles", (packed, scale_zero, 1, out)),
        (r"out has dtype torch\.float16", (packed, scale_zero, 0, out.half())),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            kernels.dequantize_int4_tiles(*args)


# -- the fallback: disabled, or no working compiler ----------------------------------------------


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    assert not kernels.available()
    assert "TUILI_NATIVE_KERNELS=0" in kernels.unavailable_reason()
    batch = make_batch([(1, 3)], 2, 1, 64, 4)
    with pytest.raises(RuntimeError, match="unavailable"):
        run_kernel(batch)


# A process importing tuili (and torch: seconds), and one that loads only tuili/kernels/build.py,
# which needs no torch, for the tests of the build and its cache.
FULL_PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from tuili import kernels
from tuili.kernels import build
print("available:", kernels.available())
"""
BUILD_PROBE = """
import importlib.util, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
spec = importlib.util.spec_from_file_location("tuili_kernels_build", sys.argv[1])
build = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
print("available:", build.load().library is not None)
"""

# linear_int4 on fixed inputs, its integer path (not `exact`): a digest per call
INT4_BITS_PROBE = """
import hashlib, torch
from tuili import kernels
from tuili.layers.quant import Int4Linear, Int8GroupLinear, Int8GroupWeight, quantize_int4
from tuili.platform import Platform
torch.manual_seed(0)
platform = Platform.detect("cpu")
modules = {f"int4 {group}": Int4Linear(quantize_int4(torch.randn(200, 512), group), platform=platform)
           for group in (32, 128)}
q = torch.randint(-128, 128, (200, 512), dtype=torch.int8)
q[:, :32] = -128  # the codes' edge: u = q + 128 = 0, |q| = 128
modules["q8_0"] = Int8GroupLinear(Int8GroupWeight(q, torch.rand(200, 16) / 50, 32), platform=platform)
for name, module in modules.items():
    for rows in (1, 3, 7, 17):  # 17: a prompt's rows, each tile unpacked once
        for dtype in (torch.float32, torch.bfloat16):  # x as given: both are rounded to int8 in C
            x = torch.randn(rows, 512).to(dtype)
            out = torch.empty(rows, 200)
            kernels.linear_int4(x, module.packed, module.kernel_scales, out, module._input_copies, False)
            print("bits", name, rows, dtype, hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def start(command: list[str], cache: Path | None, **env: str) -> subprocess.Popen:
    """A fresh Python process on its own kernel cache (None: this process's, where the other
    tests' builds for the same flags are shared), its output captured."""
    environment = {k: v for k, v in os.environ.items() if k not in ("TUILI_NATIVE_KERNELS", "TUILI_CC")}
    if cache is not None:
        environment["TUILI_KERNEL_CACHE"] = str(cache)
    environment.update(OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(
        [sys.executable, *command],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def probe(script: str, cache: Path | None, **env: str) -> subprocess.Popen:
    """A process that reports whether the kernels are available, with its log."""
    return start(["-c", script, str(Path(build.__file__))], cache, **env)


# Correctness tests of this file and of the kernel files below rerun on libraries built for CPUs
# with AVX512-BF16 but no AMX (AMD Zen 4 and 5: linear_packed's dot products instead of AMX tiles
# from 5 rows), with AVX-512 but not its BF16 and VNNI instructions (the dequantizers then round to bfloat16 in
# integer arithmetic, linear_small widens bf16 to float32 for FMAs, linear_int4 computes in
# float32, paged attention converts bf16 keys to float32, prompt attention keeps its AMX path),
# with AVX2 only (the portable C code elsewhere, the DeltaNet kernel's expf SiLU, and no AMX; linear_int4's
# integer dots for int4), and without AVX2 (linear_int4's plain C sums; the DeltaNet kernel's plain
# loops, its decode rows' rule walking the state by rows as on AVX2, not by AVX-512's blocks):
# flags -> pytest -k.
X86_VARIANTS = {
    "-mno-amx-tile -mno-amx-bf16 -mno-amx-int8": "packed or panel",
    "-mno-avx512bf16 -mno-avx512vnni": "matches_sdpa or split or fused_qkv or tiles or linear_small or int4 "
    "or q8_0 or representable or softmax",
    # no AVX2 either (x86-64-v2; what ARM and other CPUs build too): linear_int4's plain C sums, the
    # DeltaNet kernel's plain loops, paged attention's plain C scores and values (AVX2 has intrinsics)
    "-march=x86-64-v2": "int4 or q8_0 or deltanet or matches_sdpa or split",
    "-march=x86-64-v3": "matches_sdpa or split or int64 or tiles or linear_small or amx_is_available "
    "or rms_norm or qk_norm or silu or int4 or q8_0 or representable or argmax or fused_qkv or kv_store "
    "or softmax or deltanet",
}
VARIANT_FILES = [
    __file__,
    *(
        str(Path(__file__).with_name(f))
        for f in (
            "test_linear_small.py", "test_linear_amx.py", "test_elementwise.py", "test_linear_int4.py",
            "test_argmax.py", "test_prompt_attention.py", "test_deltanet_decode.py",
        )
    ),
]


def _has_vnni_and_vbmi() -> bool:
    return {"avx512_vnni", "avx512vbmi"} <= set(Path("/proc/cpuinfo").read_text().split())


@pytest.fixture(scope="module")
def fresh_processes(tmp_path_factory, kernel_isa) -> dict[str, str]:
    """Outputs of fresh processes, started together as each spends seconds importing torch: one
    with a missing compiler, one with a compiler that fails, two building into the same empty
    cache at once (then one more on that cache), and the x86 variants, on this process's cache
    (tests/engine/test_batch_invariance.py builds two of the same flags, and a later run of
    the same sources builds none). A variant whose instruction-set macros are this CPU's own
    (kernel_isa: "-mno-amx-tile" on a CPU without AMX, say) compiles the code paths this suite
    already runs natively, so it is not run again."""
    root = tmp_path_factory.mktemp("kernel-builds")
    broken = root / "broken-cc"
    broken.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "broken-cc 1.0"; exit 0; }\n'
        'echo "error: deliberately broken" >&2; exit 1\n'
    )
    broken.chmod(0o755)
    runs = {
        "missing": probe(FULL_PROBE, root / "missing", TUILI_CC="/nonexistent/cc"),
        "failing": probe(BUILD_PROBE, root / "failing", TUILI_CC=str(broken)),
        "first": probe(BUILD_PROBE, root / "shared"),
        "second": probe(BUILD_PROBE, root / "shared"),
    }
    if platform.machine() == "x86_64":
        native = kernel_isa("")
        for flags, selection in X86_VARIANTS.items():
            if kernel_isa(flags) == native:
                continue
            pytest_run = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *VARIANT_FILES, "-k", selection]
            runs[flags] = start(pytest_run, None, TUILI_KERNEL_CFLAGS=flags)
    outputs = {name: run.communicate(timeout=600)[0] for name, run in runs.items()}
    outputs |= {f"{name} status": str(run.returncode) for name, run in runs.items()}
    outputs["later"] = probe(BUILD_PROBE, root / "shared").communicate(timeout=300)[0]
    if platform.machine() == "x86_64" and _has_vnni_and_vbmi():  # on the libraries built above
        bits = {"int4 bits": probe(INT4_BITS_PROBE, root / "shared"),
                "int4 bits, AVX2": probe(INT4_BITS_PROBE, None, TUILI_KERNEL_CFLAGS="-march=x86-64-v3")}
        outputs |= {name: run.communicate(timeout=300)[0] for name, run in bits.items()}
    outputs["root"] = str(root)
    return outputs


def test_missing_compiler_leaves_the_kernels_unavailable_and_says_why(fresh_processes):
    output = fresh_processes["missing"]
    assert "available: False" in output
    assert "tuili.kernels.build INFO native CPU kernels unavailable" in output and "/nonexistent/cc" in output


def test_failing_compiler_leaves_no_file_behind(fresh_processes):
    output = fresh_processes["failing"]
    assert "available: False" in output and "deliberately broken" in output
    assert list((Path(fresh_processes["root"]) / "failing").iterdir()) == []


def test_concurrent_builds_share_one_cached_library(fresh_processes):
    for name in ("first", "second", "later"):
        assert "available: True" in fresh_processes[name], fresh_processes[name]
    files = sorted(p.name for p in (Path(fresh_processes["root"]) / "shared").iterdir())
    assert len(files) == 1 and files[0].startswith("tuili_cpu_") and files[0].endswith(".so"), files
    assert "compiled" not in fresh_processes["later"], "a later process loads the cached library"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the variant flags are x86 ones")
def test_variants_are_told_apart_by_their_instruction_set_macros(kernel_isa):
    """What decides whether a variant is rebuilt and rerun (fresh_processes): builds that take
    other code paths have other macros."""
    assert {"__AVX__", "__AVX2__", "__FMA__"} <= kernel_isa("-march=x86-64-v3")
    assert not kernel_isa("-march=x86-64-v2") & {"__AVX2__", "__FMA__", "__AVX512F__"}
    amx = kernel_isa("-march=sapphirerapids")
    assert {"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AMX_TILE__", "__AMX_BF16__"} <= amx
    assert amx - kernel_isa("-march=sapphirerapids -mno-amx-tile -mno-amx-bf16 -mno-amx-int8") == {
        "__AMX_TILE__", "__AMX_BF16__"}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the variant flags are x86 ones")
@pytest.mark.parametrize("flags", list(X86_VARIANTS))
def test_code_paths_of_other_x86_cpus(fresh_processes, flags, monkeypatch, kernel_isa):
    if flags not in fresh_processes:
        pytest.skip(f"these flags compile this CPU's own code paths ({' '.join(sorted(kernel_isa(flags)))}), "
                    "which the suite runs natively")
    output = fresh_processes[flags]
    assert fresh_processes[f"{flags} status"] == "0" and " passed" in output, output[-3000:]
    monkeypatch.delenv("TUILI_KERNEL_CFLAGS", raising=False)
    native = build.library_path()
    monkeypatch.setenv("TUILI_KERNEL_CFLAGS", flags)
    variant = build.library_path()
    assert variant.is_file() and variant != native  # built for the flags


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the variant flags are x86 ones")
def test_the_avx2_build_gives_the_vnni_builds_bits(fresh_processes):
    """(Its name matches none of X86_VARIANTS' selections: a variant run must not start variants.)
    On AVX2 linear_int4 multiplies int16 codes by x's two int8 parts held as one int16 (VPMADDWD):
    the same exact integer sums of the same parts of x, the same float32 epilogue, so the AVX2
    build's outputs are the VNNI build's bits, int4 and Q8_0, x in float32 and bf16 (the VNNI
    build rounds x sixteen values at a time, the AVX2 one value by value). Compared where this CPU
    has AVX512-VNNI and VBMI (the native build then takes the VNNI path)."""
    if not _has_vnni_and_vbmi():
        pytest.skip("this CPU has no AVX512-VNNI and VBMI: no VNNI build to compare the AVX2 one with")
    native = [line for line in fresh_processes["int4 bits"].splitlines() if line.startswith("bits ")]
    avx2 = [line for line in fresh_processes["int4 bits, AVX2"].splitlines() if line.startswith("bits ")]
    assert len(native) == 24, fresh_processes["int4 bits"][-3000:]
    assert avx2 == native


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_key_splits_give_a_token_the_same_bits_in_any_call(dtype):
    """split_keys (the engine's batch-invariant mode): a token attends with the same bits whether
    it is a row of a whole prompt, of a chunk continuing at any position, or a decode, alone or
    beside other sequences, at any thread count; contexts span several 256-key parts."""
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim, block_size = 600, 4, 2, 64, 16
    blocks = tokens // block_size + 1
    k_cache = torch.randn(blocks + 5, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(blocks + 5, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(blocks + 5, generator=generator)[:blocks].to(torch.int32)
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)

    def attend(pieces: list[tuple[int, int]], threads: int = 2) -> torch.Tensor:
        """Rows of q, as sequences (first position, rows) of the same table, in one call."""
        rows = torch.cat([q[p0 : p0 + n] for p0, n in pieces])
        info, first = [], 0
        for p0, n in pieces:
            info.append([first, n, p0])
            first += n
        out = torch.zeros_like(rows)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernels.paged_attention(rows, k_cache, v_cache, table[None].repeat(len(pieces), 1),
                                    torch.tensor(info, dtype=torch.int32), head_dim**-0.5, out, split_keys=256)
        finally:
            torch.set_num_threads(previous)
        return out

    whole = attend([(0, tokens)])
    chunked = attend([(0, 137), (137, 264), (401, 199)])
    assert torch.equal(chunked, whole)
    decodes = attend([(p, 1) for p in (0, 255, 256, 300, 511, 599)], threads=1)
    assert torch.equal(decodes, whole[[0, 255, 256, 300, 511, 599]])
    assert torch.equal(attend([(599, 1)]), whole[599:])
    # one decode within the first part: one unit per KV head instead of one for all (both threads busy)
    assert torch.equal(attend([(200, 1)]), whole[200:201])
