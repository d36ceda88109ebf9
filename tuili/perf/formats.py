"""How many bytes a value takes: activation / KV dtypes, and weight storage formats with their scales.

A weight matrix is stored as rows (output features) of ``cols`` values. Every format here is
described the same way: each row is cut into blocks of ``block`` values that take ``block_bytes``
bytes together (values, scales and zero points of that block), and each row may carry
``row_bytes`` more (a per-channel scale). That one rule covers plain dtypes (block of 1), per-channel
quantization (a scale per row), per-group quantization and every GGUF type at its real block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuili.errors import TuiliError

# Bytes per value of the dtypes activations, KV caches and recurrent states are kept in.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}

# Spellings people (and torch) use for the same dtypes.
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def canonical_dtype(name: str) -> str:
    """The canonical short name of a dtype ("torch.bfloat16" -> "bf16"); raise on unknown names."""
    key = str(name).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise TuiliError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> int:
    """Bytes per value of a dtype."""
    return DTYPE_BYTES[canonical_dtype(name)]


@dataclass(frozen=True)
class WeightFormat:
    """How a weight checkpoint stores its tensors.

    ``block``/``block_bytes``/``row_bytes`` describe a 2-D weight matrix (see the module docstring).
    ``vector_bytes`` is the size of one value of a 1-D tensor (norm weights, biases, gates), which
    no format quantizes. ``quantize_embeddings`` says whether the token embedding and lm_head are
    stored in this format too; the usual FP8/INT8/INT4 checkpoints keep them at 16 bits.
    ``compute_dtype`` is the dtype the matmuls run in (W8A8 for fp8/int8; W4A16 for int4).
    """

    name: str
    block: int
    block_bytes: float
    row_bytes: float = 0.0
    vector_bytes: int = 2
    quantize_embeddings: bool = False
    compute_dtype: str = "bf16"
    description: str = ""

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a ``rows`` x ``cols`` matrix (``cols`` is the dimension blocks run along)."""
        per_row = math.ceil(cols / self.block) * self.block_bytes + self.row_bytes
        return math.ceil(rows * per_row)

    @property
    def bits_per_weight(self) -> float:
        """Average stored bits per value of a long row, scales included (per-row scales excluded)."""
        return 8 * self.block_bytes / self.block


def _plain(name: str, nbytes: int) -> WeightFormat:
    return WeightFormat(
        name, 1, nbytes, vector_bytes=nbytes, quantize_embeddings=True,
        compute_dtype=name, description=f"{name}, {nbytes} byte(s) per value",
    )


# The precisions `tuili plan --weights` offers besides the GGUF types.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": _plain("fp32", 4),
    "bf16": _plain("bf16", 2),
    "fp16": _plain("fp16", 2),
    # FP8 E4M3 values with one fp32 scale per output channel (the layout of per-channel FP8
    # checkpoints such as llm-compressor's FP8_DYNAMIC); the matmul runs in FP8 (W8A8).
    "fp8": WeightFormat(
        "fp8", 1, 1, row_bytes=4, compute_dtype="fp8",
        description="FP8 E4M3, one fp32 scale per output channel, W8A8",
    ),
    # INT8 with one fp32 scale per output channel, W8A8 (SmoothQuant-style checkpoints).
    "int8": WeightFormat(
        "int8", 1, 1, row_bytes=4, compute_dtype="int8",
        description="INT8, one fp32 scale per output channel, W8A8",
    ),
    # Symmetric INT4 in groups of 128 along the input dimension, one fp16 scale per group
    # (GPTQ/AWQ-style W4A16 with group_size=128): 64 bytes of values + 2 bytes of scale.
    "int4": WeightFormat(
        "int4", 128, 64 + 2, compute_dtype="bf16",
        description="INT4, groups of 128 with one fp16 scale each, W4A16",
    ),
}


def _gguf_formats() -> dict[str, WeightFormat]:
    """Every GGUF quantization type at the block size and block bytes the gguf package defines."""
    from gguf.constants import GGML_QUANT_SIZES

    formats = {}
    for qtype, (block, type_size) in GGML_QUANT_SIZES.items():
        name = qtype.name.lower()
        if name in ("f32", "f64", "i8", "i16", "i32", "i64"):
            continue  # not weight formats anyone quantizes a model to
        formats[name] = WeightFormat(
            name, block, type_size, vector_bytes=4, quantize_embeddings=True,
            compute_dtype="bf16" if name != "f16" else "fp16",
            description=f"GGUF {qtype.name}: {type_size} bytes per block of {block}",
        )
    return formats


def weight_format(name: str) -> WeightFormat:
    """The storage format called ``name``: bf16, fp16, fp32, fp8, int8, int4 or a GGUF type (q4_k, ...)."""
    key = str(name).lower()
    if key in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[key]
    gguf = _gguf_formats()
    if key in gguf:
        return gguf[key]
    raise TuiliError(
        f"unknown weight format {name!r}: expected one of {', '.join(WEIGHT_FORMATS)} "
        f"or a GGUF type ({', '.join(sorted(gguf))})"
    )
