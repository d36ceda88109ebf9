"""Gated DeltaNet's decode kernel (csrc/deltanet.c) against the torch code of
tuili/layers/deltanet.py that it replaces (the same layer on the portable platform): the conv step,
the gated delta rule on the state slots and the gated RMSNorm, in both projection layouts (Qwen3.5's
flat views, Qwen3-Next's grouped copies), Hv = Hk and Hv = 2 Hk, float32 and bfloat16. A sequence's
bits do not depend on the batch or the thread count; a bad slot is refused before anything is
written; a CPU graph replays the kernel. Prompt chunks (deltanet_chunks, the same arithmetic token by
token) against the torch chunked rule, with checkpoints inside a chunk, and bit for bit however a
prompt is split."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tuili import kernels
from tuili.kernels.graph import Arena, capture
from tuili.layers.deltanet import DeltaNetState, GatedDeltaNet, StateBatch
from tuili.platform import Platform

HIDDEN, SLOTS = 48, 8


@pytest.fixture(autouse=True)
def native_kernels_enabled(monkeypatch):
    monkeypatch.delenv("TUILI_NATIVE_KERNELS", raising=False)
    assert kernels.available(), kernels.unavailable_reason()


def make_layer(dtype: torch.dtype, grouped: bool, num_k_heads: int = 2, num_v_heads: int = 4, dk: int = 16,
               dv: int = 32, seed: int = 0, conv_kernel: int = 4) -> GatedDeltaNet:  # fmt: skip
    """A layer with random weights on the native platform, its out projection the identity so
    that the gated norm's rows are compared as the kernel writes them."""
    generator = torch.Generator().manual_seed(seed)
    key_dim, value_dim = num_k_heads * dk, num_v_heads * dv
    qkvz = nn.Linear(HIDDEN, 2 * key_dim + 2 * value_dim, bias=False)
    ba = nn.Linear(HIDDEN, 2 * num_v_heads, bias=False)
    layer = GatedDeltaNet(qkvz, ba, nn.Identity(), num_k_heads, num_v_heads, dk, dv, conv_kernel, 1e-6, Platform.detect(),
                          grouped_by_key_head=grouped)  # fmt: skip
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        layer.norm.weight.add_(1.0)
    layer = layer.to(dtype)
    conv_dim, kernel, heads = layer.state_shapes()
    layer.state = DeltaNetState.allocate(SLOTS, conv_dim, kernel, heads, dtype, torch.device("cpu"))
    layer.state.conv.copy_(torch.randn(layer.state.conv.shape, generator=generator))
    layer.state.recurrent.copy_(torch.randn(layer.state.recurrent.shape, generator=generator) * 0.1)
    return layer


def on_portable(layer: GatedDeltaNet) -> GatedDeltaNet:
    """The same weights computing with the torch code, on its own copy of the state."""
    twin = copy.copy(layer)
    twin.platform = Platform.portable()
    twin.state = DeltaNetState(layer.state.conv.clone(), layer.state.recurrent.clone())
    return twin


