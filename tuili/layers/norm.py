"""RMSNorm, computed in float32 whatever the working dtype (as the reference models do), with
the residual add of a decoder layer folded in.

On a CPU where tuili's kernels build, one fused kernel (tuili/kernels) does the add, the float32
statistics and both roundings in one pass; elsewhere the same arithmetic runs as torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels
from tuili.platform import Platform


def fused_elementwise(platform: Platform, x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the native elementwise kernels take x (and a weight of x's dtype) on `platform`."""
    return platform.native(x) and (weight is None or weight.dtype == x.dtype)


class RMSNorm(nn.Module):
    offset = False  # weights stored centred on zero, scaling by (1 + weight): OffsetRMSNorm

    def __init__(self, dim: int, eps: float, platform: Platform) -> None:
        super().__init__()
        self.eps = eps
        self.platform = platform
        self.weight = nn.Parameter(torch.zeros(dim) if self.offset else torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); or, given the residual stream, (RMSNorm(x + residual), x + residual).
        The residual passed in may be overwritten: use the one returned."""
        if fused_elementwise(self.platform, x, self.weight):
            dim = x.shape[-1]
            flat = x.reshape(-1, dim).contiguous()
            out = torch.empty_like(flat)
            if residual is None:
                return kernels.rms_norm(flat, self.weight, self.eps, out, offset=self.offset).view(x.shape)
            residual = residual.reshape(-1, dim).contiguous()
            kernels.rms_norm(flat, self.weight, self.eps, out, residual, offset=self.offset)
            return out.view(x.shape), residual.view(x.shape)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: the weight is stored centred on zero and scales by (1 + weight),
    applied in float32 before the one rounding to the working dtype (the reference's
    `(x * w).to(dtype)` order, unlike Llama's `w * x.to(dtype)`; the native kernel takes both).
    The residual add is folded in as in RMSNorm, in the working dtype as the reference adds."""

    offset = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x gated by SiLU(gate) (Qwen3-Next's linear attention output): the reference's
    order, normalise in float32, round, scale by the weight in the working dtype, then multiply
    by SiLU(gate) in float32 and round once more."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)
