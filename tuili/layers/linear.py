"""Dense (float) linear layers, computed by tuili's native kernels where the platform has them.

Which class holds a linear is the loader's weight plan (tuili/models/weights.py), decided once:

- `PanelLinear`: a bf16 weight laid out once, at load, in 16-row panels (the AMX B-tile layout);
  every product runs `kernels.linear_packed` (the GEMV at 1-4 rows; from 5, AMX tiles where the
  CPU has them, else the GEMV's dot products in register blocks). The plan uses it for the
  decoder layers' bf16 linears on CPUs with AVX512-BF16 or AMX.
- `Linear`: a row-major weight (nn.Linear's parameters), through `linear`, below. That is the
  logits' matrix (a tied one is also the embedding table), float32 models, CPUs without
  AVX512-BF16 and shapes the panel layout does not take.

A decode step multiplies a few activation rows by every weight matrix, so its time is the
weight bytes over the memory bandwidth. PyTorch's CPU matmul streams bf16 weights well below the
bandwidth at these shapes; tuili's kernels stream them near it. Where the native kernels run,
`linear` picks by the number of rows:

- up to `NATIVE_MAX_ROWS[dtype]` rows: `linear_small`, the vector GEMV;
- bf16, up to `AMX_MAX_ROWS` rows, K a multiple of 32, on a CPU with AMX-BF16: `linear_amx`,
  which reads the weight as stored (oneDNN reorders it on every call) and once per step at any
  batch in that range;
- bf16 on a CPU without bf16 arithmetic (AVX2, AVX-512 without BF16): `linear_rows` at any row
  count, 2-4x PyTorch's bf16 matmul there (docs/kernels.md, "Measured crossovers");
- everything else: F.linear (oneDNN), fastest for prefill-sized products.

They all accumulate in float32 and agree to one rounding of the output, but not bit for bit: a
row's bits depend on which kernel its step's row count picked, and oneDNN's also on the row count
itself. In the batch-invariant mode (`Platform.batch_invariant`, the default) every row count
takes one kernel whose result for a row depends on that row alone: `linear_amx` for bf16 on AMX,
else `linear_rows`: `linear_small`'s arithmetic per row at any row count (its result for a row
does not depend on how many rows share the call; without AVX-512 a tiled product, so that a
prompt does not stream the weight from memory once per 8 rows). Where no native kernel takes the product on a CPU
(the portable path, shapes and dtypes the kernels refuse), F.linear runs on blocks of exactly
`INVARIANT_BLOCK_ROWS` rows, the last one padded with zeros: PyTorch's CPU matmul chooses its
algorithm and its reduction order by shape, so one shape for every call gives a row the same
bits wherever it sits. On a GPU F.linear runs as it is: not batch invariant (docs/engine.md).

Logits ask for float32
output (`out_dtype`): the native kernels then skip that rounding, so bf16 weights give logits
without bf16's ties (a rounded logit's 2^-8 relative step is shared by many tokens). The row
limits are measured crossovers (docs/kernels.md, "Measured crossovers and thresholds").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels
from tuili.platform import AMX_K_MULTIPLE, AMX_PANEL_ROWS, Platform

NATIVE_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 8}  # crossovers with F.linear, docs/kernels.md
AMX_MAX_ROWS = 128
# Rows of every F.linear call in the batch-invariant mode where no native kernel runs: a decode
# pads a lone row to 16 (cheap next to reading the weight), a prompt runs 16 rows at a time.
INVARIANT_BLOCK_ROWS = 16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    platform: Platform,
) -> torch.Tensor:
    """x @ weight.T + bias for x of any leading shape, in x's dtype or in `out_dtype` (float32
    from bf16 operands: unrounded where a native kernel runs, else the rounded product widened)."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features if in_features else 0
    widen = out_dtype is not None and out_dtype != x.dtype
    if platform.batch_invariant:
        kernel, block = _invariant_kernel(x, weight, bias, rows, platform)
    else:
        kernel, block = _native_kernel(x, weight, bias, rows, widen, platform), rows
    if kernel is None:
        if platform.batch_invariant and x.device.type == "cpu" and rows:
            out = fixed_shape_blocks(x.reshape(rows, in_features), lambda block: F.linear(block, weight, bias))
            out = out.view(*x.shape[:-1], weight.shape[0])
        else:
            out = F.linear(x, weight, bias)
        return out.to(out_dtype) if widen else out
    flat = x.reshape(rows, in_features).contiguous()
    out = flat.new_empty(rows, weight.shape[0], dtype=out_dtype if widen else x.dtype)
    for first in range(0, rows, block):
        kernel(flat[first : first + block], weight, bias, out[first : first + block])
    return out.view(*x.shape[:-1], weight.shape[0])