def assert_close(got: torch.Tensor, expected: torch.Tensor, chunked: bool = False) -> None:
    """float32: to rounding. bfloat16: a few units in the last place, on few values (the two sum
    in different orders, so a value near a rounding boundary may land on its other side, and the
    norm's chain of roundings (o, o * r, w * that, times the gate) can carry it on). `chunked`:
    against the torch chunked rule, whose matmuls sum every value in another order than the
    kernel's steps, so a third of the bf16 values land a unit or two apart: then each head's
    values as a whole agree to 2^-7 of their norm."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    if chunked:
        heads = (got.float() - expected.float()).unflatten(-1, (-1, 32)), expected.float().unflatten(-1, (-1, 32))
        ratio = heads[0].norm(dim=-1) / heads[1].norm(dim=-1)
        assert (ratio <= 2.0**-7).all(), f"worst head off by {ratio.max().item():.3g} of its norm"
        return
    bound = 2.0**-6 * expected.float().abs()
    off = (got.float() - expected.float()).abs()
    assert (off <= bound).all(), f"worst difference {(off / bound.clamp_min(1e-30)).max().item():.2f} x 2^-6 relative"
    assert (off > 0).float().mean() < 0.05, "more than 5% of the values differ"


def assert_states_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 states after a chunk: to float32 rounding with float32 inputs; with bfloat16 inputs
    the conv's outputs (the rule's k and v) are rounded to bf16 after sums in another order than
    torch's conv, a unit apart now and then, which the state carries at bf16's 2^-8."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got, expected, rtol=2**-6, atol=2**-6 * expected.abs().max().item())


def decode_batch(slots: list[int]) -> StateBatch:
    """One token for each of `slots`, in rows 0 .. len(slots) - 1, none starting a sequence."""
    return StateBatch.build([(row, 7, 1, slot) for row, slot in enumerate(slots)], torch.device("cpu"))


def kernel_step(layer: GatedDeltaNet, qkvz: torch.Tensor, ba: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The kernel on a flat layer's projection outputs (views, as the layer passes them)."""
    out = qkvz.new_empty(qkvz.shape[0], layer.value_dim)
    state, hv = layer.state, layer.num_v_heads
    kernels.deltanet_decode(
        qkvz[:, : layer.conv_dim], qkvz[:, layer.conv_dim :], ba[:, :hv], ba[:, hv:], layer.conv1d.weight, state.conv,
        state.recurrent, rows, slots, layer.A_log, layer.dt_bias, layer.norm.weight, layer.num_k_heads,
        layer.norm.eps, out,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "grouped"])
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)], ids=["hv2hk", "hv=hk"])
def test_decode_matches_the_torch_rule(dtype, grouped, heads):
    layer = make_layer(dtype, grouped, *heads)
    torch_layer = on_portable(layer)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    batch = decode_batch([6, 1, 3, 0, 5])
    with torch.no_grad():
        got, expected = layer(x, batch), torch_layer(x, batch)
    assert_close(got, expected)
    assert torch.equal(layer.state.conv, torch_layer.state.conv)  # the conv state is the inputs, moved on
    torch.testing.assert_close(layer.state.recurrent, torch_layer.state.recurrent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conv_kernel", [2, 3, 6])
def test_decode_matches_the_torch_rule_with_other_conv_widths(dtype, conv_kernel):
    """The kernel's decode conv has a copy for the common width (kernel 4) and a general one for
    the rest: the rest checked too, over two steps so that the moved-on windows are read again."""
    layer = make_layer(dtype, grouped=False, conv_kernel=conv_kernel)
    torch_layer = on_portable(layer)
    generator = torch.Generator().manual_seed(conv_kernel)
    batch = decode_batch([6, 1, 3])
    for _ in range(2):
        x = torch.randn(3, HIDDEN, generator=generator).to(dtype)
        with torch.no_grad():
            got, expected = layer(x, batch), torch_layer(x, batch)
        assert_close(got, expected)
        assert torch.equal(layer.state.conv, torch_layer.state.conv)
    torch.testing.assert_close(layer.state.recurrent, torch_layer.state.recurrent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_mixing_decodes_and_a_chunk(dtype):
    """Rows 0 and 3 decode; rows 1-2 are a chunk continuing slot 4 (against the torch chunked rule), row 4
    starts slot 2 afresh with a 1-token prompt (a decode row from zero state)."""
    layer = make_layer(dtype, grouped=False)
    torch_layer = on_portable(layer)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    batch = StateBatch.build([(0, 9, 1, 6), (1, 20, 2, 4), (3, 3, 1, 1), (4, 0, 1, 2)], torch.device("cpu"))
    with torch.no_grad():
        got, expected = layer(x, batch), torch_layer(x, batch)
    assert_close(got, expected, chunked=True)
    assert torch.equal(layer.state.conv, torch_layer.state.conv)
    assert_states_close(layer.state.recurrent, torch_layer.state.recurrent, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_thread_count(dtype):
    """Slot 3's token alone on one thread, third in a batch of six, first in a batch of two (the
    kernel called on the projections' outputs: torch's float32 matmul is itself not batch invariant)."""
    layer = make_layer(dtype, grouped=False, num_k_heads=2, num_v_heads=4, dk=64, dv=64)
    qkvz_row, ba_row = (torch.randn(1, width).to(dtype) for width in (layer.conv_dim + layer.value_dim,
                                                                       2 * layer.num_v_heads))
    start = DeltaNetState(layer.state.conv.clone(), layer.state.recurrent.clone())
    results = []
    threads = torch.get_num_threads()
    for slots, num_threads in (([3], 1), ([5, 0, 3, 1, 7, 2], threads), ([3, 4], threads)):
        layer.state = DeltaNetState(start.conv.clone(), start.recurrent.clone())
        position = slots.index(3)
        qkvz, ba = torch.randn(len(slots), qkvz_row.shape[1]).to(dtype), torch.randn(len(slots), ba_row.shape[1]).to(dtype)
        qkvz[position], ba[position] = qkvz_row[0], ba_row[0]
        torch.set_num_threads(num_threads)
        try:
            out = kernel_step(layer, qkvz, ba, torch.arange(len(slots)), torch.tensor(slots))
        finally:
            torch.set_num_threads(threads)
        results.append((out[position].clone(), layer.state.recurrent[3].clone(), layer.state.conv[3].clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_a_bad_slot_is_refused_and_nothing_is_written():
    layer = make_layer(torch.float32, grouped=False)
    before = (layer.state.conv.clone(), layer.state.recurrent.clone())
    with pytest.raises(ValueError, match=f"decode row 1 names state row {SLOTS} \\(slot or cut\\), outside the state's"):
        with torch.no_grad():
            layer(torch.randn(2, HIDDEN), decode_batch([2, SLOTS]))
    assert torch.equal(layer.state.conv, before[0]) and torch.equal(layer.state.recurrent, before[1])


def test_a_graph_replays_the_decode_step():
    """Captured once, replayed on new inputs at the same addresses: the same bits as an eager
    call on a copy of the state."""
    layer = make_layer(torch.bfloat16, grouped=False)
    state, eager_state = layer.state, DeltaNetState(layer.state.conv.clone(), layer.state.recurrent.clone())
    mixed = torch.randn(3, layer.conv_dim + layer.value_dim).to(torch.bfloat16)
    ba = torch.randn(3, 2 * layer.num_v_heads).to(torch.bfloat16)
    rows, slots = torch.tensor([0, 1, 2]), torch.tensor([4, 0, 6])

    def step(state: DeltaNetState) -> list[torch.Tensor]:
        layer.state = state
        return [kernel_step(layer, mixed, ba, rows, slots)]

    _, graph = capture(lambda: step(state), Arena())
    step(eager_state)  # the capture's eager run moved the state on once: so does this copy
    mixed.copy_(torch.randn_like(mixed, dtype=torch.float32).to(torch.bfloat16))
    (replayed,) = graph.replay()
    (eager,) = step(eager_state)
    assert torch.equal(replayed, eager)
    assert torch.equal(state.recurrent, eager_state.recurrent) and torch.equal(state.conv, eager_state.conv)


class RowByRow(nn.Module):
    """A linear applied to one row at a time: a row's bits do not depend on the others."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear(row[None]) for row in x])


def run_items(layer: GatedDeltaNet, x: torch.Tensor, sizes: list[int], slot: int, start: int = 0,
              saves: list[tuple[int, int]] = ()) -> torch.Tensor:  # fmt: skip
    """One sequence's tokens x (positions start ..) in steps of `sizes` tokens each, in `slot`;
    `saves`: (tokens into the whole run, checkpoint row), each inside one step. Returns the rows."""
    outs, done = [], 0
    with torch.no_grad():
        for n in sizes:
            step_saves = [(0, at - done, row) for at, row in saves if done < at <= done + n]
            batch = StateBatch.build([(0, start + done, n, slot)], torch.device("cpu"), saves=step_saves)
            outs.append(layer(x[done : done + n], batch))
            done += n
    return torch.cat(outs)


# Heads of 96 values: the kernel takes a prompt's state in blocks of 64 columns (vector code on
# AVX-512) and a 32-column rest (the plain loop); 32 values are one plain block.
@pytest.mark.parametrize("dv", [32, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_match_the_torch_chunked_rule_with_checkpoints_inside(dtype, dv):
    """A 150-token chunk (more than two of the chunked rule's 64-token blocks) continuing slot 2,
    with checkpoints after 64 (on the rule's grid), 100 (off it) and 150 tokens (its end)."""
    layer = make_layer(dtype, grouped=True, dv=dv)
    torch_layer = on_portable(layer)
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    saves = [(64, 5), (100, 6), (150, 7)]
    exact = copy.deepcopy(layer).float()  # float32 from the same (rounded) weights, state and inputs
    exact.platform = Platform.portable()
    exact.state = DeltaNetState(layer.state.conv.float(), layer.state.recurrent.clone())
    got, expected = (run_items(m, x, [150], slot=2, start=30, saves=saves) for m in (layer, torch_layer))
    reference = run_items(exact, x.float(), [150], slot=2, start=30, saves=saves)
    for row in (2, 5, 6, 7):
        assert torch.equal(layer.state.conv[row], torch_layer.state.conv[row]), row
    if dtype == torch.float32:
        assert_close(got, expected)
        for row in (2, 5, 6, 7):
            assert_states_close(layer.state.recurrent[row], torch_layer.state.recurrent[row], dtype)
    else:
        # 150 bf16 steps drift from float32 as far as the torch chunked rule's do, not further.
        for ours, theirs, exact_value in (
            (got, expected, reference),
            *((layer.state.recurrent[r], torch_layer.state.recurrent[r], exact.state.recurrent[r]) for r in (2, 5, 6, 7)),
        ):
            ours_off, theirs_off = ((t.float() - exact_value).norm() for t in (ours, theirs))
            assert ours_off <= 1.5 * theirs_off + 1e-6 * exact_value.norm(), (ours_off, theirs_off)
    assert torch.equal(layer.state.recurrent[7], layer.state.recurrent[2])  # the end's checkpoint is the final state


@pytest.mark.parametrize("dv", [32, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_gets_the_same_bits_however_it_is_split(dtype, dv):
    """40 tokens as one chunk, as 13 + 27, as 1 + 38 + 1 and as 40 decode steps: the same outputs,
    states and checkpoint (after 20 tokens) bit for bit. The torch chunked rule cannot promise this.
    (A decode step takes its state in two passes; a chunk shares one pass between a token's update
    and the next token's decay, but for the token before a checkpoint.)"""
    layer = make_layer(dtype, grouped=False, dv=dv)
    # torch's matmul is not batch invariant: the projections go row by row here
    layer.in_proj_qkvz, layer.in_proj_ba = RowByRow(layer.in_proj_qkvz), RowByRow(layer.in_proj_ba)
    start = DeltaNetState(layer.state.conv.clone(), layer.state.recurrent.clone())
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype)
    results = []
    for sizes in ([40], [13, 27], [1, 38, 1], [1] * 40):
        layer.state = DeltaNetState(start.conv.clone(), start.recurrent.clone())
        out = run_items(layer, x, sizes, slot=4, start=0, saves=[(20, 6)])
        results.append((out, layer.state.conv[[4, 6]].clone(), layer.state.recurrent[[4, 6]].clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_a_bad_cut_is_refused_and_nothing_is_written():
    layer = make_layer(torch.float32, grouped=False)
    before = (layer.state.conv.clone(), layer.state.recurrent.clone())
    x = torch.randn(6, HIDDEN)
    mixed, z = x.new_zeros(6, layer.conv_dim), x.new_zeros(6, layer.value_dim)
    b, a, out = x.new_zeros(6, layer.num_v_heads), x.new_zeros(6, layer.num_v_heads), x.new_zeros(6, layer.value_dim)
    state = layer.state
    for chunks, cuts, message in (
        ([(0, 6, 1)], [[(3, SLOTS)]], f"chunk 0 names state row {SLOTS}"),
        ([(0, 6, 1)], [[(7, 2)]], "chunk 0 names state row 2 .* a cut outside the chunk"),
        ([(0, 3, 1), (3, 4, 2)], [[], []], "chunk 1 starts at row 3: its rows are not all in the inputs' \\[0, 6\\)"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.deltanet_chunks(mixed, z, b, a, layer.conv1d.weight, state.conv, state.recurrent, chunks, cuts,
                                    layer.A_log, layer.dt_bias, layer.norm.weight, layer.num_k_heads, 1e-6, out)  # fmt: skip
    assert torch.equal(layer.state.conv, before[0]) and torch.equal(layer.state.recurrent, before[1])
