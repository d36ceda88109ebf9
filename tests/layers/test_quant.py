"""Quantized linears (tuili/layers/quant.py) against references nobody here wrote: the `gguf`
package's quantizer and dequantizer, the embedded SmolLM2 GGUF, the float model.

Tolerances are bounds on sums of products, |y - ref| <= c * (|x| @ |W|^T): in float32 the packed
kernels must agree to float32 rounding (c = 1e-5); in bf16 (activations and scales rounded to
8 significant bits, fp32 accumulation) to c = 2^-6, which any layout or scale mix-up exceeds by
orders of magnitude.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from torch import nn

from tests.models.test_gguf_dequant import random_blocks
from tuili import LLM, SamplingParams, kernels
from tuili.errors import CheckpointError, TuiliError, UnsupportedModelError
from tuili.layers.linear import Linear
from tuili.layers.quant import (
    INT4_GEMV_MAX_ROWS,
    INT4_OP_MAX_ROWS,
    Int4Linear,
    Int4Weight,
    Int8GroupLinear,
    Int8GroupWeight,
    Int8Linear,
    QuantizedLinear,
    StackedLinear,
    int6_fits,
    make_linear,
    quantize_int4,
    quantize_int8,
    quantize_int8_group,
    stack_parts,
)
from tuili.models.default_model import default_model_path
from tuili.models.gguf import open_gguf
from tuili.models.gguf import quantized_weight as gguf_weight
from tuili.models.llama import LlamaForCausalLM
from tuili.models.weights import WeightPlan, check_int4_shapes
from tuili.perf.meter import UtilizationMeter
from tuili.platform import Platform

CPU = torch.device("cpu")
BF16_BOUND = 2**-6
FP32_BOUND = 1e-5
# The CPU weight-only ops read our int4 packing only with AVX-512 (see Int4Linear).
# Kernels picked by row count, so that every kernel is exercised; the batch-invariant mode (the
# engine's default), which keeps one kernel at every row count, is tested on its own below.
HERE = Platform.detect(batch_invariant=False)
INVARIANT = Platform.detect()
OPS_EXPECTED = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, bound: float) -> None:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    ref = x64 @ w64.T + (0 if bias is None else bias.double())
    limit = bound * (x64.abs() @ w64.abs().T) + 1e-30
    error = (y.double().reshape(ref.shape) - ref).abs()
    assert (error <= limit).all(), f"worst error / bound = {(error / limit).max().item():.3g}"


def run_both_kernels(module: QuantizedLinear, k: int, bias, w: torch.Tensor, bound: float) -> None:
    """Rows for the few-row kernels (1, 3: "gemv" where the native kernels run and the module has
    one, else "op") and for "tiled" (200), and a 3-D input."""
    generator = torch.Generator().manual_seed(1)
    for shape in [(1, k), (3, k), (200, k), (2, 5, k)]:
        x = torch.randn(*shape, generator=generator)
        y = module(x)
        assert y.shape == (*shape[:-1], w.shape[0]) and y.dtype == x.dtype
        assert_linear_close(y, x, w, bias, bound)


# -- GGUF blocks against the gguf package's own dequantization --------------------------------


@pytest.fixture(params=["native", "torch"])
def dequantizer(request) -> Platform:
    """Both tiled dequantizers: tuili's C kernels (where they build, as here) and the torch ops."""
    return Platform.portable() if request.param == "torch" else HERE


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_synthetic_gguf_blocks_compute_the_gguf_dequantization(ggml_type, compute_dtype, dequantizer):
    # 96 rows: not a multiple of the 64-row packing tile, so padding is exercised too.
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 128)) * rng.uniform(0.01, 2, (96, 1))).astype(np.float32)
    w[3, :32] = 0.5  # a constant block
    raw = gguf.quants.quantize(w, ggml_type)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type).copy())
    bias = torch.randn(96)
    module = make_linear(gguf_weight(raw, ggml_type, (96, 128)), bias, compute_dtype, platform=dequantizer)
    expected_class = Int8GroupLinear if ggml_type == Q.Q8_0 else Int4Linear
    assert type(module) is expected_class
    assert module.in_features == 128 and module.out_features == 96
    if compute_dtype == torch.float32:
        torch.testing.assert_close(module.dequantize(), reference, rtol=1e-6, atol=1e-7)
    run_both_kernels(module, 128, bias, reference, FP32_BOUND if compute_dtype == torch.float32 else BF16_BOUND)


