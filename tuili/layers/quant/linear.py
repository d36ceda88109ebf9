"""Linear layers whose weights stay quantized (8 or 4 bits plus scales) in memory and in the
matmul, so that a decode step reads a quarter to an eighth of the fp32 weight bytes.

What the stored numbers mean is tuili/layers/quant/formats.py. How they are multiplied is one
nn.Module per format (this file), with kernels chosen per call by the number of rows among those
the platform has (the thresholds are measured crossovers: docs/kernels.md, "Measured crossovers
and thresholds"):

* "gemv": tuili's native kernel (tuili/kernels, csrc/linear_int4.c) reads the int4 layout below
  as stored, for Int4Linear and Int8GroupLinear where the platform has the native kernels:
  faster than PyTorch's op from one row to a few dozen. On CPUs with AVX512-VNNI it writes the
  input rows per group as two int8 parts and runs integer dot products.
* "op": PyTorch's CPU weight-only kernels read the packed bytes directly
  (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`). They are the fastest way
  to read weights at one or a few rows (decode), but their cost grows linearly with the rows.
* "tiled": dequantize a tile of output rows (about 1 MiB) into the compute dtype and run an
  ordinary matmul (oneDNN/AMX on CPUs, cuBLAS on GPUs), tile after tile. It pays a fixed
  dequantization cost per call and wins from a few dozen rows on (prefill). It runs on any
  device and shape, so it is also the path wherever the ops are missing or refuse the shape.

Batch invariance (`Platform.batch_invariant`, the default). The three kernels round differently,
and the tiled one's matmul also by row count, so a row's bits would depend on its step's rows.
In that mode every row count takes one kernel whose result for a row depends on that row alone:
the "gemv" (Int4Linear, Int8GroupLinear: blocks of up to `kernels.LINEAR_INT4_MAX_ROWS` rows, its
arithmetic per row independent of the block; on AVX512-VNNI CPUs integer dot products over two
int8 parts of each row's input, as close to the input as its bf16 rounding: csrc/linear_int4.c),
else the "op" (Int8Linear: blocks of up to
`max_op_rows`, each row reduced alone). Where neither runs (float32 compute, no native kernels,
a GPU) "tiled" runs: on a CPU on blocks of one fixed shape (`fixed_shape_blocks`: invariant, at the
price of dequantizing the weight once per 16 rows), on a GPU as it is (not invariant).

Compute dtype. The CPU ops are fast only with bf16 activations (their fp32 paths are scalar
loops), so a module built for bf16 stores its scales in bf16 and casts its input
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

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels
from tuili.layers.linear import fixed_shape_blocks
from tuili.layers.quant.formats import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8GroupWeight,
    Int8Weight,
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
)
from tuili.platform import INT4_TILE_ROWS, Platform

# Most rows for which each kernel is the fastest (measured crossovers: docs/kernels.md).
INT8_OP_MAX_ROWS = 16
INT4_OP_MAX_ROWS = 24
Q8_0_OP_MAX_ROWS = 12
INT4_GEMV_MAX_ROWS = 32
Q8_0_GEMV_MAX_ROWS = 32
_GEMV_DTYPES = (torch.float32, torch.bfloat16)  # what kernels.linear_int4 reads and writes
TILE_VALUES = 1 << 19  # weights dequantized at a time: 1 MiB in bf16, resident in L2
# What linear_int4 reads of a packed module (PackedLinear.kernel_format): the codes' width, and
# "+zeros" where each group's scale comes with a zero. Each runs at a rate of its own (on an AVX2
# Zen 3 a Q8_0 value takes about 1.5 times a Q4_0 one at one row), which `tuili probe` measures
# per format.
KERNEL_FORMATS = ("int4", "int4+zeros", "int8", "int6", "int6+zeros")


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b for x of any leading shape, W held quantized (see the module docstring).

    Subclasses provide the two kernels on 2-D input in the compute dtype, `dequantize()` and
    `weight_bytes`. The compute dtype is the dtype of the stored scales (one source of truth,
    which nn.Module.to(dtype) keeps consistent)."""

    max_op_rows = 0
    max_gemv_rows = 0  # the native "gemv" kernel: only the int4 layout has one

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, platform: Platform) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.platform = platform
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._op_fits = False  # whether the shape suits the "op" kernel; set by subclasses

    def _native(self, x: torch.Tensor) -> bool:
        """Whether tuili's C dequantizers serve this call (a CPU tensor, native kernels here)."""
        return x.device.type == "cpu" and self.platform.native_kernels

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
        invariant = self.platform.batch_invariant  # one kernel at every row count
        # Without bf16 arithmetic PyTorch's bf16 products (the op, the tiled matmul) run at a
        # fraction of the native kernel's speed: ~20 GFLOP/s on a Zen 3, where its fp32 runs ~150.
        takes_gemv = invariant or rows <= self.max_gemv_rows or not self.platform.bf16_arithmetic
        if takes_gemv and self.max_gemv_rows and self.platform.native_kernels:
            return "gemv"
        return "op" if self._op_fits and (invariant or rows <= self.max_op_rows) else "tiled"

    def _block_rows(self, kernel: str, rows: int) -> int:
        """Rows per call of `kernel`: the gemv's most (it takes no more), the tiled kernel all of
        them, the op all of them except in the batch-invariant mode, where it runs blocks of the
        size it was measured and checked at."""
        if kernel == "gemv":
            return kernels.LINEAR_INT4_MAX_ROWS
        if not self.platform.batch_invariant or kernel == "tiled":
            return max(rows, 1)
        return self.max_op_rows

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T + b in x's dtype, or in `out_dtype` (float32 logits: the gemv kernel then skips
        its rounding to bf16)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, this layer expects {self.in_features}")
        out_dtype = out_dtype or x.dtype
        flat = x.reshape(-1, self.in_features)
        kernel = self.kernel_for(flat.shape[0], flat.device)
        starts = range(0, max(flat.shape[0], 1), self._block_rows(kernel, flat.shape[0]))
        if kernel == "gemv":  # takes float32 or bf16 input and output as they are, blocks written in place
            flat = (flat if flat.dtype in _GEMV_DTYPES else flat.to(self.compute_dtype)).contiguous()
            direct = out_dtype in _GEMV_DTYPES
            y = torch.empty(flat.shape[0], self.out_features, dtype=out_dtype if direct else torch.float32)
            for i in starts:
                self._gemv(flat[i : i + starts.step], y[i : i + starts.step])
            parts = [y if direct else y.to(out_dtype)]
        elif kernel == "tiled" and self.platform.batch_invariant and flat.is_cpu and flat.shape[0]:
            parts = [fixed_shape_blocks(flat.to(self.compute_dtype), self._tiled).to(out_dtype)]
        else:
            rows = flat.to(self.compute_dtype).contiguous()
            run = self._op if kernel == "op" else self._tiled
            parts = [run(rows[i : i + starts.step]).to(out_dtype) for i in starts]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _gemv(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Writes x @ W^T into out (rows of the forward's output), both float32 or bfloat16."""
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
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        *,
        platform: Platform,
    ) -> None:
        n, k = weight.q.shape
        super().__init__(k, n, bias, platform)
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


class PackedLinear(QuantizedLinear):
    """A module whose codes linear_int4 reads: `packed` and its scales, held alone (`scale`) or
    as (scale, zero) pairs (`scale_zero`); the compute dtype is theirs."""

    code_bits = 4  # the width of a code as linear_int4 reads it

    @property
    def kernel_scales(self) -> torch.Tensor:
        """The scales the native kernels read with `packed`: scale_zero, or `scale` where the
        module holds the scales alone (Int8GroupLinear: always)."""
        return self._buffers["scale_zero"] if "scale_zero" in self._buffers else self.scale

    @property
    def kernel_format(self) -> str:
        """Which of KERNEL_FORMATS the native kernel reads: (scale, zero) pairs are [K / group, N, 2]."""
        return f"int{self.code_bits}{'+zeros' if self.kernel_scales.dim() == 3 else ''}"

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.kernel_scales.dtype

    @property
    def weight_bytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.kernel_scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the weight, float32 [*ids.shape, K]: dequantize()'s
        rows, read from the tiles without unpacking the rest (a token lookup from a packed table)."""
        flat = ids.reshape(-1)
        if flat.numel():
            smallest, largest = (int(v) for v in torch.aminmax(flat))
            if smallest < 0 or largest >= self.out_features:
                raise IndexError(f"rows {smallest}..{largest} of a weight of {self.out_features} rows")
        return self._row_weight(flat).dequantize().view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=self.packed.device))

    def _row_weight(self, ids: torch.Tensor) -> QuantizedWeight:
        """Rows `ids` (int64 [R], valid) of the stored weight, in its format."""
        raise NotImplementedError

    def _row_scales(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scales [R, K / group] of rows `ids`, and their zeros where the module holds pairs."""
        if "scale_zero" in self._buffers:
            scale, zero = self.scale_zero[:, ids].unbind(-1)
            return scale.t(), zero.t()
        return self.scale[:, ids].t(), None


class Int4Linear(PackedLinear):
    """Int4Weight, packed two codes a byte in the layout of the CPU int4 kernel on AVX-512
    (`aten._convert_weight_to_int4pack_for_cpu`): rows in tiles of 64, each tile [K, 32] bytes
    whose byte [k, j] holds row j's code in the low nibble and row 32 + j's in the high nibble.
    A tile's low nibbles are thus W^T's first 32 columns and its high nibbles the next 32, so the
    "tiled" kernel unpacks with a mask and a shift. Scales and zeros are stored as the op
    reads them, [K / group, N, 2]. Rows are padded to a multiple of 64 with zero weights. Where
    tuili's kernels run (they take every row count before the op) and every zero is 0 (GGUF Q4_0,
    whose blocks have only a scale), the module holds the scales alone, `scale` [K / group, N]:
    0.5625 bytes per value in bf16, Q4_0's own size, instead of 0.625.

    The "op" kernel is used only where the op computes this layout correctly (checked once per
    process, `_int4_op_works`): on CPUs without AVX-512 its packing differs and "tiled" runs."""

    max_op_rows = INT4_OP_MAX_ROWS
    max_gemv_rows = INT4_GEMV_MAX_ROWS
    _input_copies = 1  # how many times the input is repeated along K (Int8GroupLinear: 2)

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        *,
        platform: Platform,
        keep_zeros: bool = False,
    ) -> None:
        """keep_zeros: hold (scale, zero) pairs even where every zero is 0 (experts stacked with
        others that have zeros share their buffers' layout)."""
        n, k = weight.q.shape
        super().__init__(k // self._input_copies, n, bias, platform)
        self.group_size = weight.group_size
        packed, scale_zero = _int4_operands(weight, compute_dtype)
        self.register_buffer("packed", packed)
        self._op_fits = self.group_size in INT4_GROUP_SIZES and _int4_op_works()
        self._hold_scales(scale_zero, platform, keep_zeros)

    def _hold_scales(self, scale_zero: torch.Tensor, platform: Platform, keep_zeros: bool) -> None:
        """Registers the scales as the kernels that will run read them: the (scale, zero) pairs, or
        the scales alone where tuili's kernels run and every zero is 0 (then the op never runs)."""
        if platform.native_kernels and not keep_zeros and not scale_zero[..., 1].any():
            self._op_fits = False
            self.register_buffer("scale", scale_zero[..., 0].contiguous())
        else:
            self.register_buffer("scale_zero", scale_zero)

    def _scale_and_zero(self, columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and zeros [K / group, columns] of output rows `columns` (contiguous copies)."""
        if "scale_zero" in self._buffers:
            scale, zero = (t.contiguous() for t in self.scale_zero[:, columns].unbind(-1))
            return scale, zero
        scale = self.scale[:, columns].contiguous()
        return scale, torch.zeros_like(scale)

    def _row_weight(self, ids: torch.Tensor) -> QuantizedWeight:
        scale, zero = self._row_scales(ids)
        return Int4Weight(_row_nibbles(self.packed, ids), scale, torch.zeros_like(scale) if zero is None else zero,
                          self.group_size)  # fmt: skip

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._input_copies == 1 else x.repeat(1, self._input_copies)

    def _gemv(self, x: torch.Tensor, out: torch.Tensor) -> None:
        kernels.linear_int4(x, self.packed, self.kernel_scales, out, self._input_copies)

    def _op(self, x: torch.Tensor) -> torch.Tensor:
        tiles, k, _ = self.packed.shape
        packed = self.packed.view(tiles * INT4_TILE_ROWS, k // 2)  # the op's [N, K/2] view
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(self._repeat(x), packed, self.group_size, self.scale_zero)
        return y[:, : self.out_features]

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return self._native_tiled(self._repeat(x), kernels.dequantize_int4_tiles)
        x = self._repeat(x)
        tiles, k, _ = self.packed.shape
        groups = k // self.group_size
        out = x.new_empty(x.shape[0], tiles * INT4_TILE_ROWS)
        step = _tile_rows(k, INT4_TILE_ROWS) // INT4_TILE_ROWS  # packed tiles per matmul
        for first in range(0, tiles, step):
            packed = self.packed[first : first + step].transpose(0, 1)  # [K, tiles, 32]
            cols = slice(first * INT4_TILE_ROWS, (first + packed.shape[1]) * INT4_TILE_ROWS)
            # W^T for these columns, [K, tiles, half, 32] viewed as [groups, group, columns].
            # Integer work before the cast: int8 ops are much cheaper than bf16 ones (docs/kernels.md, Measured crossovers).
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(torch.int8).sub_(8)
            codes = codes.view(groups, self.group_size, -1).to(x.dtype)
            # Contiguous copies: addcmul is much slower on the interleaved [.., N, 2] views.
            scale, zero = (t[:, None] for t in self._scale_and_zero(cols))
            w_t = torch.addcmul(zero, codes, scale).view(k, -1)
            torch.matmul(x, w_t, out=out[:, cols])
        return out[:, : self.out_features]

    def _native_tiled(
        self, x: torch.Tensor, dequantize: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The tiled kernel with tuili's C dequantizer (tuili/kernels) writing each tile's W^T
        into one reused buffer, one pass instead of the torch ops (docs/kernels.md, Measured crossovers)."""
        tiles, k = self.packed.shape[0], x.shape[1]
        out = x.new_empty(x.shape[0], tiles * INT4_TILE_ROWS)
        step = _tile_rows(k, INT4_TILE_ROWS) // INT4_TILE_ROWS
        buffer = x.new_empty(k * min(step, tiles) * INT4_TILE_ROWS)
        for first in range(0, tiles, step):
            columns = min(step, tiles - first) * INT4_TILE_ROWS
            w_t = dequantize(self.packed, self.kernel_scales, first, buffer[: k * columns].view(k, columns))
            torch.matmul(x, w_t, out=out[:, first * INT4_TILE_ROWS : first * INT4_TILE_ROWS + columns])
        return out[:, : self.out_features]


class Int8GroupLinear(Int4Linear):
    """Int8GroupWeight (GGUF Q8_0) in the int4 kernel's tiles: u = q + 128 = 16h + l with nibbles
    h, l, packed as an int4 weight [N, 2K] whose first K columns hold h and last K hold l, and its
    scales alone, `scale` [K / group, N] in the compute dtype: 1.0625 bytes per value in bf16,
    Q8_0's own size. The native kernels read both halves at once as q = 16h + l - 128 and
    w = s * q. PyTorch's int4 op computes it exactly as w = [16s*(h - 8) + 0] + [s*(l - 8) + 8s],
    applied to [x, x]: that view's (scale, zero) pairs, `scale_zero` [2K / group, N, 2] (another
    0.25 bytes per value), are kept only where the op runs (CPUs without tuili's kernels)."""

    max_op_rows = Q8_0_OP_MAX_ROWS
    max_gemv_rows = Q8_0_GEMV_MAX_ROWS
    _input_copies = 2
    code_bits = 8

    def __init__(
        self,
        weight: Int8GroupWeight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        *,
        platform: Platform,
    ) -> None:
        u = (weight.q.to(torch.int16) + 128).to(torch.uint8)
        scale = weight.scale.float()
        split = Int4Weight(
            q=torch.cat([u >> 4, u & 0x0F], dim=1),
            scale=torch.cat([16 * scale, scale], dim=1),
            zero=torch.cat([torch.zeros_like(scale), 8 * scale], dim=1),
            group_size=weight.group_size,
        )
        super().__init__(split, bias, compute_dtype, platform=platform)

    def _hold_scales(self, scale_zero: torch.Tensor, platform: Platform, keep_zeros: bool) -> None:
        """Registers the l half's scales, the kernels' form of a Q8_0 weight (a scale per block and
        no zero, so `keep_zeros` has nothing to keep), and the two halves' pairs as well where
        PyTorch's op runs."""
        groups = scale_zero.shape[0] // 2
        self.register_buffer("scale", scale_zero[groups:, :, 0].contiguous())  # the l half's: s
        # The op runs only without the native kernels (which take every row count before it).
        self._op_fits = self._op_fits and not platform.native_kernels
        if self._op_fits:
            self.register_buffer("scale_zero", scale_zero)

    @property
    def weight_bytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scale_zero if self._op_fits else self.scale)  # the op's, at decode

    @property
    def kernel_scales(self) -> torch.Tensor:
        return self.scale

    def _row_weight(self, ids: torch.Tensor) -> QuantizedWeight:
        codes = _row_nibbles(self.packed, ids).to(torch.int16)  # [R, 2K]: h then l
        q = ((codes[:, : self.in_features] << 4 | codes[:, self.in_features :]) - 128).to(torch.int8)
        return Int8GroupWeight(q, self.scale[:, ids].t(), self.group_size)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return self._native_tiled(x, kernels.dequantize_int8_group_tiles)
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
            scale = self.scale[:, cols].contiguous()[:, None]
            w_t = (q.view(groups, self.group_size, -1).to(x.dtype) * scale).view(k, -1)
            torch.matmul(x, w_t, out=out[:, cols])
        return out[:, : self.out_features]


class Int6GroupLinear(PackedLinear):
    """An Int8GroupWeight whose codes all lie in -32..31 (GGUF Q6_K and Q5_0 are such), held at
    6 bits where linear_int4 reads them (`int6_fits`): u = q + 32 = 16h + l, the nibbles l in
    Int4Linear's tiles and, after each tile's K rows of them, the 2-bit h as K / 4 planes of 64
    bytes in the VNNI kernel's order (csrc/linear_int4.c, unpack_quad): packed [N / 64, 3K / 2,
    32], and the scales alone, `scale` [K / group, N] bf16, or (scale, zero) pairs `scale_zero`
    [K / group, N, 2] for a weight with zeros (GGUF Q5_1, Q5_K; w = scale * q + zero). 0.875 bytes
    per value at Q6_K's groups of 16 (its own 0.82), 0.8125 at Q5_0's 32 (0.69), 0.875 with
    Q5_K's zeros (0.69), against 1.125 and 1.0625 as an Int8GroupLinear (which has no zeros).
    The gemv takes every row count (no other kernel reads the planes)."""

    max_gemv_rows = 1 << 62
    code_bits = 6

    def __init__(self, weight: Int8GroupWeight, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, *, platform: Platform) -> None:  # fmt: skip
        n, k = weight.q.shape
        super().__init__(k, n, bias, platform)
        self.group_size = weight.group_size
        rows = -n % INT4_TILE_ROWS  # padding rows: code 0 and scale 0, so weight 0
        u = F.pad((weight.q + 32).view(torch.uint8), (0, 0, 0, rows))  # 0..63: no int8 overflow
        tiles = u.shape[0] // INT4_TILE_ROWS
        nibbles = _pack_nibbles(u & 0x0F)  # [tiles, K, 32], Int4Linear's
        high = (u >> 4).view(tiles, 4, 16, k // 4, 4)  # [tile, row group, row, quad, k in quad]
        planes = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)  # [tile, row, quad, k]
        planes = planes.permute(0, 2, 1, 3)  # byte 4 row + k of quad q at 64 q
        packed = torch.cat([nibbles.reshape(tiles, -1), planes.reshape(tiles, -1)], dim=1)
        self.register_buffer("packed", packed.view(tiles, 3 * k // 2, INT4_TILE_ROWS // 2))
        scale = F.pad(weight.scale.to(compute_dtype), (0, 0, 0, rows)).t()
        if weight.zero is None:
            self.register_buffer("scale", scale.contiguous())
        else:
            zero = F.pad(weight.zero.to(compute_dtype), (0, 0, 0, rows)).t()
            self.register_buffer("scale_zero", torch.stack([scale, zero], dim=-1).contiguous())

    def _row_weight(self, ids: torch.Tensor) -> QuantizedWeight:
        tiles, k = self.packed.shape[0], self.in_features
        low = _row_nibbles(self.packed[:, :k], ids)
        # Row r of a tile sits in bits 2 (r // 16) .. +1 of byte 4 (r % 16) + i of each quad's 64.
        planes = self.packed.view(tiles, -1)[:, k * INT4_TILE_ROWS // 2 :].view(tiles, k // 4, 16, 4)
        lane = ids % INT4_TILE_ROWS
        high = planes[ids // INT4_TILE_ROWS, :, lane % 16] >> (2 * (lane // 16)).to(torch.uint8).view(-1, 1, 1) & 3
        q = (high.reshape(-1, k) << 4 | low).view(torch.int8) - 32
        scale, zero = self._row_scales(ids)
        return Int8GroupWeight(q, scale, self.group_size, zero)

    def _gemv(self, x: torch.Tensor, out: torch.Tensor) -> None:
        kernels.linear_int4(x, self.packed, self.kernel_scales, out, 3)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        # Off the CPU's gemv only (another device, or a compute dtype the kernel does not take).
        return x @ self.dequantize().to(x.dtype).t()


class PackedEmbedding(nn.Module):
    """A token lookup from a table held packed, at a GGUF file's size instead of as floats: row r
    is dequantized from the tiles on lookup (`PackedLinear.rows`), the codes times the scales,
    rounded once to `dtype`. Either a tied table whose output head reads it packed (the head's copy
    of the file's own Q8_0 or Q6_K codes, which the head owns: Qwen3.5's 248,320 x 1024 table
    would be 0.5 GB in bf16 beside the 0.22 GB copy), or an untied table as the file stores it,
    which this module owns (`owner`)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype, *, owner: bool) -> None:
        super().__init__()
        if not isinstance(table, PackedLinear):
            raise TypeError(f"a packed table is an Int4Linear, Int8GroupLinear or Int6GroupLinear, not {type(table).__name__}")
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.out_dtype = dtype
        if owner:
            self.table = table
        else:
            # Not registered: the output head owns the copy (one name for every byte count and
            # the state dict); this module only reads it.
            self.__dict__["table"] = table

    @property
    def weight(self) -> torch.Tensor:
        """The packed codes, for what asks a table its storage (not its shape or dtype)."""
        return self.table.packed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the output head's packed copy"


def int6_fits(weight: QuantizedWeight, compute_dtype: torch.dtype, platform: Platform) -> bool:
    """Whether `weight` runs as an Int6GroupLinear on `platform`: int8 codes per group, all in
    -32..31, computing in bf16 on a CPU whose kernels read 6-bit codes. A weight with zeros runs
    only so (Int8GroupLinear has none)."""
    return (
        isinstance(weight, Int8GroupWeight)
        and compute_dtype == torch.bfloat16
        and platform.native_kernels
        and platform.device.type == "cpu"
        and kernels.linear_int6_available()
        and weight.q.shape[1] % 4 == 0
        and bool(weight.q.numel())
        and _codes_within(weight.q, -32, 31)
    )


def _codes_within(q: torch.Tensor, low: int, high: int) -> bool:
    smallest, largest = torch.aminmax(q)
    return int(smallest) >= low and int(largest) <= high


class StackedLinear(QuantizedLinear):
    """Quantized linears of one input run as one, their outputs side by side in order: a fused
    projection whose parts a GGUF file stores in different types (`stack_parts`: a Q4_K_M file's
    [q k] in Q4_K as an Int4Linear, v in Q6_K as an Int6GroupLinear), each held as stored. The
    gemv writes each part's columns of one output in place (linear_int4 takes output rows further
    apart than a part's width), so a CPU graph replays the parts' kernel calls and nothing else;
    the other kernels concatenate the parts' products. The bias is the whole output's."""

    def __init__(self, parts: list[QuantizedLinear], bias: torch.Tensor | None, *, platform: Platform) -> None:
        inputs = {p.in_features for p in parts}
        if len(inputs) != 1 or {p.compute_dtype for p in parts} != {parts[0].compute_dtype}:
            raise ValueError(f"stacked linears must share their input size and compute dtype; got {parts}")
        super().__init__(inputs.pop(), sum(p.out_features for p in parts), bias, platform)
        self.parts = nn.ModuleList(parts)
        self.max_gemv_rows = min(p.max_gemv_rows for p in parts)
        self.max_op_rows = min(p.max_op_rows for p in parts)
        self._op_fits = all(p._op_fits for p in parts)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.parts[0].compute_dtype

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def _gemv(self, x: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for part in self.parts:
            part._gemv(x, out[:, start : start + part.out_features])
            start += part.out_features

    def _op(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p._op(x) for p in self.parts], dim=1)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p._tiled(x) for p in self.parts], dim=1)


def make_linear(
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    *,
    platform: Platform,
    keep_zeros: bool = False,
    six_bit: bool | None = None,
) -> QuantizedLinear:
    """The module that runs `weight` on `platform` (keep_zeros: Int4Linear's; six_bit: whether an
    Int8GroupWeight runs as an Int6GroupLinear, decided by the caller from `int6_fits` (a mixture
    of experts for all its experts at once), or None: where it fits)."""
    if six_bit is None:
        six_bit = int6_fits(weight, compute_dtype, platform)
    if six_bit:
        return Int6GroupLinear(weight, bias, compute_dtype, platform=platform)  # type: ignore[arg-type]
    if isinstance(weight, Int8GroupWeight) and weight.zero is not None:
        raise ValueError(
            "int8 codes with zeros per group (GGUF Q5_1, Q5_K) run only as 6-bit codes, on CPUs whose "
            "kernels read them (kernels.linear_int6_available()) in bf16; dequantize them elsewhere"
        )
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, bias, compute_dtype, platform=platform)
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias, compute_dtype, platform=platform, keep_zeros=keep_zeros)
    return Int8GroupLinear(weight, bias, compute_dtype, platform=platform)


def _int4_operands(weight: Int4Weight, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Linear's buffers: codes packed [N / 64, K, 32] and scale_zero [K / group, N, 2],
    rows padded to a multiple of 64 with zero weights (code 0, scale 0, zero 0)."""
    padding = (0, 0, 0, -weight.q.shape[0] % INT4_TILE_ROWS)
    q, scale, zero = (F.pad(t, padding) for t in (weight.q, weight.scale, weight.zero))
    scale_zero = torch.stack([scale.to(compute_dtype), zero.to(compute_dtype)], dim=-1)
    return _pack_nibbles(q.to(torch.uint8)).contiguous(), scale_zero.transpose(0, 1).contiguous()


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N (a multiple of 64), K] in the int4 tiles [N / 64, K, 32]: byte [t, k, j]
    holds row 64t + j's code in its low nibble, row 64t + 32 + j's in its high nibble."""
    n, k = codes.shape
    tiles = codes.view(n // INT4_TILE_ROWS, 2, INT4_TILE_ROWS // 2, k)
    return (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2)


def _row_nibbles(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of rows `ids` [R] of tiles [N / 64, K, 32] (_pack_nibbles'), uint8 [R, K]."""
    lane = ids % INT4_TILE_ROWS
    tile_bytes = packed[ids // INT4_TILE_ROWS, :, lane % (INT4_TILE_ROWS // 2)]  # [R, K]
    return tile_bytes >> (4 * (lane // (INT4_TILE_ROWS // 2))).to(torch.uint8)[:, None] & 0x0F


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
