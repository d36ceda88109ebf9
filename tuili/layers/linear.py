"""Dense linear layers whose decode-sized products run tuili's native GEMV on CPUs.

A decode step multiplies a few activation rows by every weight matrix, so its time is the
weight bytes over the memory bandwidth. PyTorch's CPU GEMV streams bf16 weights well below the
bandwidth (docs/kernels.md); tuili's `linear_small` kernel streams them near it. Up to
`NATIVE_MAX_ROWS[dtype]` rows, on a CPU where the kernels build, `linear` runs that kernel;
everything else is F.linear. The two agree to one rounding of the output (both accumulate in
float32). The limits are the measured crossovers: in bf16 oneDNN's AMX matmul wins from 5 rows
on; in fp32 the kernel is 1.4-3x faster from 2 to 8 rows and even at 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels

NATIVE_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 8}  # crossovers with F.linear, docs/kernels.md


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for x of any leading shape."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features if in_features else 0
    if (
        0 < rows <= NATIVE_MAX_ROWS.get(x.dtype, 0)
        and x.device.type == "cpu"
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
        and kernels.available()
    ):
        flat = x.reshape(rows, in_features).contiguous()
        out = flat.new_empty(rows, weight.shape[0])
        kernels.linear_small(flat, weight, bias, out)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
