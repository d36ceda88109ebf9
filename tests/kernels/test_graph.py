"""CPU graphs (tuili/kernels/graph.py): a replay recomputes what the eager function computes on
the inputs' current contents, bit for bit; intermediates share planned memory; anything a replay
would skip is refused at capture; a kernel refusing its inputs during a replay is reported."""

from __future__ import annotations

import threading

import pytest
import torch

from tuili import kernels
from tuili.kernels.graph import Arena, GraphCaptureError, GraphReplayError, capture

DIM, WIDTH = 64, 96


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


def mlp_block(x: torch.Tensor, residual: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """An add + RMSNorm, a gated MLP and a float32 projection, all native kernels, each output a
    fresh allocation (as the model's layers make them)."""
    h = torch.empty_like(x)
    kernels.rms_norm(x, weights["norm"], 1e-6, h, residual)
    gate_up = h.new_empty(h.shape[0], 2 * WIDTH)
    kernels.linear_small(h, weights["gate_up"], None, gate_up)
    act = h.new_empty(h.shape[0], WIDTH)
    kernels.silu_mul(gate_up, act)
    down = h.new_empty(h.shape[0], DIM)
    kernels.linear_small(act, weights["down"], weights["bias"], down)
    out = torch.empty(h.shape[0], DIM, dtype=torch.float32)
    kernels.linear_small(down, weights["head"], None, out)
    return out


def make_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to(dtype)

    return {
        "norm": rand(DIM) + 1, "gate_up": rand(2 * WIDTH, DIM), "down": rand(DIM, WIDTH), "bias": rand(DIM),
        "head": rand(DIM, DIM),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_recomputes_from_the_inputs_current_contents(dtype):
    weights = make_weights(dtype)
    x, residual = torch.randn(3, DIM).to(dtype), torch.randn(3, DIM).to(dtype)
    _, graph = capture(lambda: [mlp_block(x, residual, weights)], Arena())
    assert graph.calls == 5
    for _ in range(3):
        fresh_x, fresh_residual = torch.randn(3, DIM).to(dtype), torch.randn(3, DIM).to(dtype)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        (replayed,) = graph.replay()
        expected_residual = fresh_residual.clone()
        expected = mlp_block(fresh_x, expected_residual, weights)  # eagerly, on the same inputs
        assert replayed.dtype == torch.float32 and replayed.shape == (3, DIM)
        assert torch.equal(replayed, expected)
        assert torch.equal(residual, expected_residual), "the in-place residual add is replayed too"


def test_intermediates_share_planned_memory():
    # A chain of 12 products, each output alive only until the next one has read it: the arena
    # holds a few of them, not twelve.
    weight = torch.randn(256, 256) / 16
    x = torch.randn(8, 256)
    size = x.numel() * x.element_size()

    def chain() -> list[torch.Tensor]:
        h = x
        for _ in range(12):
            out = h.new_empty(h.shape)
            kernels.linear_small(h, weight, None, out)
            h = out
        return [h]

    arena = Arena()
    (eager,), graph = capture(chain, arena)
    assert arena.buffer.numel() <= 3 * size
    x.normal_()
    (replayed,) = graph.replay()
    assert torch.equal(replayed, chain()[0])


def test_graphs_sharing_an_arena_survive_its_growth():
    weights = make_weights(torch.float32)
    small_x, small_residual = torch.randn(1, DIM), torch.randn(1, DIM)
    big_x, big_residual = torch.randn(8, DIM), torch.randn(8, DIM)
    arena = Arena()
    _, small = capture(lambda: [mlp_block(small_x, small_residual, weights)], arena)
    before = arena.generation
    _, big = capture(lambda: [mlp_block(big_x, big_residual, weights)], arena)
    assert arena.generation > before, "the bigger graph grew the arena"
    small_x.normal_()
    small_residual.normal_()
    reference_residual = small_residual.clone()
    expected = mlp_block(small_x.clone(), reference_residual, weights)
    (replayed,) = small.replay()
    assert torch.equal(replayed, expected)


def test_torch_arithmetic_inside_a_capture_is_refused():
    weights = make_weights(torch.float32)
    x, residual = torch.randn(2, DIM), torch.randn(2, DIM)
    with pytest.raises(GraphCaptureError, match=r"aten\.mul"):
        capture(lambda: [mlp_block(x * 2, residual, weights)], Arena())
    packed, scale_zero = torch.zeros(1, 32, 32, dtype=torch.uint8), torch.ones(1, 64, 2)  # one 64 x 32 tile
    with pytest.raises(GraphCaptureError, match=r"tuili_dequant_int4 cannot be replayed"):
        capture(lambda: [kernels.dequantize_int4_tiles(packed, scale_zero, 0, torch.empty(32, 64))], Arena())


def test_outputs_must_come_from_the_capture():
    x = torch.randn(2, DIM)
    with pytest.raises(GraphCaptureError, match="allocated inside the capture"):
        capture(lambda: [x], Arena())


def test_a_bad_slot_at_replay_is_reported_and_writes_nothing():
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    qkv = torch.randn(3, 6, 8)  # 2 q heads, then 2 k and 2 v heads
    slots = torch.tensor([0, 5, 7])

    def store() -> list[torch.Tensor]:
        kernels.kv_store(qkv[:, 2:4], qkv[:, 4:6], k_cache, v_cache, slots)
        return []

    _, graph = capture(store, Arena())
    k_cache.zero_()
    v_cache.zero_()
    slots[1] = 8  # the cache has 4 x 2 slots
    with pytest.raises(GraphReplayError, match="kernel call 0"):
        graph.replay()
    assert not k_cache.any() and not v_cache.any()
    slots[1] = 6
    graph.replay()
    assert torch.equal(k_cache.view(8, 2, 8)[[0, 6, 7]], qkv[:, 2:4])
    assert torch.equal(v_cache.view(8, 2, 8)[[0, 6, 7]], qkv[:, 4:6])


def test_a_capture_records_only_its_own_threads_calls():
    weights = make_weights(torch.float32)
    x, residual = torch.randn(2, DIM), torch.randn(2, DIM)
    other = threading.Thread(target=mlp_block, args=(torch.randn(2, DIM), torch.randn(2, DIM), weights))
    with kernels.cpu.recording() as calls:
        other.start()
        other.join()
        mlp_block(x, residual, weights)
    assert [name for name, _ in calls].count("tuili_linear_small") == 3