def fixed_shape_blocks(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product` of the rows of x [R, K] taken INVARIANT_BLOCK_ROWS rows per call, the last call's
    block padded with zero rows: every call sees one shape, so a row's result depends on the row
    alone (on a CPU, where PyTorch's kernels are deterministic for a shape). [R, N]."""
    rows = x.shape[0]
    pad = -rows % INVARIANT_BLOCK_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    blocks = [product(x[first : first + INVARIANT_BLOCK_ROWS]) for first in range(0, x.shape[0], INVARIANT_BLOCK_ROWS)]
    return torch.cat(blocks)[:rows] if len(blocks) > 1 or pad else blocks[0]


def _invariant_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, platform: Platform
) -> tuple[Callable[..., torch.Tensor] | None, int]:
    """The batch-invariant mode's kernel for this product and the most rows per call: one kernel
    at every row count, whose result for a row depends on that row alone; None for F.linear."""
    if not (
        0 < rows
        and platform.native(x)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
    ):
        return None, rows
    if x.dtype == torch.bfloat16 and weight.shape[1] % AMX_K_MULTIPLE == 0 and platform.amx:
        return kernels.linear_amx, rows
    return kernels.linear_rows, rows


def _native_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, widen: bool, platform: Platform
) -> Callable[..., torch.Tensor] | None:
    """The native kernel for this product, or None for F.linear. A widened (float32) output takes
    AMX at any row count: F.linear could only widen an already rounded result. Without bf16
    arithmetic every bf16 product is native: PyTorch's bf16 matmul there is 2-4x slower."""
    if not (
        0 < rows
        and platform.native(x)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
    ):
        return None
    if rows <= NATIVE_MAX_ROWS.get(x.dtype, 0):
        return kernels.linear_small
    if x.dtype == torch.bfloat16 and not platform.bf16_arithmetic:
        return kernels.linear_rows
    if (
        (rows <= AMX_MAX_ROWS or widen)
        and x.dtype == torch.bfloat16
        and weight.shape[1] % AMX_K_MULTIPLE == 0
        and platform.amx
    ):
        return kernels.linear_amx
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) computed by `linear` on `platform`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        platform: Platform,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.platform = platform

    @classmethod
    def holding(cls, weight: torch.Tensor, bias: torch.Tensor | None, platform: Platform) -> Linear:
        """A Linear whose parameters are `weight` and `bias` themselves (no copy; a Parameter is
        shared as the same object, so a tied output matrix is one parameter of the model)."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, platform=platform, device=torch.device("meta"))
        layer.weight = _as_parameter(weight)
        if bias is not None:
            layer.bias = _as_parameter(bias)
        return layer

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, out_dtype, platform=self.platform)


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class PanelLinear(nn.Module):
    """A bf16 linear whose one copy of the weight is laid out once, at load, for
    `kernels.linear_packed` ([N / 16, K / 2, 16, 2]: 16-row panels, the AMX B-tile layout, in
    which every 16 output rows are one contiguous stream). Every product runs that kernel: the
    GEMV at 1-4 rows; from 5, AMX tiles where the CPU has them, else the GEMV's own dot products
    in register blocks (so that, without AMX, a row's result never depends on the batch). With
    `one_path` (the batch-invariant mode) AMX tiles run from the first row too. It replaces
    `Linear`'s three kernels and oneDNN's `F.linear`, which reorders the weight on every call.
    Built only where `panel_holds` says so."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, one_path: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.one_path = one_path
        self.register_buffer("packed", kernels.pack_weight(weight.detach().contiguous()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def weight(self) -> torch.Tensor:
        """The row-major [out, in] weight (a new tensor), for references."""
        return kernels.unpack_weight(self.packed)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T + b in x's dtype (bf16), or float32 (`out_dtype`, then unrounded)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, this layer expects {self.in_features}")
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features).contiguous()
        out = flat.new_empty(rows, self.out_features, dtype=out_dtype or x.dtype)
        kernels.linear_packed(flat, self.packed, self.bias, out, self.one_path)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"one_path={self.one_path}"
        )


class PanelEmbedding(nn.Module):
    """The token lookup of a tied embedding whose one matrix is an output head's PanelLinear:
    row r is read back from the 16-row panels (panel r // 16, lane r % 16), bit for bit the
    table's row, so the model holds the matrix once, in the layout its logits read fastest."""

    def __init__(self, head: PanelLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        # The head's buffer, registered here too so that this module's weight is named as the
        # embedding's (one storage: every byte count dedupes by storage).
        self.register_buffer("packed", head.packed)

    @property
    def weight(self) -> torch.Tensor:
        """The panels, for what asks a table its dtype and storage (not its shape)."""
        return self.packed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lanes = self.packed.permute(0, 2, 1, 3)  # [N / 16, 16, K / 2, 2]: row r is lanes[r // 16, r % 16]
        rows = lanes[torch.div(input_ids, AMX_PANEL_ROWS, rounding_mode="floor"), input_ids % AMX_PANEL_ROWS]
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the output head's panels"


def panel_holds(weight: torch.Tensor, bias: torch.Tensor | None, platform: Platform) -> bool:
    """Whether a linear with this weight and bias can be a PanelLinear on `platform`: bf16 where
    kernels.linear_packed runs, N a multiple of the panel rows and K of the tile's columns."""
    n, k = weight.shape
    return (
        platform.panel_linear
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.bfloat16)
        and n % AMX_PANEL_ROWS == 0
        and k % AMX_K_MULTIPLE == 0
    )