@pytest.mark.parametrize("ggml_type", [Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q5_1, Q.Q5_K, Q.Q3_K, Q.Q2_K])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_random_k_quant_and_5_bit_blocks_run_packed_as_their_codes(ggml_type, compute_dtype, dequantizer):
    # gguf.quants cannot quantize the K types, so every bit pattern of random blocks (finite
    # scales) is taken as the file and gguf.quants' dequantization is the reference.
    raw = random_blocks(ggml_type, 128, 512, np.random.default_rng(int(ggml_type)))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type).copy())
    weight = gguf_weight(raw, ggml_type, (128, 512))
    expected = {Q.Q5_0: (Int8GroupWeight, 32), Q.Q4_K: (Int4Weight, 32), Q.Q6_K: (Int8GroupWeight, 16),
                Q.Q5_1: (Int8GroupWeight, 32), Q.Q5_K: (Int8GroupWeight, 32), Q.Q3_K: (Int8GroupWeight, 16),
                Q.Q2_K: (Int8GroupWeight, 16)}[ggml_type]  # fmt: skip
    assert (type(weight), weight.group_size) == expected
    # Q4_K's zero (8 step - offset) and scale cancel to float32 rounding of the block's size.
    atol = 1e-6 * reference.abs().max().item()
    torch.testing.assert_close(weight.dequantize(), reference, rtol=1e-6, atol=atol)
    bias = torch.randn(128)
    if ggml_type in (Q.Q5_1, Q.Q5_K, Q.Q2_K) and not int6_fits(weight, compute_dtype, dequantizer):
        # codes with zeros run only as 6-bit codes (VNNI builds, bf16); the loader reads them as floats elsewhere
        with pytest.raises(ValueError, match="run only as 6-bit codes"):
            make_linear(weight, bias, compute_dtype, platform=dequantizer)
        return
    module = make_linear(weight, bias, compute_dtype, platform=dequantizer)
    if compute_dtype == torch.float32:
        torch.testing.assert_close(module.dequantize(), reference, rtol=1e-6, atol=atol)
    run_both_kernels(module, 512, bias, reference, FP32_BOUND if compute_dtype == torch.float32 else BF16_BOUND)


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.Q5_K])
def test_rows_read_from_the_tiles_are_the_dequantized_rows(ggml_type):
    # A token lookup from a packed table (PackedEmbedding) reads single rows out of the tiles:
    # rows in both nibble halves and every 16-row group of the 6-bit planes, the last real row
    # of a padded tile, repeats, any index shape.
    raw = random_blocks(ggml_type, 150, 256, np.random.default_rng(int(ggml_type)))
    weight = gguf_weight(raw, ggml_type, (150, 256))
    if ggml_type == Q.Q5_K and not int6_fits(weight, torch.bfloat16, HERE):
        return  # codes with zeros run packed only as 6-bit codes (VNNI builds): read as floats elsewhere
    module = make_linear(weight, None, torch.bfloat16, platform=HERE)
    ids = torch.tensor([[0, 15, 16, 31, 32, 47], [48, 63, 64, 149, 3, 3]])
    rows = module.rows(ids)
    assert rows.shape == (2, 6, 256) and rows.dtype == torch.float32
    # The stored codes times the scales (and zeros) the module holds: rounded once to bf16.
    held = dataclasses.replace(weight, scale=weight.scale.to(torch.bfloat16),
                               zero=None if weight.zero is None else weight.zero.to(torch.bfloat16))  # fmt: skip
    assert torch.equal(rows, held.dequantize()[ids])
    assert torch.equal(module.dequantize(), held.dequantize())
    assert module.rows(torch.zeros(0, dtype=torch.int64)).shape == (0, 256)
    with pytest.raises(IndexError, match="150 rows"):
        module.rows(torch.tensor([150]))


