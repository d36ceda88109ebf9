"""Linear layers whose weights stay quantized (8 or 4 bits plus scales) in memory and in the
matmul, so that a decode step reads a quarter to an eighth of the fp32 weight bytes.

What the stored numbers mean is one dataclass per format (g = k // group_size):

* `Int8Weight`       w[n, k] = scale[n] * q[n, k]                         `--quantization int8`
* `Int4Weight`       w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g]   `--quantization int4`,
                                                                           GGUF Q4_0 and Q4_1
* `Int8GroupWeight`  w[n, k] = scale[n, g] * q[n, k]                      GGUF Q8_0

How they are multiplied is one nn.Module per format, with kernels chosen per call by the
number of rows (see docs/quantization.md for the measurements behind the thresholds):

* "gemv": tuili's native kernel (tuili/kernels, csrc/linear_int4.c) reads the int4 layout below
  as stored, for Int4Linear and Int8GroupLinear on CPUs where the kernels build: 1.4-2.5x
  faster than PyTorch's op from one row to a few dozen. On CPUs with AVX512-VNNI it quantizes
  the input rows to int8 per group, as llama.cpp does.
* "op": PyTorch's CPU weight-only kernels read the packed bytes directly
  (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`). They are the fastest way
  to read weights at one or a few rows (decode), but their cost grows linearly with the rows.
* "tiled": dequantize a tile of output rows (about 1 MiB) into the compute dtype and run an
  ordinary matmul (oneDNN/AMX on CPUs, cuBLAS on GPUs), tile after tile. It pays a fixed
  dequantization cost per call and wins from a few dozen rows on (prefill). It runs on any
  device and shape, so it is also the path wherever the ops are missing or refuse the shape.

Compute dtype. The CPU ops are fast only with bf16 activations (their fp32 paths are scalar
loops, 10-90x slower), so a module built for bf16 stores its scales in bf16 and casts its input
to bf16, whatever the model's dtype; the output comes back in the input's dtype. Rounding the
activations and the scales to bf16 adds about 2^-9 relative error, far below the 4- or 8-bit
weight error. A module built for float32 (the `compute_dtype` argument) never uses the ops and
computes what its stored values mean to float32 rounding; tests use that to check the formats
exactly.

Q8_0 has no torch kernel with a scale per 32 values. It runs exactly on the int4 kernel: with
u = q + 128 = 16h + l (h, l the nibbles of u), w = d*q = 16d*(h - 8) + [d*(l - 8) + 8d], two
int4 group-wise matrices [h-part | l-part] applied to the input twice, [x, x], in one call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tuili.errors import CheckpointError, TuiliError, UnsupportedModelError
from tuili.models.gguf import GGUFCheckpoint, _undo_rope_permutation

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts
DEFAULT_INT4_GROUP_SIZE = 32  # 16 code bytes + bf16 scale and zero = 20 bytes per 32 values, Q4_1's size
PACKED_GGUF_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)

# Most rows for which the "op" kernel beats "tiled" (measured in docs/quantization.md, with the
# native tile dequantizers of tuili/kernels at 2 threads).
INT8_OP_MAX_ROWS = 16
INT4_OP_MAX_ROWS = 24
Q8_0_OP_MAX_ROWS = 12
INT4_GEMV_MAX_ROWS = 32
Q8_0_GEMV_MAX_ROWS = 32
# Most rows for which a packed copy of a vocabulary-sized output matrix (gguf_packed_logits) beats
# the float matrix's GEMV/AMX product: Qwen3's 151936 x 1024 at 2 threads, Q8_0 kernel against
# bf16, 4.9 / 11.6 ms at 4 rows, 8.5 / 10.3 at 8, 15.2 / 10.5 at 16.
PACKED_LOGITS_MAX_ROWS = 8
_GEMV_DTYPES = (torch.float32, torch.bfloat16)  # what kernels.linear_int4 reads and writes
TILE_VALUES = 1 << 19  # weights dequantized at a time: 1 MiB in bf16, resident in L2
INT4_TILE_ROWS = 64  # rows per tile of the packed int4 layout


# -- what the stored numbers mean ------------------------------------------------------------


@dataclass
class Int8Weight:
    """Symmetric 8-bit weight with one scale per output row: w[n, k] = scale[n] * q[n, k]."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float [N]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Stack along the output dimension (q, k, v -> qkv)."""
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class Int4Weight:
    """Asymmetric 4-bit weight, a scale and a zero per group of `group_size` inputs:
    w[n, k] = scale[n, k // group_size] * (q[n, k] - 8) + zero[n, k // group_size].
    (The "- 8" is the CPU int4 kernel's convention: Q4_0 is zero = 0, Q4_1 is zero = m + 8d.)"""

    q: torch.Tensor  # uint8 [N, K], values 0..15, one per byte (packing is the module's business)
    scale: torch.Tensor  # float [N, K // group_size]
    zero: torch.Tensor  # float [N, K // group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        codes = self.q.float().view(n, k // self.group_size, self.group_size) - 8
        return (codes * self.scale.float()[..., None] + self.zero.float()[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack along the output dimension; all parts must share a group size."""
        group_size = _common_group_size(parts)
        return Int4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            group_size,
        )


@dataclass
class Int8GroupWeight:
    """Symmetric 8-bit weight with a scale per group of inputs (GGUF Q8_0: groups of 32):
    w[n, k] = scale[n, k // group_size] * q[n, k]."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float [N, K // group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        grouped = self.q.float().view(n, k // self.group_size, self.group_size)
        return (grouped * self.scale.float()[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int8GroupWeight]) -> Int8GroupWeight:
        """Stack along the output dimension; all parts must share a group size."""
        group_size = _common_group_size(parts)
        return Int8GroupWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), group_size)


QuantizedWeight = Int8Weight | Int4Weight | Int8GroupWeight


def _common_group_size(parts: list[Int4Weight] | list[Int8GroupWeight]) -> int:
    sizes = {p.group_size for p in parts}
    if len(sizes) != 1:
        raise CheckpointError(f"cannot stack weights quantized with different group sizes {sorted(sizes)}")
    return sizes.pop()


# -- quantizers for float checkpoints ---------------------------------------------------------


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Per output row, symmetric: scale = max|w| / 127, q = round(w / scale).

    The scale is rounded to `scale_dtype` (what the kernel will read) before q is chosen, so q is
    the best code for the stored scale: |w - scale*q| <= scale/2 (a row of zeros has scale 0)."""
    return Int8Weight(*_symmetric_int8(weight.detach().float(), scale_dtype))


def quantize_int8_group(
    weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.bfloat16
) -> Int8GroupWeight:
    """Per group of `group_size` inputs, symmetric, as quantize_int8 per row."""
    n, k = weight.shape
    if k % group_size:
        raise TuiliError(f"int8 groups of {group_size} need the input size to be a multiple of it; got [{n}, {k}]")
    q, scale = _symmetric_int8(weight.detach().float().view(n, k // group_size, group_size), scale_dtype)
    return Int8GroupWeight(q.view(n, k), scale, group_size)


def _symmetric_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales along the last dimension of float32 `w`: scale = max|w| / 127 rounded to
    `scale_dtype` first, then q = round(w / scale) in -127..127 (0 where the scale is 0)."""
    scale = (w.abs().amax(dim=-1) / 127).to(scale_dtype).float()
    safe = torch.where(scale > 0, scale, 1.0)
    q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(scale_dtype)


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE, scale_dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """Per group of `group_size` inputs, asymmetric: the group's [min, max] onto codes 0..15.

    scale = (max - min) / 15 and zero = min + 8*scale, both rounded to `scale_dtype` before the
    codes are chosen, so |w - dequantized| <= scale/2 up to that rounding."""
    n, k = weight.shape
    _check_group_size(group_size)
    if k % group_size:
        raise TuiliError(
            f"int4 with group size {group_size} needs the input size to be a multiple of it; "
            f"this weight is [{n}, {k}] ({k} % {group_size} = {k % group_size})"
        )
    w = weight.detach().float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).to(scale_dtype).float()
    zero = (low + 8 * scale).to(scale_dtype).float()
    safe = torch.where(scale > 0, scale, 1.0)
    q = torch.round((w - zero[..., None]) / safe[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(q.view(n, k), scale.to(scale_dtype), zero.to(scale_dtype), group_size)


def _check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise TuiliError(
            f"int4 group size {group_size!r} is not supported: expected one of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )


# -- GGUF blocks, read without dequantizing ---------------------------------------------------


def gguf_weight(raw: bytes | np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> QuantizedWeight:
    """The quantized weight held in a GGUF tensor's raw bytes, in row-major ([out, in]) shape.

    Block layouts (ggml-common.h), 32 values per block, scales float16:
    Q4_0 = d, 16 bytes of nibbles, w = d*(q - 8); Q4_1 = d, m, 16 bytes, w = d*q + m;
    Q8_0 = d, 32 int8, w = d*q. In a nibble block the low nibbles are values 0..15 and the high
    nibbles 16..31. Scales are kept in float32 (exact); modules cast them for their kernel."""
    ggml_type = GGMLQuantizationType(ggml_type)
    blocks = _gguf_blocks(raw, ggml_type, shape)  # [N, K/32, block bytes]
    n, k = blocks.shape[0], shape[1]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, K/32]
    if ggml_type == GGMLQuantizationType.Q8_0:
        return Int8GroupWeight(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d, 32)
    nibbles = blocks[..., 2:] if ggml_type == GGMLQuantizationType.Q4_0 else blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)
    if ggml_type == GGMLQuantizationType.Q4_0:
        return Int4Weight(q, d, torch.zeros_like(d), 32)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return Int4Weight(q, d, m + 8 * d, 32)


def _gguf_blocks(raw: bytes | np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    if ggml_type not in PACKED_GGUF_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor type {ggml_type.name} cannot run packed; packed types: "
            f"{', '.join(t.name for t in PACKED_GGUF_TYPES)} (others are dequantized at load)"
        )
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    data = np.asarray(data).reshape(-1).view(np.uint8)
    n, k = shape if len(shape) == 2 else (0, 0)
    expected = n * (k // block_size) * block_bytes
    if len(shape) != 2 or k % block_size or data.size != expected:
        raise CheckpointError(
            f"a {ggml_type.name} weight of shape {tuple(shape)} needs rows in multiples of {block_size} "
            f"and {expected} bytes; got {data.size} bytes"
        )
    return torch.from_numpy(data.copy()).view(n, k // block_size, block_bytes)  # copy: maps are read-only


def gguf_linear(
    ckpt: GGUFCheckpoint,
    names: list[str],
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedLinear | None:
    """A packed linear from GGUF tensors `names` (Hugging Face names, stacked along the output
    dimension in order, e.g. q, k, v); None when a part's type cannot run packed or the parts'
    formats differ, so that the caller loads that weight dequantized instead."""
    parts = []
    for name in names:
        info = ckpt.tensor_info(name)
        if info.ggml_type not in PACKED_GGUF_TYPES:
            return None
        weight = gguf_weight(ckpt.raw_tensor(name), info.ggml_type, info.shape)
        if info.rope_heads is not None:  # llama.cpp's q/k row order: whole rows, so rows of blocks
            rows = _undo_rope_permutation(torch.arange(info.shape[0]), info.rope_heads)
            weight = _take_rows(weight, rows)
        parts.append(weight)
    if len({type(p) for p in parts}) != 1:
        return None
    return make_linear(type(parts[0]).cat(parts), bias, compute_dtype)


def gguf_packed_logits(ckpt: GGUFCheckpoint, compute_dtype: torch.dtype = torch.bfloat16) -> QuantizedLinear | None:
    """A packed copy of the output matrix (the embedding when tied) for few-row logits, as
    llama.cpp reads its output matrix quantized: the file's own blocks when they are Q8_0, else
    int8 per group of 128 of the dequantized matrix (a Q6_K matrix, say: 8 bits keep the logits
    closer than Q6_K itself). It serves up to PACKED_LOGITS_MAX_ROWS rows. None when the input
    size takes no group of 128 or 32."""
    name = "lm_head.weight" if "lm_head.weight" in ckpt.tensor_names() else "model.embed_tokens.weight"
    info = ckpt.tensor_info(name)
    if info.ggml_type == GGMLQuantizationType.Q8_0:
        return make_linear(gguf_weight(ckpt.raw_tensor(name), info.ggml_type, info.shape), None, compute_dtype)
    group = next((g for g in (128, 32) if info.shape[1] % g == 0), None)
    if len(info.shape) != 2 or group is None:
        return None
    weight = quantize_int8_group(ckpt.load_tensor(name, torch.float32), group, compute_dtype)
    return make_linear(weight, None, compute_dtype)


@dataclass
class PackedLinears:
    """The decoder linears of a GGUF file that run packed, ready to install in the model."""

    modules: dict[str, QuantizedLinear]  # module path (e.g. model.layers.0.self_attn.qkv_proj) -> module
    tensors: set[str]  # the checkpoint tensors they hold (weights and biases): not to be loaded again


def gguf_packed_linears(
    ckpt: GGUFCheckpoint, packed_modules: dict[str, tuple[str, ...]], compute_dtype: torch.dtype = torch.bfloat16
) -> PackedLinears:
    """Every linear inside the decoder layers of `ckpt` (2-D weights under model.layers.*) whose
    parts are all Q4_0/Q4_1/Q8_0, built packed; parts are stacked as `packed_modules` says
    (the model class's {"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}). Other linears, and
    modules with a part missing, are left to the float loader (which reports what is missing)."""
    part_of = {part: (fused, i) for fused, parts in packed_modules.items() for i, part in enumerate(parts)}
    names = set(ckpt.tensor_names())
    groups: dict[str, list[str | None]] = {}
    for name in ckpt.tensor_names():
        if not (name.startswith("model.layers.") and name.endswith(".weight")):
            continue
        if len(ckpt.tensor_info(name).shape) != 2:  # norms
            continue
        prefix, module = name.removesuffix(".weight").rsplit(".", 1)
        fused, index = part_of.get(module, (module, 0))
        slots = groups.setdefault(f"{prefix}.{fused}", [None] * len(packed_modules.get(fused, (module,))))
        slots[index] = name
    packed = PackedLinears({}, set())
    for path, slots in groups.items():
        weights = [n for n in slots if n is not None]
        biases = [n.removesuffix(".weight") + ".bias" for n in weights]
        present = [b in names for b in biases]
        if len(weights) != len(slots) or any(present) != all(present):
            continue
        bias = torch.cat([ckpt.load_tensor(b) for b in biases]) if all(present) else None
        module = gguf_linear(ckpt, weights, bias, compute_dtype)
        if module is not None:
            packed.modules[path] = module
            packed.tensors.update(weights + (biases if bias is not None else []))
    return packed


def _take_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q[rows], weight.scale[rows], weight.zero[rows], weight.group_size)
    if isinstance(weight, Int8GroupWeight):
        return Int8GroupWeight(weight.q[rows], weight.scale[rows], weight.group_size)
    return Int8Weight(weight.q[rows], weight.scale[rows])


# -- the modules ---------------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b for x of any leading shape, W held quantized (see the module docstring).

    Subclasses provide the two kernels on 2-D input in the compute dtype, `dequantize()` and
    `weight_bytes`. The compute dtype is the dtype of the stored scales (one source of truth,
    which nn.Module.to(dtype) keeps consistent)."""

    max_op_rows = 0
    max_gemv_rows = 0  # the native "gemv" kernel: only the int4 layout has one

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._op_fits = False  # whether the shape suits the "op" kernel; set by subclasses

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward reads for the weight: codes, scales and zeros (not the bias)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight the kernels compute with, for references and tests."""
        raise NotImplementedError

    def kernel_for(self, rows: int, device: torch.device) -> str:
        """Which kernel, "gemv", "op" or "tiled", a forward over `rows` rows on `device` runs."""
        if device.type != "cpu" or self.compute_dtype != torch.bfloat16 or rows < 1:
            return "tiled"
        if rows <= self.max_gemv_rows and _native_kernels():
            return "gemv"
        return "op" if self._op_fits and rows <= self.max_op_rows else "tiled"

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T + b in x's dtype, or in `out_dtype` (float32 logits: the gemv kernel then skips
        its rounding to bf16)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, this layer expects {self.in_features}")
        out_dtype = out_dtype or x.dtype
        flat = x.reshape(-1, self.in_features)
        kernel = self.kernel_for(flat.shape[0], flat.device)
        if kernel == "gemv":  # takes float32 or bf16 input and output as they are
            y = self._gemv(flat.contiguous(), out_dtype)
        else:
            rows = flat.to(self.compute_dtype).contiguous()
            y = (self._op(rows) if kernel == "op" else self._tiled(rows)).to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _gemv(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _op(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}"
        )


class Int8Linear(QuantizedLinear):
    """Int8Weight: the "op" kernel is aten._weight_int8pack_mm on the int8 rows as stored; the
    "tiled" kernel casts a tile of rows to the compute dtype (int8 is exact in bf16) and applies
    the per-row scales to the product's columns."""

    max_op_rows = INT8_OP_MAX_ROWS

    def __init__(
        self, weight: Int8Weight, bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16
    ) -> None:
        n, k = weight.q.shape
        super().__init__(k, n, bias)
        self.register_buffer("q", weight.q.contiguous())
        self.register_buffer("scale", weight.scale.to(compute_dtype))
        # The op vectorizes over K without a tail loop: other K crash or read garbage (torch 2.13).
        self._op_fits = k % 32 == 0 and _int8_op_works()

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def weight_bytes(self) -> int:
        return _nbytes(self.q) + _nbytes(self.scale)

    def dequantize(self) -> torch.Tensor:
        return Int8Weight(self.q, self.scale).dequantize()

    def _op(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        step = _tile_rows(self.in_features, 1)
        for start in range(0, self.out_features, step):
            tile = self.q[start : start + step].to(x.dtype)
            torch.matmul(x, tile.t(), out=out[:, start : start + step])
        return out.mul_(self.scale)


class Int4Linear(QuantizedLinear):
    """Int4Weight, packed two codes a byte in the layout of the CPU int4 kernel on AVX-512
    (`aten._convert_weight_to_int4pack_for_cpu`): rows in tiles of 64, each tile [K, 32] bytes
    whose byte [k, j] holds row j's code in the low nibble and row 32 + j's in the high nibble.
    A tile's low nibbles are thus W^T's first 32 columns and its high nibbles the next 32, so the
    "tiled" kernel unpacks with a mask and a shift. Scales and zeros are stored as the op
    reads them, [K / group, N, 2]. Rows are padded to a multiple of 64 with zero weights.

    The "op" kernel is used only where the op computes this layout correctly (checked once per
    process, `_int4_op_works`): on CPUs without AVX-512 its packing differs and "tiled" runs."""

    max_op_rows = INT4_OP_MAX_ROWS
    max_gemv_rows = INT4_GEMV_MAX_ROWS
    _input_copies = 1  # how many times the input is repeated along K (Int8GroupLinear: 2)

    def __init__(
        self, weight: Int4Weight, bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16
    ) -> None:
        n, k = weight.q.shape
        super().__init__(k // self._input_copies, n, bias)
        self.group_size = weight.group_size
        packed, scale_zero = _int4_operands(weight, compute_dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self._op_fits = self.group_size in INT4_GROUP_SIZES and _int4_op_works()

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scale_zero.dtype

    @property
    def weight_bytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scale_zero)

    def dequantize(self) -> torch.Tensor:
        return self._int4_weight().dequantize()[: self.out_features]

    def _int4_weight(self) -> Int4Weight:
        """The stored weight unpacked (padding rows included)."""
        tiles, k, _ = self.packed.shape
        codes = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=1)  # [tile, half, K, 32]
        q = codes.permute(0, 1, 3, 2).reshape(tiles * INT4_TILE_ROWS, k)
        scale, zero = self.scale_zero.transpose(0, 1).unbind(-1)
        return Int4Weight(q, scale, zero, self.group_size)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._input_copies == 1 else x.repeat(1, self._input_copies)

    def _gemv(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The native kernel takes and writes float32 or bf16; other dtypes (float16) convert."""
        from tuili.kernels import linear_int4

        if x.dtype not in _GEMV_DTYPES:
            x = x.to(self.compute_dtype)
        direct = out_dtype in _GEMV_DTYPES
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype if direct else torch.float32)
        linear_int4(x, self.packed, self.scale_zero, out, self._input_copies)
        return out if direct else out.to(out_dtype)

    def _op(self, x: torch.Tensor) -> torch.Tensor:
        tiles, k, _ = self.packed.shape
        packed = self.packed.view(tiles * INT4_TILE_ROWS, k // 2)  # the op's [N, K/2] view
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(self._repeat(x), packed, self.group_size, self.scale_zero)
        return y[:, : self.out_features]

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        if _native(x):
            from tuili.kernels import dequantize_int4_tiles

            return self._native_tiled(self._repeat(x), dequantize_int4_tiles)
        x = self._repeat(x)
        tiles, k, _ = self.packed.shape
        groups = k // self.group_size
        out = x.new_empty(x.shape[0], tiles * INT4_TILE_ROWS)
        step = _tile_rows(k, INT4_TILE_ROWS) // INT4_TILE_ROWS  # packed tiles per matmul
        for first in range(0, tiles, step):
            packed = self.packed[first : first + step].transpose(0, 1)  # [K, tiles, 32]
            cols = slice(first * INT4_TILE_ROWS, (first + packed.shape[1]) * INT4_TILE_ROWS)
            # W^T for these columns, [K, tiles, half, 32] viewed as [groups, group, columns].
            # Integer work before the cast: int8 ops run ~10x faster than bf16 ones here.
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(torch.int8).sub_(8)
            codes = codes.view(groups, self.group_size, -1).to(x.dtype)
            # Contiguous copies: addcmul is ~5x slower on the interleaved [.., N, 2] views.
            scale, zero = (t.contiguous()[:, None] for t in self.scale_zero[:, cols].unbind(-1))
            w_t = torch.addcmul(zero, codes, scale).view(k, -1)
            torch.matmul(x, w_t, out=out[:, cols])
        return out[:, : self.out_features]

    def _native_tiled(
        self, x: torch.Tensor, dequantize: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The tiled kernel with tuili's C dequantizer (tuili/kernels) writing each tile's W^T
        into one reused buffer: about 0.1 ns per weight against ~1 ns for the torch ops."""
        tiles, k = self.packed.shape[0], x.shape[1]
        out = x.new_empty(x.shape[0], tiles * INT4_TILE_ROWS)
        step = _tile_rows(k, INT4_TILE_ROWS) // INT4_TILE_ROWS
        buffer = x.new_empty(k * min(step, tiles) * INT4_TILE_ROWS)
        for first in range(0, tiles, step):
            columns = min(step, tiles - first) * INT4_TILE_ROWS
            w_t = dequantize(self.packed, self.scale_zero, first, buffer[: k * columns].view(k, columns))
            torch.matmul(x, w_t, out=out[:, first * INT4_TILE_ROWS : first * INT4_TILE_ROWS + columns])
        return out[:, : self.out_features]


class Int8GroupLinear(Int4Linear):
    """Int8GroupWeight (GGUF Q8_0) computed exactly on the int4 kernel: u = q + 128 = 16h + l
    with nibbles h, l, so w = [16s*(h - 8) + 0] + [s*(l - 8) + 8s]: an int4 weight [N, 2K] whose
    first K columns hold h and last K hold l, applied to [x, x] (the op and the tiled kernel; the
    native gemv reads both halves at once as q = 16h + l - 128). It reads 1.25 bytes per value
    in bf16 (Q8_0 itself: 1.06)."""

    max_op_rows = Q8_0_OP_MAX_ROWS
    max_gemv_rows = Q8_0_GEMV_MAX_ROWS
    _input_copies = 2

    def __init__(
        self,
        weight: Int8GroupWeight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        u = (weight.q.to(torch.int16) + 128).to(torch.uint8)
        scale = weight.scale.float()
        split = Int4Weight(
            q=torch.cat([u >> 4, u & 0x0F], dim=1),
            scale=torch.cat([16 * scale, scale], dim=1),
            zero=torch.cat([torch.zeros_like(scale), 8 * scale], dim=1),
            group_size=weight.group_size,
        )
        super().__init__(split, bias, compute_dtype)

    def dequantize(self) -> torch.Tensor:
        both = super().dequantize()
        return both[:, : self.in_features] + both[:, self.in_features :]

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        if _native(x):
            from tuili.kernels import dequantize_int8_group_tiles

            return self._native_tiled(x, dequantize_int8_group_tiles)
        # Rebuild q from the two halves' nibbles in integer arithmetic and scale it once:
        # w = s*q with s the low half's scale (the high half's is exactly 16s, its zero 0).
        k = self.in_features
        tiles = self.packed.shape[0]
        groups = k // self.group_size
        out = x.new_empty(x.shape[0], tiles * INT4_TILE_ROWS)
        step = _tile_rows(k, INT4_TILE_ROWS) // INT4_TILE_ROWS
        for first in range(0, tiles, step):
            packed = self.packed[first : first + step].transpose(0, 1)  # [2K, tiles, 32]
            cols = slice(first * INT4_TILE_ROWS, (first + packed.shape[1]) * INT4_TILE_ROWS)
            high, low = packed[:k], packed[k:]
            u = torch.stack([((high & 0x0F) << 4) | (low & 0x0F), (high & 0xF0) | (low >> 4)], dim=2)
            q = (u ^ 0x80).view(torch.int8)  # u - 128
            scale = self.scale_zero[groups:, cols, 0].contiguous()[:, None]
            w_t = (q.view(groups, self.group_size, -1).to(x.dtype) * scale).view(k, -1)
            torch.matmul(x, w_t, out=out[:, cols])
        return out[:, : self.out_features]


def make_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16
) -> QuantizedLinear:
    """The module that runs `weight`."""
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, bias, compute_dtype)
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias, compute_dtype)
    return Int8GroupLinear(weight, bias, compute_dtype)


def _int4_operands(weight: Int4Weight, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Linear's buffers: codes packed [N / 64, K, 32] and scale_zero [K / group, N, 2],
    rows padded to a multiple of 64 with zero weights (code 0, scale 0, zero 0)."""
    padding = (0, 0, 0, -weight.q.shape[0] % INT4_TILE_ROWS)
    q, scale, zero = (F.pad(t, padding) for t in (weight.q, weight.scale, weight.zero))
    n, k = q.shape
    tiles = q.to(torch.uint8).view(n // INT4_TILE_ROWS, 2, INT4_TILE_ROWS // 2, k)
    packed = (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2).contiguous()
    scale_zero = torch.stack([scale.to(compute_dtype), zero.to(compute_dtype)], dim=-1)
    return packed, scale_zero.transpose(0, 1).contiguous()


def _native(x: torch.Tensor) -> bool:
    """Whether tuili's C dequantizers serve this call (a CPU tensor, and the kernels built)."""
    return x.device.type == "cpu" and _native_kernels()


def _native_kernels() -> bool:
    from tuili import kernels

    return kernels.available()


def _tile_rows(k: int, multiple: int) -> int:
    """Weight rows per dequantized tile: about TILE_VALUES values, a multiple of `multiple`."""
    return max(multiple, TILE_VALUES // k // multiple * multiple)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.cache
def _int8_op_works() -> bool:
    """Whether aten._weight_int8pack_mm exists here and computes x @ (scale * q)^T."""
    generator = torch.Generator().manual_seed(0)
    weight = quantize_int8(torch.randn(48, 64, generator=generator))
    x = torch.randn(3, 64, generator=generator).bfloat16()
    return _op_agrees(lambda: torch.ops.aten._weight_int8pack_mm(x, weight.q, weight.scale), x, weight)


@functools.cache
def _int4_op_works() -> bool:
    """Whether aten._weight_int4pack_mm_for_cpu exists here and reads Int4Linear's packing."""
    generator = torch.Generator().manual_seed(0)
    weight = quantize_int4(torch.randn(128, 64, generator=generator), 32)
    packed, scale_zero = _int4_operands(weight, torch.bfloat16)
    x = torch.randn(3, 64, generator=generator).bfloat16()
    return _op_agrees(
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.view(128, 32), 32, scale_zero), x, weight
    )


def _op_agrees(run: Callable[[], torch.Tensor], x: torch.Tensor, weight: QuantizedWeight) -> bool:
    try:
        got = run().double()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    w = weight.dequantize().double()
    error = (got - x.double() @ w.t()).abs()
    return bool((error <= 2**-6 * (x.double().abs() @ w.abs().t())).all())


# -- whole models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizationReport:
    method: str
    linears: int  # nn.Linear modules replaced
    packed_bytes: int  # their weights as stored now: codes, scales and zeros
    original_bytes: int  # the same weights before, at the checkpoint's working dtype


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    compute_dtype: torch.dtype | None = None,
) -> QuantizationReport:
    """Replace every nn.Linear of `model` by its quantized module, in place.

    method "int8": per-row symmetric int8. "int4": group-wise int4 with scale and zero; an
    untied `lm_head` gets int8 instead, as llama.cpp keeps its output matrix at 6 or 8 bits
    (the logits are the most sensitive projection, and int8 still halves its bytes in bf16).
    A tied lm_head is the embedding matrix, not an nn.Linear; the loader gives it an int8 copy.
    compute_dtype: None = bf16 on CPUs (where the fast kernels are), else the dtype of
    the weights. Every linear is checked before any is replaced, so an error changes nothing."""
    check_quantization_method(method)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if method == "int4":
        _check_group_size(group_size)
        _check_int4_shapes([(n, m) for n, m in linears if not _is_output(n)], group_size)
    packed = original = 0
    for name, linear in linears:
        dtype = compute_dtype
        if dtype is None:
            dtype = torch.bfloat16 if linear.weight.device.type == "cpu" else linear.weight.dtype
        if method == "int4" and not _is_output(name):
            weight: QuantizedWeight = quantize_int4(linear.weight, group_size, dtype)
        else:
            weight = quantize_int8(linear.weight, dtype)
        module = make_linear(weight, linear.bias, dtype).to(linear.weight.device)
        _set_submodule(model, name, module)
        packed += module.weight_bytes
        original += _nbytes(linear.weight)
    return QuantizationReport(method, len(linears), packed, original)


def check_quantization_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise TuiliError(
            f"quantization {method!r} is not supported: expected one of {', '.join(QUANTIZATION_METHODS)}"
        )


def _is_output(name: str) -> bool:
    return name.split(".")[-1] == "lm_head"


def _check_int4_shapes(linears: list[tuple[str, nn.Linear]], group_size: int) -> None:
    bad = [(name, m.in_features) for name, m in linears if m.in_features % group_size]
    if not bad:
        return
    name, k = bad[0]
    fits = [g for g in INT4_GROUP_SIZES if all(m.in_features % g == 0 for _, m in linears)]
    hint = f"group sizes that fit every layer: {', '.join(map(str, fits))}" if fits else (
        "no supported group size divides every input size; use int8"
    )
    raise TuiliError(
        f"int4 with group size {group_size} needs every linear's input size to be a multiple of "
        f"{group_size}, but {name}.weight has {k} inputs ({k} % {group_size} = {k % group_size}"
        f"{f', and {len(bad) - 1} more layers' if len(bad) > 1 else ''}); {hint}"
    )


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
