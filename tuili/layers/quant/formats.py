"""What quantized weights' stored numbers mean, one dataclass per format (g = k // group_size),
and the quantizers that make them from float weights:

* `Int8Weight`       w[n, k] = scale[n] * q[n, k]                         `--quantization int8`
* `Int4Weight`       w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g]   `--quantization int4`,
                                                                           GGUF Q4_0 and Q4_1
* `Int8GroupWeight`  w[n, k] = scale[n, g] * q[n, k]                      GGUF Q8_0

How they are multiplied is tuili/layers/quant/linear.py; how GGUF blocks become these,
tuili/models/gguf.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tuili.errors import CheckpointError, TuiliError

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts
DEFAULT_INT4_GROUP_SIZE = 32  # 16 code bytes + bf16 scale and zero = 20 bytes per 32 values, Q4_1's size


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
    """8-bit weight with a scale per group of inputs (GGUF Q8_0: groups of 32), symmetric, or
    with a zero per group where `zero` is given (GGUF Q5_1 and Q5_K, whose codes are 5-bit):
    w[n, k] = scale[n, k // group_size] * q[n, k] (+ zero[n, k // group_size])."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float [N, K // group_size]
    group_size: int
    zero: torch.Tensor | None = None  # float [N, K // group_size], or None: all 0

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        grouped = self.q.float().view(n, k // self.group_size, self.group_size) * self.scale.float()[..., None]
        if self.zero is not None:
            grouped = grouped + self.zero.float()[..., None]
        return grouped.view(n, k)

    @staticmethod
    def cat(parts: list[Int8GroupWeight]) -> Int8GroupWeight:
        """Stack along the output dimension; all parts must share a group size (zeros of 0 for
        the parts without, where another has them)."""
        group_size = _common_group_size(parts)
        zero = None
        if any(p.zero is not None for p in parts):
            zero = torch.cat([torch.zeros_like(p.scale) if p.zero is None else p.zero for p in parts])
        return Int8GroupWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), group_size, zero)


QuantizedWeight = Int8Weight | Int4Weight | Int8GroupWeight


def stack_parts(parts: list[Int4Weight | Int8GroupWeight]) -> list[Int4Weight | Int8GroupWeight]:
    """Parts of one linear stacked along the output dimension, as few weights as their formats
    allow: each run of consecutive parts of one format and group size stacked into one weight (a
    GGUF file may store a fused projection's parts in different types: Q4_K_M's q and k in Q4_K,
    v in Q6_K give [q k] and [v]). Every value stays as stored."""
    runs: list[list[Int4Weight | Int8GroupWeight]] = []
    for part in parts:
        if runs and (type(runs[-1][0]), runs[-1][0].group_size) == (type(part), part.group_size):
            runs[-1].append(part)
        else:
            runs.append([part])
    return [type(run[0]).cat(run) for run in runs]  # type: ignore[arg-type]


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


# Group sizes int8 per group takes, largest first: the native kernel's groups.
INT8_GROUP_SIZES = (128, 64, 32)


def int8_group_size(in_features: int) -> int | None:
    """The group of int8 per group for rows of `in_features` inputs: the largest of
    INT8_GROUP_SIZES that divides it, or None (no group fits: int8 per row)."""
    return next((g for g in INT8_GROUP_SIZES if in_features % g == 0), None)


def quantize_int8_for_kernels(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """What `--quantization int8` stores: per group of the largest of INT8_GROUP_SIZES that
    divides the input size, else per row. Groups run on the native few-row kernel
    (Int8GroupLinear, as GGUF Q8_0), which reads them at 2-3x the speed of PyTorch's per-row
    op and can be replayed in a CPU graph; a group's scale also keeps each weight at least as
    close as a row's would (docs/quantization.md)."""
    group = int8_group_size(weight.shape[-1])
    if group is None:
        return quantize_int8(weight, scale_dtype)
    return quantize_int8_group(weight, group, scale_dtype)


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
