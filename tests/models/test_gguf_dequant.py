"""tuili's torch dequantization against the gguf package's reference (gguf.quants), bit for bit."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from tuili.errors import CheckpointError
from tuili.models.gguf import dequantize

Q = GGMLQuantizationType
# Byte offsets of each block's float16 scale fields: random bytes there could spell inf or NaN.
SCALE_OFFSETS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def assert_bitwise_equal(ours: torch.Tensor, reference: np.ndarray) -> None:
    torch.testing.assert_close(ours, torch.from_numpy(np.asarray(reference)), rtol=0, atol=0, equal_nan=True)


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, scale_std: float = 0.05
) -> np.ndarray:
    """Random bytes in the layout of `qtype` with finite scales (normal, `scale_std`): every bit
    pattern of the quants is hit."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(qtype, ()):
        scale = rng.normal(0, scale_std, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [*SCALE_OFFSETS, *FLOAT_TYPES], ids=lambda q: q.name)
def test_random_bytes_dequantize_like_gguf(qtype):
    rows, cols = 6, 512
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    ours = dequantize(raw, qtype, (rows, cols))
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert_bitwise_equal(ours, reference_dequantize(raw, qtype))


# Half a quantization step for a block holding a 0.5 outlier: each type's worst rounding error.
ROUND_TRIP_ATOL = {
    Q.F32: 0.0,
    Q.F16: 2.5e-4,
    Q.BF16: 2e-3,
    Q.Q8_0: 0.5 / 127,
    Q.Q4_0: 0.5 / 8,
    Q.Q4_1: 0.55 / 15,
    Q.Q5_0: 0.5 / 16,
    Q.Q5_1: 0.55 / 31,
}


@pytest.mark.parametrize("qtype", ROUND_TRIP_ATOL, ids=lambda q: q.name)
def test_quantized_weights_round_trip_like_gguf(qtype):
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.02, size=(16, 256)).astype(np.float32)
    weights[3, 17] = 0.5  # an outlier stretches its block's scale
    raw = reference_quantize(weights, qtype)
    ours = dequantize(raw, qtype, weights.shape)
    assert_bitwise_equal(ours, reference_dequantize(raw, qtype))
    # The reference itself must reproduce the weights up to the type's precision.
    torch.testing.assert_close(ours, torch.from_numpy(weights), rtol=0, atol=ROUND_TRIP_ATOL[qtype])


def test_bytes_input_is_accepted():
    raw = random_blocks(Q.Q4_1, 2, 64, np.random.default_rng(1))
    assert_bitwise_equal(dequantize(raw.tobytes(), Q.Q4_1, (2, 64)), reference_dequantize(raw, Q.Q4_1))


def test_unsupported_type_is_named():
    with pytest.raises(CheckpointError, match=r"IQ4_NL.*supported types: .*Q4_1"):
        dequantize(np.zeros(18, dtype=np.uint8), Q.IQ4_NL, (32,))


def test_wrong_byte_count_is_refused():
    raw = random_blocks(Q.Q8_0, 2, 64, np.random.default_rng(2))
    with pytest.raises(CheckpointError, match="136 bytes; got 102"):
        dequantize(raw.reshape(-1)[:102], Q.Q8_0, (2, 64))


def test_row_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(CheckpointError, match="multiples of 32"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (2, 16))
