"""tuili's Gated DeltaNet pieces (tuili/layers/deltanet.py) against transformers' Qwen3-Next
reference functions and modules on random inputs: the chunked and recurrent forms of the gated
delta rule (with an initial state, and Hv != Hk), the causal conv with its carried state, the
gated and zero-centred RMSNorms, and the whole token mixer over a flat batch whose sequences are
split at odd positions across steps and then decoded, equal to the unsplit reference."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as ref

from tuili.layers.deltanet import (
    DeltaNetState,
    GatedDeltaNet,
    StateBatch,
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tuili.layers.linear import Linear
from tuili.layers.norm import GatedRMSNorm, OffsetRMSNorm
from tuili.platform import Platform

TOL = dict(atol=2e-5, rtol=1e-4)


def _inputs(length: int, hk: int, hv: int, dk: int = 16, dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, hk, dk, generator=gen)
    k = torch.randn(length, hk, dk, generator=gen)
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(length, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("hk", "hv"), [(2, 2), (2, 4)])
def test_chunked_rule_matches_reference_and_splits_anywhere(hk, hv):
    q, k, v, g, beta, state = _inputs(150, hk, hv)
    want, want_state = ref.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want[0], **TOL)
    torch.testing.assert_close(final, want_state[0], **TOL)
    # The same prompt in pieces at odd positions, each continuing from the last one's state.
    pieces, s = [], state
    for a, b in [(0, 1), (1, 8), (8, 73), (73, 150)]:
        o, s = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces), want[0], **TOL)
    torch.testing.assert_close(s, want_state[0], **TOL)


def test_recurrent_rule_matches_reference_for_a_batch():
    batch = [_inputs(1, 2, 4, seed=i) for i in range(3)]
    q, k, v, g, beta = (torch.cat([b[i] for b in batch]) for i in range(5))
    state = torch.stack([b[5] for b in batch])
    want, want_state = ref.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, new = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want[:, 0], **TOL)
    torch.testing.assert_close(new, want_state, **TOL)


def test_conv_with_carried_state_matches_reference():
    gen = torch.Generator().manual_seed(1)
    channels, kernel, length = 12, 4, 11
    x, weight = torch.randn(length, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    want = ref.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    state = torch.zeros(channels, kernel - 1)
    parts = []
    for a, b in [(0, 2), (2, 7)]:  # two prefill pieces, then decodes one token at a time
        o, state = causal_conv1d(x[a:b], state, weight)
        parts.append(o)
    for t in range(7, length):
        o, new = causal_conv1d_step(x[t][None], state[None], weight)
        state = new[0]
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts), want, **TOL)
    # and the reference's one-token update from the same state
    ref_state = torch.cat([torch.zeros(channels, 1), x[length - 4 : length - 1].T], dim=-1)[None].clone()
    step_ref = ref.causal_conv1d_update(x[length - 1][None, :, None], ref_state, weight, None, "silu")[0, :, 0]
    torch.testing.assert_close(parts[-1][0], step_ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("platform", [Platform.portable(), Platform.detect()], ids=["torch", "here"])
def test_norms_match_reference(dtype, platform):
    """The offset norm on this machine runs the native kernel (the `offset` form of rms_norm),
    with and without the residual add."""
    gen = torch.Generator().manual_seed(2)
    x, gate = torch.randn(5, 16, generator=gen).to(dtype), torch.randn(5, 16, generator=gen).to(dtype)
    weight = torch.randn(16, generator=gen).to(dtype)
    gated, want_gated = GatedRMSNorm(16, 1e-6), ref.Qwen3NextRMSNormGated(16, eps=1e-6)
    offset, want_offset = OffsetRMSNorm(16, 1e-6, platform), ref.Qwen3NextRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        for module in (gated, want_gated, offset, want_offset):
            module.to(dtype).weight.copy_(weight)
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else TOL
    torch.testing.assert_close(gated(x, gate), want_gated(x, gate), **exact)
    torch.testing.assert_close(offset(x), want_offset(x), **exact)
    residual = gate.clone()
    normed, residual = offset(x, residual)
    torch.testing.assert_close(residual, x + gate, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_offset(x + gate), **exact)


# The mixer runs on the CPU (native kernels where they build), on a CUDA GPU in torch, and on a
# CUDA GPU through flash-linear-attention's Triton kernels (fla-core installed); the reference
# always runs on the CPU in float32. fla's triangular solve multiplies in TF32: a looser bound.
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_FLA = pytest.mark.skipif(
    not (torch.cuda.is_available() and Platform.detect("cuda").fla), reason="needs a CUDA GPU and fla-core"
)
MIXER_PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda-torch", id="cuda-torch", marks=_CUDA),
    pytest.param("cuda-fla", id="cuda-fla", marks=_FLA),
]
MIXER_TOL = {
    "cpu": dict(atol=5e-5, rtol=1e-4),
    "cuda-torch": dict(atol=1e-4, rtol=1e-4),
    "cuda-fla": dict(atol=5e-3, rtol=5e-3),
}


def _mixer_platform(name: str) -> Platform:
    platform = {"cpu": Platform.detect, "cuda-torch": Platform.portable, "cuda-fla": Platform.detect}[name]
    made = platform(torch.device(name.split("-")[0]))
    assert made.fla == (name == "cuda-fla")
    return made


def _mixer_pair(hk: int, hv: int, where: str = "cpu") -> tuple[GatedDeltaNet, ref.Qwen3NextGatedDeltaNet]:
    torch.manual_seed(3)
    config = transformers.Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, num_attention_heads=2,
    )  # fmt: skip
    theirs = ref.Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    platform = _mixer_platform(where)

    def lin(m: torch.nn.Linear) -> Linear:
        return Linear.holding(m.weight.detach().clone().to(platform.device), None, platform)

    ours = GatedDeltaNet(
        lin(theirs.in_proj_qkvz), lin(theirs.in_proj_ba), lin(theirs.out_proj), hk, hv, 8, 8, 4, 1e-6, platform
    )
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if not k.startswith(("in_proj", "out_proj"))}, strict=False)
    return ours.to(platform.device), theirs


@pytest.mark.parametrize("where", MIXER_PLATFORMS)
@pytest.mark.parametrize(("hk", "hv"), [(2, 2), (1, 4)])
def test_mixer_over_split_prompts_and_decodes_matches_reference(hk, hv, where):
    """Two sequences in slots 2 and 0: A's 13 tokens as chunks 5 + 3 + 5 then 3 decodes, B's 9
    tokens as 1 + 8 then 4 decodes, scheduled together (mixed steps); every output row equals
    the reference run over the whole sequence at once."""
    ours, theirs = _mixer_pair(hk, hv, where)
    device = ours.platform.device
    conv_dim, kernel, heads = ours.state_shapes()
    ours.state = DeltaNetState.allocate(3, conv_dim, kernel, heads, torch.float32, device)
    ours.state.recurrent.fill_(7.0)  # garbage from an earlier sequence: a fresh start must clear it
    ours.state.conv.fill_(7.0)
    gen = torch.Generator().manual_seed(4)
    seqs = {2: torch.randn(16, 32, generator=gen), 0: torch.randn(13, 32, generator=gen)}
    # steps: per slot, (start, length)
    steps = [{2: (0, 5), 0: (0, 1)}, {2: (5, 3), 0: (1, 8)}, {2: (8, 5), 0: (9, 1)}, {2: (13, 1), 0: (10, 1)},
             {2: (14, 1), 0: (11, 1)}, {2: (15, 1), 0: (12, 1)}]  # fmt: skip
    got = {slot: [] for slot in seqs}
    with torch.no_grad():
        for step in steps:
            rows, items = [], []
            for slot, (start, n) in step.items():
                items.append((sum(r.shape[0] for r in rows), start, n, slot))
                rows.append(seqs[slot][start : start + n])
            batch = StateBatch.build(items, device)
            out = ours(torch.cat(rows).to(device), batch).cpu()
            first = 0
            for slot, (_, n) in step.items():
                got[slot].append(out[first : first + n])
                first += n
        for slot, x in seqs.items():
            torch.testing.assert_close(torch.cat(got[slot]), theirs(x[None])[0], **MIXER_TOL[where])


@pytest.mark.parametrize("where", MIXER_PLATFORMS)
def test_checkpoints_taken_inside_and_after_chunks_restore_to_the_same_rows(where):
    """Prefix caching's state checkpoints (rows after the slots): A's 13-token chunk is cut at
    token 5 (checkpoint row 2) and its state after it copied to row 3; a decode of token 13
    saves row 4. Sequences restored from rows 2 and 4 into slot 1 continue exactly as the
    reference run over the whole sequence."""
    ours, theirs = _mixer_pair(1, 4, where)
    dev, tol = ours.platform.device, MIXER_TOL[where]
    conv_dim, kernel, heads = ours.state_shapes()
    ours.state = DeltaNetState.allocate(2 + 3, conv_dim, kernel, heads, torch.float32, dev)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = theirs(x[None])[0]
        got = ours(x[:13].to(dev), StateBatch.build([(0, 0, 13, 0)], dev, saves=[(0, 5, 2), (0, 13, 3)]))
        torch.testing.assert_close(got.cpu(), want[:13], **tol)
        torch.testing.assert_close(ours.state.recurrent[3], ours.state.recurrent[0], atol=0, rtol=0)
        got = ours(x[13:14].to(dev), StateBatch.build([(0, 13, 1, 0)], dev, saves=[(0, 1, 4)]))
        torch.testing.assert_close(got.cpu(), want[13:14], **tol)
        for row, depth in ((2, 5), (4, 14)):
            ours.state.recurrent[1].fill_(7.0)  # garbage in the slot: the restore must replace it
            got = ours(x[depth:].to(dev), StateBatch.build([(0, depth, 20 - depth, 1)], dev, restores=[(1, row)]))
            torch.testing.assert_close(got.cpu(), want[depth:], **tol)


@pytest.mark.parametrize("where", MIXER_PLATFORMS)
def test_checkpoints_on_the_rule_block_grid_are_emitted_by_the_scan(where):
    """Cuts at 64 and 128 tokens (block ends of the chunked rule: emitted, no extra pieces) and
    at 100 (a piece of its own): each restored state continues as the reference run. Then a
    chunk that starts 2 tokens before a cut (its conv state still holds inputs of the step
    before) and a decode continue from it."""
    ours, theirs = _mixer_pair(2, 2, where)
    dev, tol = ours.platform.device, MIXER_TOL[where]
    conv_dim, kernel, heads = ours.state_shapes()
    ours.state = DeltaNetState.allocate(2 + 3, conv_dim, kernel, heads, torch.float32, dev)
    x = torch.randn(150, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = theirs(x[None])[0]
        x = x.to(dev)
        got = ours(x, StateBatch.build([(0, 0, 150, 0)], dev, saves=[(0, 64, 2), (0, 100, 3), (0, 128, 4)]))
        torch.testing.assert_close(got.cpu(), want, **tol)
        for row, depth in ((2, 64), (3, 100), (4, 128)):
            got = ours(x[depth:], StateBatch.build([(0, depth, 150 - depth, 1)], dev, restores=[(1, row)]))
            torch.testing.assert_close(got.cpu(), want[depth:], **tol)
        ours(x[:62], StateBatch.build([(0, 0, 62, 0)], dev))
        ours(x[62:70], StateBatch.build([(0, 62, 8, 0)], dev, saves=[(0, 2, 2)]))
        got = ours(x[64:], StateBatch.build([(0, 64, 86, 1)], dev, restores=[(1, 2)]))
        torch.testing.assert_close(got.cpu(), want[64:], **tol)
