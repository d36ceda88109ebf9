"""Linear layers whose weights stay quantized (8 or 4 bits plus scales) in memory and in the
matmul: formats.py says what the stored numbers mean and makes them from float weights;
linear.py holds the modules that multiply them. Which linear of a model is held how is the
loader's weight plan (tuili/models/weights.py); GGUF blocks are read in tuili/models/gguf.py.
"""

from tuili.layers.quant.formats import (
    DEFAULT_INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8GroupWeight,
    Int8Weight,
    QuantizedWeight,
    int8_group_size,
    quantize_int4,
    quantize_int8,
    quantize_int8_for_kernels,
    quantize_int8_group,
    stack_parts,
)
from tuili.layers.quant.linear import (
    INT4_GEMV_MAX_ROWS,
    INT4_OP_MAX_ROWS,
    INT8_OP_MAX_ROWS,
    KERNEL_FORMATS,
    Q8_0_GEMV_MAX_ROWS,
    Q8_0_OP_MAX_ROWS,
    Int4Linear,
    Int6GroupLinear,
    Int8GroupLinear,
    Int8Linear,
    PackedEmbedding,
    PackedLinear,
    QuantizedLinear,
    StackedLinear,
    int6_fits,
    make_linear,
)
from tuili.platform import INT4_TILE_ROWS

__all__ = [
    "DEFAULT_INT4_GROUP_SIZE",
    "INT4_GEMV_MAX_ROWS",
    "INT4_GROUP_SIZES",
    "INT4_OP_MAX_ROWS",
    "INT4_TILE_ROWS",
    "INT8_OP_MAX_ROWS",
    "KERNEL_FORMATS",
    "Q8_0_GEMV_MAX_ROWS",
    "Q8_0_OP_MAX_ROWS",
    "Int4Linear",
    "Int4Weight",
    "Int6GroupLinear",
    "Int8GroupLinear",
    "StackedLinear",
    "Int8GroupWeight",
    "Int8Linear",
    "PackedEmbedding",
    "PackedLinear",
    "Int8Weight",
    "QuantizedLinear",
    "QuantizedWeight",
    "int8_group_size",
    "int6_fits",
    "make_linear",
    "quantize_int4",
    "quantize_int8",
    "quantize_int8_for_kernels",
    "quantize_int8_group",
    "stack_parts",
]
