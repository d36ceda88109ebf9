"""What the model tests share: transformers' side of each comparison, and a step observer."""

from __future__ import annotations

import pytest
import torch


def _hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `ids` from a transformers model, one full forward per token."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[-steps:]


def _assert_logits_match(ours: torch.Tensor, hf, prompts: list[list[int]], **tolerance) -> None:
    """`ours` (the prompts' logits back to back) equal to transformers' for each prompt alone;
    by default to float32 rounding (atol 2e-5, rtol 1e-4)."""
    offset = 0
    with torch.no_grad():
        for ids in prompts:
            ref = hf(torch.tensor([ids])).logits[0].float()
            torch.testing.assert_close(ours[offset : offset + len(ids)], ref, **(tolerance or dict(atol=2e-5, rtol=1e-4)))
            offset += len(ids)


def _assert_bf16_as_close_as_transformers(ours: torch.Tensor, hf_bf16, prompts: list[list[int]]) -> None:
    """`ours` (a bf16 engine's logits for the prompts, back to back) as close to a float32 run of
    the same bf16 weights as transformers' own bf16 run is: the mean error within 1.5x of its,
    the largest within 2x (one value of thousands, it moves much more between two runs'
    roundings than the mean). Two bf16 runs that round in different places — tuili's DeltaNet
    steps token by token, transformers' runs the chunked rule — are compared through the float32
    run, not with each other. `hf_bf16` is left in float32 afterwards."""
    with torch.no_grad():
        theirs = torch.cat([hf_bf16(torch.tensor([ids])).logits[0].float() for ids in prompts])
        exact_model = hf_bf16.float()
        exact = torch.cat([exact_model(torch.tensor([ids])).logits[0] for ids in prompts])
    ours_off, theirs_off = (ours - exact).abs(), (theirs - exact).abs()
    assert ours_off.mean() <= 1.5 * theirs_off.mean(), (ours_off.mean(), theirs_off.mean())
    assert ours_off.max() <= 2 * theirs_off.max(), (ours_off.max(), theirs_off.max())


@pytest.fixture(scope="session")
def assert_bf16_as_close_as_transformers():
    """`assert_bf16_as_close_as_transformers(ours, hf_bf16, prompts)`."""
    return _assert_bf16_as_close_as_transformers


@pytest.fixture(scope="session")
def hf_greedy():
    """`hf_greedy(model, ids, steps)`: transformers' greedy continuation, a token at a time."""
    return _hf_greedy


@pytest.fixture(scope="session")
def assert_logits_match():
    """`assert_logits_match(ours, hf, prompts, **tolerance)`."""
    return _assert_logits_match


class _MixedSteps:
    """An engine observer counting steps that hold a prefill chunk and decodes together, and
    chunks that end a prompt's piece at an odd position."""

    wants_device_time = False

    def __init__(self) -> None:
        self.count = self.odd_splits = 0

    def on_step(self, record) -> None:
        self.count += bool(record.prefill_chunks and record.decode_context_lens)
        self.odd_splits += sum((start + n) % 2 for start, n in record.prefill_chunks)


@pytest.fixture(scope="session")
def mixed_steps():
    """`mixed_steps()`: a new _MixedSteps observer."""
    return _MixedSteps
