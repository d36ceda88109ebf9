"""The weight layouts the C kernels and the torch code share, in one place.

build.py passes each constant to the compiler (`-DTUILI_...`), so the C code (csrc/common.h)
and the Python that packs weights and checks shapes read the same numbers.
"""

from __future__ import annotations

INT4_TILE_ROWS = 64  # output rows per tile of the packed int4 layout (Int4Linear, linear_int4.c, dequant.c)
AMX_TILE_ROWS = 16  # rows of an AMX tile: output rows per panel of the AMX weight layout (PanelLinear)
AMX_K_MULTIPLE = 32  # bf16 values in an AMX tile row of 64 bytes


def compiler_defines() -> list[str]:
    return [
        f"-DTUILI_INT4_TILE_ROWS={INT4_TILE_ROWS}",
        f"-DTUILI_AMX_TILE_ROWS={AMX_TILE_ROWS}",
        f"-DTUILI_AMX_K_MULTIPLE={AMX_K_MULTIPLE}",
    ]
