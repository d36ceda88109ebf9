"""tuili/platform.py: what this process's CPU offers, as PyTorch will use it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import types

import pytest

_REPORT = "from tuili.platform import Platform; print(Platform.detect('cpu').bf16_arithmetic)"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="ATEN_CPU_CAPABILITY's x86 levels")
def test_pytorch_held_to_avx2_means_no_bf16_arithmetic():
    """With PyTorch's kernels held to AVX2 (as on an AVX2 CPU) tuili does not take bf16 dot
    products for granted, whatever the CPU itself has: every bf16 product then stays in tuili's
    own kernels, as it would on that CPU."""
    held = subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, check=True,
                          env=os.environ | {"ATEN_CPU_CAPABILITY": "avx2"})
    assert held.stdout.split() == ["False"], held.stdout + held.stderr


def _fake_fla(monkeypatch: pytest.MonkeyPatch, importable: bool) -> None:
    """flash-linear-attention's package as an import sees it: present (empty stand-in modules of
    its three levels) or absent (None in sys.modules makes the import raise ImportError)."""
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if importable else None)


@pytest.mark.parametrize(
    ("device", "installed", "switch", "expected"),
    [
        ("cuda", True, None, True),
        ("cuda", True, "0", False),  # TUILI_FLA=0: the torch forms, for comparison
        ("cuda", False, None, False),
        ("cpu", True, None, False),  # fla's kernels are Triton on CUDA only
    ],
)
def test_fla_is_chosen_on_cuda_when_installed_and_not_switched_off(monkeypatch, device, installed, switch, expected):
    from tuili.platform import Platform

    _fake_fla(monkeypatch, installed)
    if switch is None:
        monkeypatch.delenv("TUILI_FLA", raising=False)
    else:
        monkeypatch.setenv("TUILI_FLA", switch)
    assert Platform.detect(device).fla is expected