def test_parts_of_different_gguf_types_run_as_one_linear_each_as_stored():
    # A Q4_K_M file's fused q, k, v: q and k in Q4_K, v in Q6_K (and a Q5_0 part, as some files
    # hold): runs of one format stack, and one module runs them side by side.
    rng = np.random.default_rng(3)
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q5_0)
    files = [random_blocks(t, 64 + 32 * (i == 2), 256, rng, 1e-3) for i, t in enumerate(types)]
    parts = [gguf_weight(raw, t, (raw.shape[0], 256)) for raw, t in zip(files, types, strict=True)]
    reference = torch.cat([torch.from_numpy(gguf.quants.dequantize(raw, t).copy()) for raw, t in zip(files, types, strict=True)])
    runs = stack_parts(parts)
    assert [(type(r), r.group_size, r.q.shape[0]) for r in runs] == [
        (Int4Weight, 32, 128), (Int8GroupWeight, 16, 96), (Int8GroupWeight, 32, 64)
    ]
    assert torch.equal(runs[0].q, torch.cat([parts[0].q, parts[1].q]))
    for platform in (HERE, INVARIANT, Platform.portable()):
        linears = [make_linear(r, None, torch.bfloat16, platform=platform) for r in runs]
        bias = torch.randn(288)
        module = StackedLinear(linears, bias, platform=platform)
        assert module.in_features == 256 and module.out_features == 288
        assert module.weight_bytes == sum(m.weight_bytes for m in linears)
        # the scales and Q4_K's zeros rounded to bf16 once: 2^-9 of their size
        torch.testing.assert_close(module.dequantize(), reference, rtol=2**-8, atol=2**-8 * reference.abs().max().item())
        run_both_kernels(module, 256, bias, module.dequantize(), BF16_BOUND)
    with pytest.raises(ValueError, match="share their input size"):
        StackedLinear([linears[0], make_linear(quantize_int4(torch.randn(64, 64), 32), platform=HERE)], None, platform=HERE)


@pytest.mark.parametrize(
    "qtype, native, portable",
    [(Q.Q4_0, "int4", "int4+zeros"), (Q.Q4_1, "int4+zeros", "int4+zeros"), (Q.Q4_K, "int4+zeros", "int4+zeros"),
     (Q.Q8_0, "int8", "int8"), (Q.Q6_K, "int6", None), (Q.Q5_0, "int6", None), (Q.Q5_K, "int6+zeros", None)],
)
def test_each_gguf_type_runs_in_the_packed_format_its_blocks_have(qtype, native, portable):
    """What the kernel reads of each GGUF type (the ruler times each format apart): Q4_0's blocks
    have a scale alone, Q4_1's and Q4_K's a minimum too (a zero), Q8_0's int8 codes a scale; Q6_K's
    and Q5_0's codes fit 6 bits, Q5_K's with its minimums, where tuili's kernels read 6-bit codes.
    The portable path (PyTorch's int4 op) reads (scale, zero) pairs always; it has no 6-bit form."""
    raw = random_blocks(qtype, 64, 256, np.random.default_rng(0), 1e-3)
    weight = gguf_weight(raw, qtype, (64, 256))
    if HERE.native_kernels and (native[:4] != "int6" or kernels.linear_int6_available()):
        assert make_linear(weight, None, torch.bfloat16, platform=HERE).kernel_format == native
    if portable is not None:
        assert make_linear(weight, None, torch.bfloat16, platform=Platform.portable()).kernel_format == portable


def test_kernel_choice_follows_rows_device_and_dtype():
    by_rows = dataclasses.replace(HERE, bf16_arithmetic=True)  # where PyTorch's bf16 products are fast
    module = make_linear(quantize_int4(torch.randn(64, 64), 32), platform=by_rows)
    assert module.kernel_for(200, CPU) == "tiled"
    run_both_kernels(module, 64, None, module.dequantize(), BF16_BOUND)
    assert module.kernel_for(1, torch.device("cuda")) == "tiled"  # the CUDA op packs differently
    assert make_linear(quantize_int4(torch.randn(64, 64), 32), None, torch.float32, platform=HERE).kernel_for(1, CPU) == "tiled"
    if by_rows.native_kernels:
        assert module.kernel_for(1, CPU) == "gemv" and module.kernel_for(INT4_GEMV_MAX_ROWS, CPU) == "gemv"
        assert module.kernel_for(INT4_GEMV_MAX_ROWS + 1, CPU) == ("op" if INT4_GEMV_MAX_ROWS < INT4_OP_MAX_ROWS else "tiled")
    if OPS_EXPECTED:
        assert make_linear(quantize_int8(torch.randn(64, 64)), platform=HERE).kernel_for(1, CPU) == "op"  # no int8 gemv
        portable = make_linear(quantize_int4(torch.randn(64, 64), 32), platform=Platform.portable())
        assert portable.kernel_for(1, CPU) == "op"
        run_both_kernels(portable, 64, None, portable.dequantize(), BF16_BOUND)
    # K not a multiple of 32 would crash the int8 op: the tiled kernel must serve it.
    odd = make_linear(quantize_int8(torch.randn(5, 33)), platform=HERE)
    assert odd.kernel_for(1, CPU) == "tiled"
    run_both_kernels(odd, 33, None, odd.dequantize(), BF16_BOUND)


