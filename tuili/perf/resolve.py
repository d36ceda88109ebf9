"""Which hardware spec judges runs on a device: a named one, this machine's probe, a GPU's
datasheet, or a quick estimate.

Apart from hardware.py (specs, presets, files) and probe.py (measuring), because it needs
both: probe.py builds specs, and the last resort here is a probe's quick estimate.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tuili.perf.hardware import HardwareSpec, load_spec_file, preset, preset_for_device_name, probe_path
from tuili.perf.probe import estimate


def current_hardware(device: str = "cpu", name_or_path: str | None = None) -> HardwareSpec:
    """The spec to judge runs on ``device`` against.

    In order: ``name_or_path`` as a spec file or a preset name; else the last `tuili probe` saved
    for this machine and device; else, for a GPU, the preset its name matches; else a quick
    built-in estimate (origin "estimate"), measured in well under a second.
    """
    if name_or_path:
        if os.path.sep in name_or_path or Path(name_or_path).suffix.lower() in (".json", ".yaml", ".yml") \
                or Path(name_or_path).exists():
            return load_spec_file(name_or_path)
        return preset(name_or_path)
    saved = probe_path(device)
    if saved.exists():
        return load_spec_file(saved)
    if device.startswith("cuda"):
        matched = preset_for_device_name(torch.cuda.get_device_name(torch.device(device)))
        if matched is not None:
            return matched
    return estimate(device)
