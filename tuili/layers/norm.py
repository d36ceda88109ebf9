"""RMSNorm, computed in float32 whatever the working dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)
