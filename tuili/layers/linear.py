"""Dense linear layers whose decode-sized products run tuili's native kernels on CPUs.

A decode step multiplies a few activation rows by every weight matrix, so its time is the
weight bytes over the memory bandwidth. PyTorch's CPU matmul streams bf16 weights well below the
bandwidth at these shapes (docs/kernels.md); tuili's kernels stream them near it. On a CPU
where the kernels build, `linear` picks by the number of rows:

- up to `NATIVE_MAX_ROWS[dtype]` rows: `linear_small`, the vector GEMV;
- bf16, up to `AMX_MAX_ROWS` rows, K a multiple of 32, on a CPU with AMX-BF16: `linear_amx`,
  which reads the weight as stored (oneDNN reorders it on every call) and once per step at any
  batch in that range;
- everything else: F.linear (oneDNN), fastest for prefill-sized products.

They all accumulate in float32 and agree to one rounding of the output. Logits ask for float32
output (`out_dtype`): the native kernels then skip that rounding, so bf16 weights give logits
without bf16's ties (a rounded logit's 2^-8 relative step is shared by many tokens). The limits
are the measured crossovers: fp32 GEMV is 1.4-3x faster than F.linear from 1 to 8 rows; in bf16 the GEMV
is fastest at 1 row, AMX 1.3-2x faster than F.linear from 5 to 64 rows; on whole Qwen3-0.6B-shape
prefills, 1.16-1.37x at 32-64 tokens, 0.87-1.14x at 128 (three interleaved runs on two days) and
behind from 192 (0.83-0.93x at 192-256, 0.9x at 1024), where oneDNN's weight reorder pays off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels

NATIVE_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 8}  # crossovers with F.linear, docs/kernels.md
AMX_MAX_ROWS = 128


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ weight.T + bias for x of any leading shape, in x's dtype or in `out_dtype` (float32
    from bf16 operands: unrounded where a native kernel runs, else the rounded product widened)."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features if in_features else 0
    widen = out_dtype is not None and out_dtype != x.dtype
    kernel = _native_kernel(x, weight, bias, rows, widen)
    if kernel is None:
        out = F.linear(x, weight, bias)
        return out.to(out_dtype) if widen else out
    flat = x.reshape(rows, in_features).contiguous()
    out = flat.new_empty(rows, weight.shape[0], dtype=out_dtype if widen else x.dtype)
    kernel(flat, weight, bias, out)
    return out.view(*x.shape[:-1], weight.shape[0])


def _native_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, widen: bool
) -> Callable[..., torch.Tensor] | None:
    """The native kernel for this product, or None for F.linear. A widened (float32) output takes
    AMX at any row count: F.linear could only widen an already rounded result."""
    if not (
        0 < rows
        and (rows <= AMX_MAX_ROWS or widen)
        and x.device.type == "cpu"
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
        and kernels.available()
    ):
        return None
    if rows <= NATIVE_MAX_ROWS.get(x.dtype, 0):
        return kernels.linear_small
    if x.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and kernels.amx_available():
        return kernels.linear_amx
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
