"""What this process computes on, decided once when an engine is built and passed to what it builds.

Which kernels run is a property of the machine and the process, not of a call: the device,
whether tuili's native CPU kernels built (and are not switched off by `TUILI_NATIVE_KERNELS=0`),
whether the CPU grants AMX tiles, whether flash-linear-attention's Triton kernels import on a
CUDA device. `Platform.detect` reads them once; layers, the attention
backend, the sampler and the loader's weight plan take the resulting `Platform` and never ask
again. This module is the only place outside tuili/kernels that asks `tuili.kernels` what it
can do (tests/test_layering.py holds that rule).

A later backend (CUDA kernels, Triton) adds its capability here and its implementation as one
new attention backend file (tuili/layers/attention/) and one weight format (tuili/models/weights.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass

import torch

from tuili import kernels
from tuili.kernels import layout

# Weight layouts the kernels and the torch code share (one source, tuili/kernels/layout.py,
# which the build also passes to the C compiler), re-exported for layers/ and models/.
INT4_TILE_ROWS, AMX_PANEL_ROWS, AMX_K_MULTIPLE = layout.INT4_TILE_ROWS, layout.AMX_TILE_ROWS, layout.AMX_K_MULTIPLE


@dataclass(frozen=True)
class Platform:
    """The device and the kernels available on it. Frozen: decided once, shared by everything."""

    device: torch.device
    native_kernels: bool  # tuili's C kernels run here (a CPU, built, not switched off)
    amx: bool  # ... and the CPU grants this process AMX-BF16 tiles
    panel_linear: bool  # ... and kernels.linear_packed runs (AVX512-BF16 or AMX): PanelLinear
    bf16_arithmetic: bool  # bf16 dot products in hardware (AVX512-BF16 or AMX) with the native kernels
    # Every product, attention and logit computed in one fixed order per token, so that a token's
    # bits never depend on the batch, the prefix cache or the chunking (docs/engine.md, "Batch
    # invariance"). False: each call takes its fastest kernel for its row count.
    batch_invariant: bool = True
    # The gated delta rule runs flash-linear-attention's Triton kernels (a CUDA device with the
    # optional `fla-core` package installed: `pip install tuili[cuda]`); else the torch forms.
    fla: bool = False

    @classmethod
    def detect(cls, device: torch.device | str = "cpu", batch_invariant: bool = True) -> Platform:
        """This process on `device`: builds the native kernels on first use (a CPU only)."""
        device = torch.device(device)
        if device.type == "cuda" and _fla_importable():
            return dataclasses.replace(cls.portable(device, batch_invariant), fla=True)
        if device.type != "cpu" or not kernels.available():
            return cls.portable(device, batch_invariant)
        return cls(
            device,
            native_kernels=True,
            amx=kernels.amx_available(),
            panel_linear=kernels.linear_packed_available(),
            bf16_arithmetic=_cpu_has_bf16(),
            batch_invariant=batch_invariant,
        )

    @classmethod
    def portable(cls, device: torch.device | str = "cpu", batch_invariant: bool = True) -> Platform:
        """Plain PyTorch on `device`: the reference path every other one is checked against."""
        return cls(
            torch.device(device), native_kernels=False, amx=False, panel_linear=False, bf16_arithmetic=False,
            batch_invariant=batch_invariant,
        )  # fmt: skip

    def native(self, *tensors: torch.Tensor) -> bool:
        """Whether the native kernels can take these tensors: the kernels run here and every
        tensor is a float32 or bf16 CPU tensor."""
        return self.native_kernels and all(t.is_cpu and t.dtype in _NATIVE_FLOATS for t in tensors)


_NATIVE_FLOATS = (torch.float32, torch.bfloat16)


def _fla_importable() -> bool:
    """Whether flash-linear-attention's gated-delta-rule ops import (fla-core and Triton) and are
    not switched off by `TUILI_FLA=0` (which leaves the torch forms of the rule: a comparison)."""
    if os.environ.get("TUILI_FLA", "1").strip() == "0":
        return False
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return False
    return True


def _cpu_has_bf16() -> bool:
    """bf16 dot products in hardware, as PyTorch's cpuinfo reports them, where PyTorch runs its
    AVX-512 kernels (ATEN_CPU_CAPABILITY=avx2 makes it, and so tuili, work as on an AVX2 CPU)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((has_bf16 is not None and has_bf16()) or (has_amx is not None and has_amx()))
