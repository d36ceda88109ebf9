"""SiLU-gated MLP activation: silu(gate) * up from the stacked gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tuili import kernels
from tuili.layers.norm import fused_elementwise
from tuili.platform import Platform


def silu_and_mul(gate_up: torch.Tensor, platform: Platform) -> torch.Tensor:
    """gate_up [..., 2I] holding gate then up -> silu(gate) * up [..., I], rounded as torch rounds
    (silu to the dtype, then the product); one fused pass where the platform's native kernels run."""
    if fused_elementwise(platform, gate_up):
        width = gate_up.shape[-1]
        flat = gate_up.reshape(-1, width).contiguous()
        out = flat.new_empty(flat.shape[0], width // 2)
        return kernels.silu_mul(flat, out).view(*gate_up.shape[:-1], width // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
