"""Rotary position embedding (the "rotate half" layout of Hugging Face checkpoints),
with Llama 3's frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tuili import kernels
from tuili.layers.norm import RMSNorm, fused_elementwise
from tuili.platform import Platform


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE at arbitrary absolute positions (a flat batch of tokens)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # Built on the CPU explicitly: the model may be constructed under the meta device
        # (weights are assigned at load), but these tables are computed, not loaded.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        inv_freq = 1.0 / (theta**exponents)
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        # [max_positions, head_dim // 2] each; float32 so positions far out stay exact.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` ([T]), each [T, 1, head_dim // 2]: looked up once per step
        and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x: [T, H, D] (queries and keys together: one rotation per layer) by `tables`."""
    cos, sin = tables
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def norm_and_rotate(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    norms: tuple[RMSNorm, RMSNorm] | None,
    tables: tuple[torch.Tensor, torch.Tensor],
    platform: Platform,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v from qkv [T, Hq + 2 Hkv, D]: q and k each RMS-normalized per head first when
    `norms` (q's, k's) are given (Qwen3), then rotated. Where the platform's native kernels run, one
    fused pass works in place on qkv and q, k, v are views of it."""
    q_norm, k_norm = norms if norms is not None else (None, None)
    if fused_elementwise(platform, qkv) and all(n is None or n.weight.dtype == qkv.dtype for n in (q_norm, k_norm)):
        cos, sin = tables
        qkv = qkv.contiguous()
        kernels.qk_norm_rope(
            qkv, num_heads, None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1),
            0.0 if q_norm is None else q_norm.eps,
        )  # fmt: skip
        return qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    qk, v = qkv.split([num_heads + num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None and k_norm is not None:
        qk = torch.cat([q_norm(qk[:, :num_heads]), k_norm(qk[:, num_heads:])], dim=1)
    q, k = apply_rotary(qk, tables).split([num_heads, num_kv_heads], dim=1)
    return q, k, v


def apply_partial_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the first `rotary_dim` = 2 * tables' width dimensions of x [T, H, D] (the
    "rotate half" layout within them) and pass the rest through (Qwen3-Next's
    partial_rotary_factor). With rotary_dim == D this is `apply_rotary`."""
    rotary_dim = 2 * tables[0].shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, tables)
    return torch.cat((apply_rotary(x[..., :rotary_dim], tables), x[..., rotary_dim:]), dim=-1)
