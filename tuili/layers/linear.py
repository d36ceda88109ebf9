"""Dense linear layers whose products run tuili's native kernels on CPUs.

On a CPU with AMX, the loader replaces the decoder layers' bf16 linears by `PackedLinear`, whose
weight is laid out once for `kernels.linear_packed`: that one kernel then runs every product of
those layers, decode and prefill (docs/kernels.md). What stays row-major — the logits' matrix
(a tied one is also the embedding table), float32 models, CPUs without AMX, shapes the layout
does not take — goes through `linear`, below.

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


class PackedLinear(nn.Module):
    """A bf16 linear whose one copy of the weight is laid out once, at load, for
    `kernels.linear_packed` ([N / 16, K / 2, 16, 2]: the AMX B-tile layout, in which every 16
    output rows are one contiguous stream). Every product runs that kernel: the GEMV at 1-4 rows,
    AMX tiles from 5, with the work handed out as threads free up — where `Linear` has three
    kernels and oneDNN's `F.linear`, which reorders the weight on every call and splits it
    statically between threads, for prefills. `pack_linears` installs it on CPUs with AMX.

    Should the kernels be switched off after load (TUILI_NATIVE_KERNELS=0), `linear` runs on the
    row-major weight, rebuilt at every call: correct, slow."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", kernels.pack_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def weight(self) -> torch.Tensor:
        """The row-major [out, in] weight (a new tensor), for references and the fallback."""
        return kernels.unpack_weight(self.packed)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T + b in x's dtype, or float32 (`out_dtype`, then unrounded)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, this layer expects {self.in_features}")
        if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and kernels.amx_available()):
            return linear(x, self.weight(), self.bias, out_dtype)
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features).contiguous()
        out = flat.new_empty(rows, self.out_features, dtype=out_dtype or x.dtype)
        kernels.linear_packed(flat, self.packed, self.bias, out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packs(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a linear with this weight and bias runs as a PackedLinear in this process: bf16 on
    a CPU with AMX, N a multiple of 16 and K of 32."""
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.bfloat16)
        and n % 16 == 0
        and k % 32 == 0
        and kernels.amx_available()
    )


def pack_linears(layers: nn.Module) -> int:
    """Replace every `Linear` inside `layers` that `packs` by a PackedLinear holding the same weight,
    in place (the row-major weight is then freed); returns how many. Packing copies each weight
    once: 1.4 s for the 0.88 GB of Qwen3-0.6B's layers."""
    targets = [
        (name, module)
        for name, module in layers.named_modules()
        if isinstance(module, Linear) and packs(module.weight, module.bias)
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = layers.get_submodule(parent_name) if parent_name else layers
        setattr(parent, attr, PackedLinear(module.weight, module.bias))
    return len(targets)