def test_without_bf16_arithmetic_quantized_products_stay_native_at_every_row_count():
    """PyTorch's bf16 products (the op, the tiled matmul) on a CPU without AVX512-BF16 or AMX run
    at a fraction of its fp32 ones (a Zen 3: 20 against 150 GFLOP/s): the native gemv takes every
    row count there, batch invariant or not."""
    if not HERE.native_kernels:
        pytest.skip("tuili's native kernels do not run here")
    without = dataclasses.replace(HERE, amx=False, panel_linear=False, bf16_arithmetic=False)
    module = make_linear(quantize_int4(torch.randn(64, 64), 32), platform=without)
    assert [module.kernel_for(rows, CPU) for rows in (1, INT4_GEMV_MAX_ROWS + 1, 200)] == ["gemv"] * 3
    run_both_kernels(module, 64, None, module.dequantize(), BF16_BOUND)


@pytest.mark.parametrize("kind", ["int4", "int8", "q8_0"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_batch_invariant_rows_are_their_own(kind, out_dtype):
    """In the batch-invariant mode one kernel serves every row count and a row's bits do not
    depend on the other rows: the native gemv (int4, Q8_0) in blocks of LINEAR_INT4_MAX_ROWS rows,
    written into one output, the int8 op."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=generator)
    weight = {"int4": lambda: quantize_int4(w, 32), "int8": lambda: quantize_int8(w),
              "q8_0": lambda: quantize_int8_group(w, 32)}[kind]()
    module = make_linear(weight, torch.randn(96, generator=generator), platform=INVARIANT)
    if module.kernel_for(200, CPU) == "tiled":
        pytest.skip("neither the native gemv nor the int8 op runs here: the tiled matmul is batch dependent")
    assert module.kernel_for(1, CPU) == module.kernel_for(200, CPU)
    most = kernels.LINEAR_INT4_MAX_ROWS
    x = torch.randn(most + 44, 128, generator=generator).bfloat16()
    alone = torch.cat([module(x[i : i + 1], out_dtype) for i in range(most + 44)])
    for rows in (2, 5, 17, 64, 65, most, most + 1, most + 44):
        assert torch.equal(module(x[:rows], out_dtype), alone[:rows]), rows
    assert_linear_close(alone, x, module.dequantize(), module.bias, BF16_BOUND)


@pytest.fixture(scope="module")
def smollm2():
    return open_gguf(default_model_path())


def smollm2_plan(ckpt, compute_dtype: torch.dtype = torch.bfloat16) -> WeightPlan:
    """The loader's weight plan for the embedded GGUF run packed (its linears as stored)."""
    tensors = {name: (lambda n=name: ckpt.load_tensor(n)) for name in ckpt.tensor_names()}
    return WeightPlan(HERE, compute_dtype, tensors, LlamaForCausalLM.stacked_projections, "smollm2",
                      quantized_dtype=compute_dtype, gguf_packed=ckpt)


def test_smollm2_tensors_packed_equal_gguf_dequantization(smollm2):
    # v_proj (Q4_1, rows as stored) and the first 256 rows of the Q8_0 token embeddings.
    name = "model.layers.0.self_attn.v_proj.weight"
    info = smollm2.tensor_info(name)
    assert info.ggml_type == Q.Q4_1 and info.rope_heads is None
    raw = smollm2.raw_tensor(name)
    reference = torch.from_numpy(gguf.quants.dequantize(raw.reshape(info.shape[0], -1), Q.Q4_1).copy())
    for dtype, bound in [(torch.float32, FP32_BOUND), (torch.bfloat16, BF16_BOUND)]:
        run_both_kernels(make_linear(gguf_weight(raw, Q.Q4_1, info.shape), None, dtype, platform=HERE), info.shape[1], None,
                         reference, bound)

    embed = smollm2.tensor_info("model.embed_tokens.weight")
    assert embed.ggml_type == Q.Q8_0
    rows = smollm2.raw_tensor("model.embed_tokens.weight").reshape(embed.shape[0], -1)[:256]
    reference = torch.from_numpy(gguf.quants.dequantize(rows, Q.Q8_0).copy())
    for dtype, bound in [(torch.float32, FP32_BOUND), (torch.bfloat16, BF16_BOUND)]:
        module = make_linear(gguf_weight(rows, Q.Q8_0, (256, embed.shape[1])), None, dtype, platform=HERE)
        run_both_kernels(module, embed.shape[1], None, reference, bound)


def test_smollm2_qkv_stacks_parts_and_undoes_llama_cpp_row_order(smollm2):
    names = [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    assert smollm2.tensor_info(names[0]).rope_heads is not None
    module = smollm2_plan(smollm2, torch.float32).linear("model.layers.3.self_attn.qkv_proj", 576, 960, bias=False)
    expected = torch.cat([smollm2.load_tensor(n) for n in names])  # the float loader's tensors
    assert module.dequantize().shape == expected.shape == (960, 576)
    torch.testing.assert_close(module.dequantize(), expected, rtol=1e-6, atol=1e-7)


def test_smollm2_every_decoder_linear_runs_packed(smollm2):
    plan = smollm2_plan(smollm2)
    cfg = smollm2.config
    layers, hidden, inter = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    shapes = {"self_attn.qkv_proj": (hidden, 576 + 2 * 192), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_up_proj": (hidden, 2 * inter), "mlp.down_proj": (inter, hidden)}
    modules = {f"model.layers.{i}.{name}": plan.linear(f"model.layers.{i}.{name}", k, n, bias=False)
               for i in range(layers) for name, (k, n) in shapes.items()}
    assert all(isinstance(m, QuantizedLinear) for m in modules.values())
    tensors = [n for n in smollm2.tensor_names() if n.startswith("model.layers.") and n.endswith("proj.weight")]
    assert len(tensors) == 7 * layers  # q, k, v, o, gate, up, down weights
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.in_features, qkv.out_features) == (576, 576 + 2 * 192)
    assert modules["model.layers.29.mlp.gate_up_proj"].out_features == 2 * inter
    # 4-bit codes plus a bf16 scale and zero per 32 values: 5 bits per weight, like Q4_1 itself.
    weights = sum(smollm2.tensor_info(n).shape[0] * smollm2.tensor_info(n).shape[1] for n in tensors)
    assert sum(m.weight_bytes for m in modules.values()) == weights * 5 // 8


# -- quantizers: round-trip error bounds ---------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step(scale_dtype):
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0
    q = quantize_int8(w, scale_dtype)
    assert q.q.dtype == torch.int8 and q.scale.dtype == scale_dtype
    scale = q.scale.float()
    row_max = w.abs().amax(dim=1)
    # the scale is max|w| / 127, rounded to its dtype
    assert torch.allclose(scale, row_max / 127, rtol=2**-8 if scale_dtype == torch.bfloat16 else 1e-6)
    dequantized = q.q.float() * scale[:, None]  # the format's meaning, written out here
    assert ((w - dequantized).abs() <= 0.5 * scale[:, None] * (1 + 1e-5)).all()
    assert (dequantized[5] == 0).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_is_within_half_a_step(group_size, scale_dtype):
    w = torch.randn(32, 256) * 0.05 + torch.randn(32, 1) * 0.02  # groups off-centre: zero points matter
    w[2, :group_size] = 0.25  # a constant group
    q = quantize_int4(w, group_size, scale_dtype)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15 and q.scale.shape == (32, 256 // group_size)
    scale = q.scale.float().repeat_interleave(group_size, dim=1)
    zero = q.zero.float().repeat_interleave(group_size, dim=1)
    dequantized = scale * (q.q.float() - 8) + zero
    slack = 2**-8 * (zero.abs() + 15 * scale) if scale_dtype == torch.bfloat16 else 1e-6 * (zero.abs() + scale)
    assert ((w - dequantized).abs() <= 0.5 * scale + slack).all()
    assert dequantized[2, :group_size].eq(zero[2, 0]).all() and scale[2, 0] == 0
    # and the step is what a 4-bit grid over the group's range gives
    groups = w.view(32, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert torch.allclose(q.scale.float(), step, rtol=2**-8 if scale_dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_modules_compute_what_their_stored_values_mean(kind, dequantizer):
    torch.manual_seed(0)
    w, bias = torch.randn(200, 256), torch.randn(200)
    for dtype, bound in [(torch.float32, FP32_BOUND), (torch.bfloat16, BF16_BOUND)]:
        if kind == "int8":
            q = quantize_int8(w, dtype)
            meaning = q.q.float() * q.scale.float()[:, None]
        else:
            q = quantize_int4(w, 64, dtype)
            expand = lambda t: t.float().repeat_interleave(64, dim=1)  # noqa: E731
            meaning = expand(q.scale) * (q.q.float() - 8) + expand(q.zero)
        module = make_linear(q, bias, dtype, platform=dequantizer)
        assert type(module) is (Int8Linear if kind == "int8" else Int4Linear)
        torch.testing.assert_close(module.dequantize(), meaning, rtol=0, atol=0)
        run_both_kernels(module, 256, bias, meaning, bound)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_few_row_kernels_take_any_float_input_and_output_dtype(dtype):
    # A model in float16 on a CPU (or float32) with bf16 packed linears: every module returns the
    # input's dtype, or float32 when asked (logits), whatever kernel the rows pick.
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    modules = [make_linear(quantize_int4(w, 32), platform=HERE), make_linear(quantize_int8(w), platform=HERE),
               make_linear(Int8GroupWeight(quantize_int8(w).q, torch.rand(96, 2) / 50, 32), platform=HERE)]
    for module in modules:
        for rows in (1, 3, 40):
            x = torch.randn(rows, 64).to(dtype)
            y = module(x)
            assert y.dtype == dtype and y.shape == (rows, 96)
            assert_linear_close(y.float(), x.float(), module.dequantize(), None, max(BF16_BOUND, 2**-5))
            assert module(x, out_dtype=torch.float32).dtype == torch.float32


def test_cat_stacks_along_the_output_dimension():
    torch.manual_seed(0)
    parts = [torch.randn(n, 64) for n in (64, 32, 32)]
    for quantize in (quantize_int8, lambda t: quantize_int4(t, 32)):
        weights = [quantize(p) for p in parts]
        stacked = make_linear(type(weights[0]).cat(weights), None, torch.float32, platform=HERE)
        singles = [make_linear(w, None, torch.float32, platform=HERE) for w in weights]
        x = torch.randn(4, 64)
        torch.testing.assert_close(stacked(x), torch.cat([m(x) for m in singles], dim=-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(CheckpointError, match="different group sizes"):
        Int4Weight.cat([quantize_int4(parts[0], 32), quantize_int4(parts[1], 64)])


# -- whole models --------------------------------------------------------------------------------

TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
)
PROMPTS = [[5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13], [42], list(range(30, 53))]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random Qwen2-style checkpoint (q/k/v biases, tied embeddings), written by transformers."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn_like(param))
    path = tmp_path_factory.mktemp("ckpt") / "qwen2"
    model.save_pretrained(path)
    return path


def tiny_llm(path) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_logits(tiny_checkpoint, method, prompt_logits):
    baseline = tiny_llm(tiny_checkpoint)
    float_logits = prompt_logits(baseline, PROMPTS)

    # Exact path (float32 compute): the quantized model equals a float model whose linears hold
    # the dequantized weights, i.e. the packed kernels compute what the stored values mean.
    # The output head's int8 copy of the tied embedding becomes the reference's own head matrix.
    exact = LLM(model=str(tiny_checkpoint), dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20,
                quantization=method)
    quantized = {n: m for n, m in exact.engine.runner.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 4 * TINY["num_hidden_layers"] + 1 and "lm_head.projection" in quantized
    assert {m.compute_dtype for m in quantized.values()} == {torch.float32}
    reference = tiny_llm(tiny_checkpoint)
    float_linears = dict(reference.engine.runner.model.named_modules())
    for name, module in quantized.items():
        with torch.no_grad():
            if name == "lm_head.projection":
                float_linears["lm_head"].projection = Linear.holding(module.dequantize(), None, HERE)
            else:
                float_linears[name].weight.copy_(module.dequantize())
    exact_logits = prompt_logits(exact, PROMPTS)
    torch.testing.assert_close(exact_logits, prompt_logits(reference, PROMPTS), rtol=1e-4, atol=1e-4)

    # Fast path, as `LLM(quantization=...)` loads it (bf16 compute on CPUs): every linear packed,
    # the tied embedding given an int8 copy for the logits; close to the float model.
    fast = LLM(model=str(tiny_checkpoint), device="cpu", block_size=4, kv_cache_memory=1 << 20, quantization=method)
    model = fast.engine.runner.model
    assert fast.engine.weights_quantized == method
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    head = model.lm_head.projection
    # int8 per group (of 64, the largest of 128, 64, 32 dividing hidden_size): the native kernel's
    # format, which a decode graph replays with the rest of the step
    assert type(head) is Int8GroupLinear and head.compute_dtype == torch.bfloat16 and head.group_size == 64
    layers = [m for m in model.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * TINY["num_hidden_layers"]
    packed = sum(m.weight_bytes for m in layers)
    original = sum(4 * m.in_features * m.out_features for m in layers)  # the fp32 checkpoint
    # From fp32: int8 is a quarter plus, per group of a row, a bf16 scale (2 bytes per 64 values
    # here, per 128 for down_proj's 128 inputs; where PyTorch's op runs instead of tuili's
    # kernels, a bf16 scale and zero for each of the two nibble halves it reads: 8 bytes); int4 at
    # group 32 is 4 bits plus a bf16 scale and zero per 32 values, 5 bits per weight (every row
    # count here is a multiple of 64).
    if method == "int8":
        groups = {m.in_features: m.group_size for m in layers}
        assert groups == {64: 64, 128: 128}
        per_group = 2 if head.platform.native_kernels else 8
        assert packed == sum(m.in_features * m.out_features * (m.group_size + per_group) // m.group_size for m in layers)
        assert original / 4 < packed < original / 4 * (1.04 if head.platform.native_kernels else 1.125)
    else:
        assert packed == original * 5 // 32
    # The engine's byte count: every packed buffer, the float norms and embedding; a decode step
    # reads all but the embedding, whose logits now come from the int8 copy.
    embedding = model.model.embed_tokens.weight
    read = fast.engine.runner.decode_weight_bytes()
    assert read == fast.engine.runner.weight_bytes() - embedding.nbytes
    meter = UtilizationMeter.for_engine(fast.engine, "h100")
    assert meter.step_decode_bytes([5, 9]) == read + 14 * meter.kv_bytes_per_token  # what live MBU counts
    # Loose bounds for random Gaussian weights (int4's step is ~0.3 sigma of a group): measured
    # mean error / logit spread 0.009 (int8) and 0.13 (int4); a wrong layout or scale gives ~1.
    fast_logits = prompt_logits(fast, PROMPTS)
    error = (fast_logits - float_logits).abs() / float_logits.std()
    agree = (fast_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    if method == "int8":
        assert error.mean() < 0.02 and error.max() < 0.1 and agree >= 0.9, (error.mean(), error.max(), agree)
    else:
        assert error.mean() < 0.25 and agree >= 0.5, (error.mean(), agree)


def random_tensors(shapes: dict[str, tuple[int, ...]]) -> dict:
    """A weight plan's tensor source holding random tensors of these shapes."""
    tensors = {name: torch.randn(*shape) for name, shape in shapes.items()}
    return {name: (lambda t=t: t) for name, t in tensors.items()}


def test_untied_lm_head_is_kept_at_int8():
    torch.manual_seed(0)
    tensors = random_tensors({"proj.weight": (64, 64), "proj.bias": (64,), "lm_head.weight": (320, 64),
                              "odd.weight": (320, 48)})
    plan = WeightPlan(HERE, torch.float32, tensors, {}, "test", quantization="int4")
    assert type(plan.linear("proj", 64, 64, bias=True)) is Int4Linear
    head = plan.linear("lm_head", 64, 320, bias=False)
    assert type(head) is Int8GroupLinear and head.group_size == 64  # int8 per group: the native kernel's
    torch.testing.assert_close(head.dequantize(), tensors["lm_head.weight"](), rtol=0, atol=head.dequantize().abs().max().item() / 127)
    # An input size that takes no group of 32 is quantized per row (torch's int8 op).
    int8 = WeightPlan(HERE, torch.float32, tensors, {}, "test", quantization="int8")
    assert type(int8.linear("odd", 48, 320, bias=False)) is Int8Linear


def test_smollm2_packed_gguf_matches_the_dequantized_model(smollm2, prompt_logits):
    """On a CPU the loader keeps the GGUF's Q4_1/Q8_0 linears packed (bf16 compute) unless
    float32 is asked for: the packed model agrees with the dequantized float32 one, and with
    float32 compute the packed modules give the float model's logits exactly."""
    llm = LLM(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory=16 << 20)
    assert llm.engine.weights_quantized is None
    assert not any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())
    tokenizer = llm.engine.tokenizer
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(conversation)
    float_logits = prompt_logits(llm, [prompt])

    # A prompt's rows run the tiled kernel when kernels are picked by row count, the gemv with
    # exact (float32) sums of the activations in the batch-invariant mode (the default).
    for batch_invariant in (False, True):
        packed = LLM(device="cpu", max_model_len=256, kv_cache_memory=16 << 20, batch_invariant=batch_invariant)
        model = packed.engine.runner.model
        assert packed.engine.weights_quantized == "gguf"
        assert not any(isinstance(m, nn.Linear) for m in model.model.layers.modules())
        assert {m.compute_dtype for m in model.modules() if isinstance(m, QuantizedLinear)} == {torch.bfloat16}
        packed_logits = prompt_logits(packed, [prompt])
        error = (packed_logits - float_logits).abs() / float_logits.std()
        agree = (packed_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
        assert error.mean() < 0.1 and agree >= 0.9, (batch_invariant, error.mean(), agree)
        out = packed.chat([conversation], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert "Paris" in out.outputs[0].text

    float_model, plan = llm.engine.runner.model, smollm2_plan(smollm2, torch.float32)
    for path, module in list(float_model.model.layers.named_modules(prefix="model.layers")):
        if isinstance(module, nn.Linear):
            float_model.set_submodule(path, plan.linear(path, module.in_features, module.out_features, bias=False))
    exact = (prompt_logits(llm, [prompt]) - float_logits).abs() / float_logits.std()
    assert exact.max() < 1e-3, exact.max()  # the same weights: float32 rounding only


# -- bad input -------------------------------------------------------------------------------------


def test_engine_refuses_an_unknown_quantization_by_name():
    with pytest.raises(TuiliError, match="'fp8' is not supported: expected one of int8, int4"):
        LLM(model=None, quantization="fp8")


def test_unknown_method_lists_the_supported_ones():
    with pytest.raises(TuiliError, match=r"quantization 'fp8' is not supported: expected one of int8, int4"):
        WeightPlan(HERE, torch.float32, {}, {}, "test", quantization="fp8")


def test_int4_on_an_indivisible_input_size_names_the_tensor_and_sizes():
    # The plan checks every linear of the checkpoint before it builds any.
    tensors = random_tensors({"model.layers.0.up.weight": (96, 64), "model.layers.0.down.weight": (64, 96)})
    with pytest.raises(TuiliError) as info:
        WeightPlan(HERE, torch.float32, tensors, {}, "test", quantization="int4", group_size=64)
    message = str(info.value)
    assert "down.weight has 96 inputs (96 % 64 = 32)" in message and "group sizes that fit every layer: 32" in message
    with pytest.raises(TuiliError, match="group size 48 is not supported: expected one of 32, 64, 128, 256"):
        check_int4_shapes([("up", 64)], 48)
    with pytest.raises(TuiliError, match=r"this weight is \[8, 40\] \(40 % 32 = 8\)"):
        quantize_int4(torch.randn(8, 40), 32)


def test_unsupported_gguf_type_names_it_and_the_packed_ones():
    raw = np.zeros(4 * 136, dtype=np.uint8)  # four rows of one 256-value IQ4_XS block
    with pytest.raises(UnsupportedModelError, match="IQ4_XS cannot run packed; packed types: Q4_0, .*, Q3_K, Q2_K"):
        gguf_weight(raw, Q.IQ4_XS, (4, 256))


def test_gguf_bytes_that_do_not_fit_the_shape_are_refused():
    raw = gguf.quants.quantize(np.ones((4, 64), dtype=np.float32), Q.Q4_0)
    with pytest.raises(CheckpointError, match=r"Q4_0 weight of shape \(4, 96\) needs .* 216 bytes; got 144"):
        gguf_weight(raw, Q.Q4_0, (4, 96))
    with pytest.raises(CheckpointError, match="rows in multiples of 32"):
        gguf_weight(raw, Q.Q4_0, (8, 16))
