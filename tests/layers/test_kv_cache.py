"""The paged KV cache of one layer: stored and gathered through block tables, in the working
dtype exactly and in fp8 (e4m3) within the format's rounding."""

from __future__ import annotations

import pytest
import torch

from tuili.layers.attention import FP8_HEADROOM, FP8_MAX, KVCache

BLOCKS, BLOCK, HEADS, DIM = 12, 4, 3, 8


def _filled(dtype: torch.dtype, tokens: int = 20, seed: int = 0):
    """A cache holding `tokens` keys/values of one sequence at shuffled blocks; per-head
    magnitudes differ by 100x so one scale for all heads would not do."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.tensor([0.05, 1.0, 5.0])[None, :, None]
    k = torch.randn(tokens, HEADS, DIM, generator=generator) * magnitude
    v = torch.randn(tokens, HEADS, DIM, generator=generator) * magnitude
    table = torch.randperm(BLOCKS, generator=generator)[: -(-tokens // BLOCK)]
    slots = torch.tensor([int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(tokens)])
    cache = KVCache.allocate((BLOCKS, BLOCK, HEADS, DIM), dtype, torch.device("cpu"))
    cache.store(k, v, slots)
    return cache, k, v, table[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_working_dtype_round_trips_exactly(dtype):
    cache, k, v, table = _filled(dtype)
    keys, values = cache.gather(table, k.shape[0], dtype)
    assert torch.equal(keys[0].transpose(0, 1), k.to(dtype)) and torch.equal(values[0].transpose(0, 1), v.to(dtype))
    assert cache.key_scale is None


def test_fp8_round_trip_is_within_e4m3_rounding():
    cache, k, v, table = _filled(torch.float8_e4m3fn)
    assert cache.key.dtype == torch.float8_e4m3fn and cache.key.element_size() == 1
    keys, values = cache.gather(table, k.shape[0], torch.float32)
    for original, restored, scale in ((k, keys, cache.key_scale), (v, values, cache.value_scale)):
        # One scale per head, from the head's largest magnitude with headroom.
        expected_scale = original.abs().amax(dim=(0, 2)) * FP8_HEADROOM / FP8_MAX
        torch.testing.assert_close(scale, expected_scale)
        # e4m3: 3 mantissa bits (relative step 2^-3, rounding error <= 2^-4 of the value) down
        # to 2^-6, subnormals spaced 2^-9 below: absolute error <= 2^-10 in scaled units.
        error = (restored[0].transpose(0, 1) - original).abs()
        bound = original.abs() * 2**-4 + scale[None, :, None] * 2**-10
        assert (error <= bound * (1 + 1e-6)).all()


def test_fp8_scales_are_set_once_and_large_values_saturate():
    cache, k, _, table = _filled(torch.float8_e4m3fn, tokens=8)
    key_scale = cache.key_scale.clone()
    huge = torch.full((1, HEADS, DIM), 1e6)
    cache.store(huge, -huge, torch.tensor([int(table[0, 1]) * BLOCK + 3]))  # position 7
    assert torch.equal(cache.key_scale, key_scale)
    keys, values = cache.gather(table, 8, torch.float32)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    torch.testing.assert_close(keys[0, :, 7], (FP8_MAX * key_scale)[:, None].expand(HEADS, DIM))
    torch.testing.assert_close(values[0, :, 7], (-FP8_MAX * cache.value_scale)[:, None].expand(HEADS, DIM))
    # The earlier tokens are untouched.
    torch.testing.assert_close(keys[0, :, :7].transpose(0, 1), k[:7], atol=0.5, rtol=2**-4)
