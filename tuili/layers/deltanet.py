"""Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention): a causal depthwise conv over the q/k/v
channels, then the gated delta rule, a recurrence over a per-head [Dk, Dv] state:

    S_t = exp(g_t) * S_{t-1}                                  (decay)
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T            (delta-rule write)
    o_t = S_t^T q_t

with q, k L2-normalised and q scaled by Dk^-0.5 (as the reference: transformers'
torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=True).
Everything inside the rule runs in float32, and the recurrent state is float32 whatever the
working dtype; the conv state is kept in the working dtype, as the reference keeps it.

Two forms of the rule compute the same thing:
- `chunk_gated_delta_rule`: one sequence's run of tokens (a prefill chunk), in blocks of
  `chunk_size` tokens with a few matmuls each, from an initial state to the final one, so a
  prompt may be split anywhere across steps;
- `recurrent_gated_delta_rule`: one token for each of a batch of sequences (decodes).
On a CUDA GPU with fla-core (`Platform.fla`) flash-linear-attention's Triton kernels run both
forms instead: its chunked kernel for all of a step's chunks at once, its fused recurrent one for
the decodes. Where tuili's native CPU kernels run, decodes and chunks take them (token by token).

Per-sequence state lives in fixed slots (`DeltaNetState`: [rows, ...] tensors, one pair per
layer, allocated by the runner; rows past the sequences' slots hold prefix-cache checkpoints);
`StateBatch` tells a step's layers which slot each sequence reads and writes, which slots start
from zero or from a checkpoint row, and where to copy a sequence's state out to a checkpoint row
(after its chunk, or after a given token inside it: read off the conv's input window, and
emitted by the chunked rule's scan at its block ends, or else by running the chunk in pieces
cut there). This module only computes: the weights come from outside (the projections are built by the loader's weight plan; conv1d, A_log, dt_bias and the
norm's weight are parameters filled by name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tuili import kernels
from tuili.layers.norm import GatedRMSNorm
from tuili.platform import Platform

L2NORM_EPS = 1e-6  # the reference's (FLA's) l2norm epsilon


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dimension, as FLA and the reference compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32, L2-normalised q and k, each k head repeated for its num_v_heads / num_k_heads
    consecutive value heads, q scaled by Dk^-0.5. Shapes [..., Hk, Dk] -> [..., Hv, Dk]."""
    per_k = num_v_heads // q.shape[-2]
    if per_k > 1:
        q, k = q.repeat_interleave(per_k, dim=-2), k.repeat_interleave(per_k, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one sequence's run of tokens (see chunk_gated_delta_rule_states)."""
    out, final, _ = chunk_gated_delta_rule_states(q, k, v, g, beta, state, (), chunk_size)
    return out, final


def chunk_gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    emit_at: tuple[int, ...],
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's L tokens, also returning the states after the first `emit_at` tokens
    (multiples of `chunk_size`, < L: block ends, where the scan holds them anyway; for prefix
    caching's state checkpoints). q, k: [L, Hk, Dk]; v: [L, Hv, Dv]; g (log decay, <= 0), beta:
    [L, Hv]; state: [Hv, Dk, Dv], the state before the first token. Returns (output [L, Hv, Dv]
    float32, the state after the last token, float32). Within a block of `chunk_size`
    tokens the delta-rule writes are condensed by the UT transform (a unit lower-triangular
    solve); blocks are scanned in order, each reading the state the previous one left."""
    length, num_v_heads, _ = v.shape
    q, k = _prepare_qk(q, k, num_v_heads)
    # [H, L, ...] float32
    q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))
    g, beta = g.transpose(0, 1).float(), beta.transpose(0, 1).float()
    pad = (chunk_size - length % chunk_size) % chunk_size
    if pad:  # zero-padded tokens (k = v = 0, g = 0) leave the state unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    n = (length + pad) // chunk_size
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(heads, n, chunk_size, -1) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, n, chunk_size).cumsum(-1)  # log of the decay from the block start to each token
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (masked before exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # strictly-lower part drives the UT transform
    intra = (q @ k.transpose(-1, -2)) * decay
    # The solve reads only the strict lower triangle (unit diagonal): new values u = T^-1 (beta v)
    # and the decayed keys that read the old state, w = T^-1 (beta k exp(cum)).
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty(heads, n, chunk_size, dv, dtype=torch.float32, device=q.device)
    s = state.float()
    emit = {position // chunk_size - 1 for position in emit_at}
    emitted = []
    for i in range(n):
        v_new = values[:, i] - keys_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
        if i in emit:
            emitted.append(s)
    out = out.reshape(heads, -1, dv)[:, :length].transpose(0, 1)
    assert s.shape == (heads, dk, dv) and len(emitted) == len(emit_at)
    return out, s, emitted


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv];
    state: [B, Hv, Dk, Dv]. Returns (output [B, Hv, Dv] float32, the new state float32)."""
    q, k = _prepare_qk(q, k, v.shape[1])
    s = state.float() * g.float().exp()[..., None, None]
    remembered = (s * k[..., None]).sum(dim=-2)  # S^T k: [B, Hv, Dv]
    delta = (v.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2), s


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L new inputs x [L, C] through the depthwise causal conv of width K
    (weight [C, K]) continuing from `state` [C, K-1] (the K-1 inputs before them; zeros at the
    start of a sequence), then SiLU. Returns (output [L, C] in x's dtype, the new state: the
    last K-1 inputs)."""
    window = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K-1+L]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]  # [C, L]
    # The new state is the last K-1 inputs (state width K-1 >= 1: the config asks K >= 2).
    return F.silu(out).to(x.dtype).transpose(0, 1), window[:, window.shape[1] - state.shape[1] :]


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], state [B, C, K-1] -> (output [B, C] in x's dtype,
    new state [B, C, K-1]). Accumulates in float32 and rounds once, as the conv kernel does."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    out = (window.float() * weight.float()).sum(dim=-1)
    return F.silu(out).to(x.dtype), window[..., 1:]


@dataclass
class StateBatch:
    """Which state slot each sequence of a step reads and writes, built once per step by the
    runner and shared by every linear-attention layer. Invariant: every row (token) of the step
    is in exactly one decode row or one chunk; each slot appears at most once; a checkpoint row
    is written at most once and, when it is also restored from, read before it is written."""

    fresh: torch.Tensor  # [F] int64: slots whose sequence's chunk starts at position 0 (zeroed first)
    decode_rows: torch.Tensor  # [D] int64: rows of single-token items
    decode_slots: torch.Tensor  # [D] int64: their slots
    chunks: list[tuple[int, int, int]]  # (first row, tokens, slot) of items of two tokens or more
    restore_rows: torch.Tensor  # [R] int64: checkpoint rows copied into ...
    restore_slots: torch.Tensor  # [R] int64: ... these slots before the step
    # (tokens into the chunk, checkpoint row) cut points inside a chunk, by the chunk's first row
    cuts: dict[int, list[tuple[int, int]]]
    save_slots: torch.Tensor  # [S] int64: slots whose state after the step is copied ...
    save_rows: torch.Tensor  # [S] int64: ... into these checkpoint rows

    @classmethod
    def build(
        cls, items: list[tuple[int, int, int, int]], device: torch.device,
        restores: list[tuple[int, int]] = (), saves: list[tuple[int, int, int]] = (),
    ) -> StateBatch:  # fmt: skip
        """From the step's items as (first row, first position, tokens, slot): a chunk starting
        at position 0 zeroes its slot first; single-token items are stepped together.
        `restores`: (slot, checkpoint row) to start from; `saves`: (item's first row, tokens
        into the item, checkpoint row) to copy the state out to, 0 < tokens <= the item's."""
        fresh = [slot for _, start, _, slot in items if start == 0]
        decodes = [(row, slot) for row, _, n, slot in items if n == 1]
        chunks = [(row, n, slot) for row, _, n, slot in items if n > 1]
        length = {row: (n, slot) for row, _, n, slot in items}
        cuts: dict[int, list[tuple[int, int]]] = {}
        ends: list[tuple[int, int]] = []
        for first, offset, row in saves:
            n, slot = length[first]
            if offset == n:
                ends.append((slot, row))
            else:
                cuts.setdefault(first, []).append((offset, row))

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        return cls(
            column(fresh), column([r for r, _ in decodes]), column([s for _, s in decodes]), chunks,
            column([r for _, r in restores]), column([s for s, _ in restores]),
            {first: sorted(points) for first, points in cuts.items()},
            column([s for s, _ in ends]), column([r for _, r in ends]),
        )  # fmt: skip


@dataclass
class DeltaNetState:
    """One layer's per-sequence state in fixed slots: the conv's last K-1 inputs [slots, C, K-1]
    (working dtype) and the recurrent state [slots, Hv, Dk, Dv] (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def allocate(
        cls, num_slots: int, conv_dim: int, kernel: int, heads: tuple[int, int, int], dtype: torch.dtype,
        device: torch.device,
    ) -> DeltaNetState:  # fmt: skip
        num_v_heads, dk, dv = heads
        return cls(
            torch.zeros(num_slots, conv_dim, kernel - 1, dtype=dtype, device=device),
            torch.zeros(num_slots, num_v_heads, dk, dv, dtype=torch.float32, device=device),
        )


class CausalConv1d(nn.Module):
    """Holds the depthwise conv's weight as the checkpoint stores it ([C, 1, K], `conv1d.weight`)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer over a flat batch of sequences. Two input projections:
    `in_proj_qkvz` yields q, k, v (the conv's channels) and the output gate z; `in_proj_ba` yields
    the write strength b and the decay input a, one each per value head. Their rows come in one of
    two layouts (`grouped_by_key_head`):

    - grouped (Qwen3-Next's in_proj_qkvz / in_proj_ba as stored): per key head [q (Dk), k (Dk),
      v (r*Dv), z (r*Dv)] and [b (r), a (r)], with r = Hv / Hk value heads per key head;
    - flat (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, stacked by the weight plan in
      that order): [q (Hk*Dk), k (Hk*Dk), v (Hv*Dv), z (Hv*Dv)] and [b (Hv), a (Hv)], so q, k, v
      are already the conv's channel order.

    The rest (conv, rule, gated norm, out_proj) is the same in both. Module names are Qwen3-Next's
    checkpoint names."""

    def __init__(
        self,
        in_proj_qkvz: nn.Module,
        in_proj_ba: nn.Module,
        out_proj: nn.Module,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        platform: Platform,
        grouped_by_key_head: bool = True,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.grouped_by_key_head = grouped_by_key_head
        self.in_proj_qkvz, self.in_proj_ba, self.out_proj = in_proj_qkvz, in_proj_ba, out_proj
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.platform = platform
        # Bound by the runner once the state slots exist.
        self.state: DeltaNetState | None = None

    def state_shapes(self) -> tuple[int, int, tuple[int, int, int]]:
        """(conv channels, conv width, (Hv, Dk, Dv)): what DeltaNetState.allocate needs."""
        return self.conv_dim, self.conv_kernel, (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        state = self.state
        assert state is not None, "the runner binds the state slots before the first forward"
        tokens = x.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.grouped_by_key_head:
            r = hv // hk
            qkvz = self.in_proj_qkvz(x).view(tokens, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
            b, a = self.in_proj_ba(x).view(tokens, hk, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
            # rows of contiguous values, as the flat layout's views have
            z, b, a = (t.reshape(tokens, -1).contiguous() for t in (z, b, a))
        else:
            mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).split([hv, hv], dim=-1)

        if batch.fresh.numel():  # a sequence starting at position 0 starts from zero state
            state.conv.index_fill_(0, batch.fresh, 0)
            state.recurrent.index_fill_(0, batch.fresh, 0)
        if batch.restore_slots.numel():  # a prefix-cache hit starts from the checkpoint's state
            state.conv[batch.restore_slots] = state.conv[batch.restore_rows]
            state.recurrent[batch.restore_slots] = state.recurrent[batch.restore_rows]
        # Rows [tokens, Hv * Dv] of the gated norm's output, the out projection's input.
        normed = torch.empty(tokens, self.value_dim, dtype=x.dtype, device=x.device)
        if batch.decode_rows.numel():
            self._decode(mixed, z, b, a, batch.decode_rows, batch.decode_slots, normed)
        if batch.chunks and self.platform.native(mixed, state.conv):
            # Token by token, decode's arithmetic: a prompt's bits do not depend on its split
            # into chunks, and on CPUs it is faster than the chunked rule (docs/kernels.md).
            kernels.deltanet_chunks(
                mixed, z, b, a, self.conv1d.weight, state.conv, state.recurrent, batch.chunks,
                [batch.cuts.get(first, []) for first, _, _ in batch.chunks], self.A_log, self.dt_bias,
                self.norm.weight, self.num_k_heads, self.norm.eps, normed,
            )  # fmt: skip
        elif batch.chunks and self.platform.batch_invariant and mixed.is_cpu:
            # The portable path's batch-invariant mode: decode's torch step, token by token.
            for first, n, slot in batch.chunks:
                self._token_by_token(mixed, z, b, a, first, n, slot, batch.cuts.get(first, ()), normed)
        elif batch.chunks and self.platform.fla:
            self._fla_chunks(mixed, z, b, a, batch, normed)
        else:
            for first, n, slot in batch.chunks:
                rows = slice(first, first + n)
                out = self._chunk(mixed[rows], b[rows], a[rows], slot, batch.cuts.get(first, ()))
                self._write_normed(out, z, rows, normed)
        if batch.save_slots.numel():  # checkpoints at the end of an item: the slot's new state
            state.conv[batch.save_rows] = state.conv[batch.save_slots]
            state.recurrent[batch.save_rows] = state.recurrent[batch.save_slots]
        return self.out_proj(normed)

    def _write_normed(self, out: torch.Tensor, z: torch.Tensor, rows: slice | torch.Tensor, normed: torch.Tensor) -> None:
        """The gated norm of the rule's output `out` [len(rows), Hv, Dv] (any dtype) by the gate z
        of the same rows, in the model's dtype, written to those rows of `normed` [T, Hv * Dv]."""
        dv = self.head_v_dim
        gated = self.norm(out.to(normed.dtype).reshape(-1, dv), z[rows].reshape(-1, dv))
        normed[rows] = gated.view(-1, self.value_dim)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g): the write strength and the log decay of each row and value head."""
        # float32 as the reference: in fp16/bf16 exp(A_log) and the softplus would lose the decay
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [T, C] as q, k [T, Hk, Dk] and v [T, Hv, Dv]."""
        tokens = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.view(tokens, self.num_k_heads, self.head_k_dim), k.view(tokens, self.num_k_heads, self.head_k_dim),
                v.view(tokens, self.num_v_heads, self.head_v_dim))  # fmt: skip

    def _decode(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, rows: torch.Tensor,
        slots: torch.Tensor, normed: torch.Tensor,
    ) -> None:  # fmt: skip
        """The single-token rows `rows` (state in `slots`): conv step, recurrent rule and gated
        norm, written to those rows of `normed`. One native call where the kernels run (it
        rounds where this torch code rounds)."""
        state = self.state
        assert state is not None
        if self.platform.native(mixed, state.conv):
            kernels.deltanet_decode(
                mixed, z, b, a, self.conv1d.weight, state.conv, state.recurrent, rows, slots, self.A_log,
                self.dt_bias, self.norm.weight, self.num_k_heads, self.norm.eps, normed,
            )  # fmt: skip
            return
        self._step(mixed, z, b, a, rows, slots, normed)

    def _step(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, rows: torch.Tensor,
        slots: torch.Tensor, normed: torch.Tensor,
    ) -> None:  # fmt: skip
        """`_decode` in torch: each of `rows` one token on from the state in its slot; the rule
        in flash-linear-attention's fused recurrent kernel where the platform has it."""
        state = self.state
        assert state is not None
        conv, state.conv[slots] = causal_conv1d_step(mixed[rows], state.conv[slots], self.conv1d.weight[:, 0])
        q, k, v = self._split_heads(conv)
        beta, g = self._gates(b[rows], a[rows])
        if self.platform.fla:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            # each sequence a batch row of one token: [B, 1, H, D]
            o, state.recurrent[slots] = fused_recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None].to(v.dtype),
                initial_state=state.recurrent[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            o = o[:, 0]
        else:
            o, state.recurrent[slots] = recurrent_gated_delta_rule(q, k, v, g, beta, state.recurrent[slots])
        self._write_normed(o, z, rows, normed)

    def _token_by_token(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, first: int, n: int, slot: int,
        cuts: list[tuple[int, int]], normed: torch.Tensor,
    ) -> None:  # fmt: skip
        """One sequence's chunk (rows first .. first + n - 1) as n decode steps, the state after
        `offset` tokens copied to checkpoint row `row` for each cut: the chunk's bits are a
        decode's, whatever the split (the native kernel's rule, in torch)."""
        state = self.state
        assert state is not None
        slots = torch.tensor([slot], device=mixed.device)
        copies = dict(cuts)
        for i in range(n):
            self._step(mixed, z, b, a, torch.tensor([first + i], device=mixed.device), slots, normed)
            if (row := copies.get(i + 1)) is not None:
                state.conv[row] = state.conv[slot]
                state.recurrent[row] = state.recurrent[slot]

    def _chunk(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slot: int, cuts: list[tuple[int, int]],
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's chunk of n >= 2 tokens (the rows of mixed, b, a) from the state in
        `slot`, left there after it: the conv, then the chunked rule, with state checkpoints
        taken at `cuts` (tokens into the chunk, checkpoint row). Returns the rule's float32
        output [n, Hv, Dv]."""
        n = mixed.shape[0]
        state = self.state
        assert state is not None
        q, k, v = self._split_heads(self._conv_chunk(mixed, slot, cuts))
        beta, g = self._gates(b, a)
        out = torch.empty(n, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=mixed.device)
        carried = state.recurrent[slot]
        for begin, end, emits, row in _pieces(0, n, cuts):
            span = slice(begin, end)
            out[span], carried, emitted = chunk_gated_delta_rule_states(
                q[span], k[span], v[span], g[span], beta[span], carried, tuple(e for e, _ in emits),
            )  # fmt: skip
            for (_, emit_row), emitted_state in zip(emits, emitted, strict=True):
                state.recurrent[emit_row] = emitted_state
            if row is not None:
                state.recurrent[row] = carried
        state.recurrent[slot] = carried
        return out

    def _conv_chunk(self, mixed: torch.Tensor, slot: int, cuts: list[tuple[int, int]]) -> torch.Tensor:
        """One sequence's chunk (the rows of mixed) through the conv from the conv state in `slot`,
        left there after it, with the conv state at each cut (tokens into the chunk, checkpoint
        row) copied to its row. Returns the conv's output [n, C]."""
        state = self.state
        assert state is not None
        before = state.conv[slot]  # a view: read before the slot is overwritten below
        if cuts:  # the conv state after o tokens: the K-1 inputs before token o
            window = torch.cat([before.to(mixed.dtype), mixed.transpose(0, 1)], dim=-1)
            for offset, row in cuts:
                state.conv[row] = window[:, offset : offset + before.shape[1]]
        conv, state.conv[slot] = causal_conv1d(mixed, before, self.conv1d.weight[:, 0])
        return conv

    def _fla_chunks(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, batch: StateBatch,
        normed: torch.Tensor,
    ) -> None:  # fmt: skip
        """The step's chunks through flash-linear-attention's chunked kernel, all sequences in one
        variable-length call. Its kernel returns only final states, so a chunk with checkpoint
        cuts is run as pieces ending at them: round j runs the j-th piece of every chunk (most
        steps have no cuts: one round), each from the state the previous round left in the slot."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        state = self.state
        assert state is not None
        conv = torch.empty_like(mixed)
        pieces: list[list[tuple[int, int, int, int | None]]] = []  # per chunk: (begin, end, slot, row)
        for first, n, slot in batch.chunks:
            cuts = batch.cuts.get(first, [])
            conv[first : first + n] = self._conv_chunk(mixed[first : first + n], slot, cuts)
            # a block grid longer than the chunk: every cut ends a piece, none is emitted inside one
            pieces.append([(begin, end, slot, row) for begin, end, _, row in _pieces(first, n, cuts, n + 1)])
        for round_ in range(max(len(p) for p in pieces)):
            run = [p[round_] for p in pieces if len(p) > round_]
            rows = torch.cat([torch.arange(begin, end) for begin, end, _, _ in run]).to(mixed.device)
            lengths = torch.tensor([0] + [end - begin for begin, end, _, _ in run])
            slots = torch.tensor([slot for _, _, slot, _ in run], device=mixed.device)
            q, k, v = self._split_heads(conv[rows])
            beta, g = self._gates(b[rows], a[rows])
            out, final = fla_chunk(
                q[None], k[None], v[None], g[None], beta[None].to(v.dtype), initial_state=state.recurrent[slots],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=lengths.cumsum(0).to(mixed.device), cu_seqlens_cpu=lengths.cumsum(0),
            )  # fmt: skip
            state.recurrent[slots] = final
            for i, (_, _, _, row) in enumerate(run):
                if row is not None:
                    state.recurrent[row] = final[i]
            self._write_normed(out[0], z, rows, normed)


def _pieces(
    first: int, n: int, cuts: list[tuple[int, int]], chunk_size: int = 64,
) -> list[tuple[int, int, list[tuple[int, int]], int | None]]:  # fmt: skip
    """The chunk of rows [first, first + n) as pieces (begin, end, states to emit inside it as
    (tokens into the piece, checkpoint row), checkpoint row of its final state or None) for the
    chunked rule: a cut on the piece's block grid is emitted by the scan (no extra work); any
    other cut ends the piece there. With checkpoints every multiple of 64 tokens, a chunk is at
    most two pieces: up to its first cut, then the rest."""
    pieces, begin, emits = [], first, []
    for offset, row in cuts:
        position = first + offset
        if (position - begin) % chunk_size == 0:
            emits.append((position - begin, row))
        else:
            pieces.append((begin, position, emits, row))
            begin, emits = position, []
    pieces.append((begin, first + n, emits, None))
    return pieces
