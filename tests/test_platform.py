"""tuili/platform.py: what this process's CPU offers, as PyTorch will use it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

_REPORT = "from tuili.platform import Platform; print(Platform.detect('cpu').bf16_arithmetic)"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="ATEN_CPU_CAPABILITY's x86 levels")
def test_pytorch_held_to_avx2_means_no_bf16_arithmetic():
    """With PyTorch's kernels held to AVX2 (as on an AVX2 CPU) tuili does not take bf16 dot
    products for granted, whatever the CPU itself has: quantized weights then compute in float32,
    as they would on that CPU."""
    held = subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, check=True,
                          env=os.environ | {"ATEN_CPU_CAPABILITY": "avx2"})
    assert held.stdout.split() == ["False"], held.stdout + held.stderr
