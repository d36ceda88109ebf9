"""MTP proposals: the target checkpoint's own multi-token-prediction layers (`mtp.*`, Qwen3-Next
and Qwen3.5) guess the next tokens from the target's last hidden state (tuili/models/mtp.py for
the math, as vLLM runs it).

The MTP layer's KV cache sits beside the target's: one key and one value tensor per MTP layer,
indexed by the target's block tables (the same blocks and slots), so it is freed, trimmed,
preempted and shared by prefix with the target's blocks, and costs no block manager of its own.
Its entry at position p is computed from the target's hidden state at p and the token at p + 1,
so it is written once that token is known:

* `observe`, after every target forward: each scheduled item's positions whose next token is now
  known (a prompt chunk's, up to the token just sampled; a verification chunk's, up to the last
  accepted position) run one MTP forward with the target's hidden states of those rows. The
  output at a sequence's last position is kept: its logits are the first proposal.
* `propose`, before the next step: the first proposal is the arg-max of the kept output's logits;
  each further one repeats the step on the MTP's own output and the proposal before it, at the
  next position. Those positions lie past what the target computed: their KV goes to the
  sequence's partly filled last block (slots nobody else reads: a block is shared only once full)
  and beyond it to scratch blocks after the pool's, and the next `observe` overwrites them with
  the accepted tokens' entries.

Proposals are arg-max (point masses, as vLLM's MTP): greedy verification keeps them when the
target agrees; sampled requests' rejection sampling treats them as prompt lookup's, so outputs
keep the target's distribution. A prefix-cache hit reuses the MTP entries of the shared blocks,
computed by the sequence that filled them (exact except at a block's last position, whose next
token may differ: proposals may then be worse, outputs never change). The host tier does not
spill MTP entries: a block brought back from it has stale ones, with the same consequence.
"""

from __future__ import annotations

import logging

import torch

from tuili.engine.pool import PoolPlan
from tuili.engine.request import Sequence
from tuili.engine.runner import ModelRunner
from tuili.engine.scheduler import ScheduledSeq
from tuili.engine.spec.verify import Proposal
from tuili.errors import TuiliError
from tuili.layers.attention import KVCache
from tuili.layers.sampler import SampledToken

logger = logging.getLogger(__name__)


class MTPProposer:
    def __init__(self, runner: ModelRunner, pool: PoolPlan, max_k: int, max_num_seqs: int, source: str) -> None:
        model = runner.model
        if getattr(model, "mtp", None) is None:
            raise TuiliError(
                f"speculative_config method='mtp' needs a checkpoint with multi-token-prediction weights (mtp.*): "
                f"{source} ({model.config.architecture}) has none"
            )
        self.runner = runner
        self.model = model
        self.mtp = model.build_mtp()
        runner.keep_hidden_states()
        cfg = model.config
        self.block_size = bs = pool.block_size
        # A chain of k proposals writes positions L .. L + k - 2 past the target's last computed
        # one (L - 1): at most (k - 2) // bs + 1 blocks past the sequence's own, per sequence.
        self.scratch_per_seq = max(1, (max_k - 2) // bs + 1)
        self.first_scratch = pool.num_blocks
        num_blocks = pool.num_blocks + max_num_seqs * self.scratch_per_seq
        shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        device = runner.device
        for attn in self.mtp.attention_layers():
            attn.kv_cache = KVCache.allocate(shape, pool.kv_dtype, device)
        element = torch.empty((), dtype=pool.kv_dtype).element_size()
        kv_bytes = 2 * len(self.mtp.layers) * num_blocks * bs * cfg.num_kv_heads * cfg.head_dim * element
        logger.info(
            "mtp: %d multi-token-prediction layer(s), their KV beside the target's pool (%.1f MiB)",
            len(self.mtp.layers), kv_bytes / 2**20,
        )  # fmt: skip
        # by seq_id: the MTP output at the sequence's last computed position, and that position
        self._last: dict[int, tuple[torch.Tensor, int]] = {}

    def weight_bytes(self) -> int:
        """Bytes of weights one MTP step reads (its layers and fc; the output head is the target's)."""
        tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                   for t in (*self.mtp.parameters(), *self.mtp.buffers())}  # fmt: skip
        return sum(tensors.values())

    @torch.inference_mode()
    def observe(self, batch: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        """After a target forward over `batch` (its new tokens `sampled`, per sampling item):
        write the MTP entries of every position whose next token is known, keep each sampling
        sequence's last output."""
        hidden = self.runner.hidden_states
        assert hidden is not None, "the runner keeps hidden states for the MTP proposer"
        items: list[ScheduledSeq] = []
        rows: list[int] = []
        new_tokens = iter(sampled)
        row = 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            new = [t.token_id for t in next(new_tokens)] if item.samples else []
            if seq.pooling is None:
                # A verification chunk keeps its last token and the accepted proposals (one
                # position per emitted token); any other chunk all of its positions.
                m = len(new) if item.draft else n
                items.append(ScheduledSeq(_shifted(seq, seq.token_ids + new), item.start, m, item.samples))
                rows.extend(range(row, row + m))
            row += n
        if not items:
            return
        next_ids, positions, meta, last_rows = self.runner.prepare(items)
        out = self.model.mtp_forward(self.mtp, next_ids, positions, hidden[rows], meta)
        for item, r in zip([i for i in items if i.samples], last_rows.tolist(), strict=True):
            self._last[item.seq.seq_id] = (out[r], item.start + item.num_tokens - 1)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        # Sequences whose kept output is at their last computed position (L - 1, L the last token).
        active = [i for i, seq in enumerate(seqs)
                  if (kept := self._last.get(seq.seq_id)) is not None and kept[1] == seq.num_tokens - 2]
        if not active:
            return proposals
        scratch = {i: self.first_scratch + n * self.scratch_per_seq for n, i in enumerate(active)}
        hidden = torch.stack([self._last[seqs[i].seq_id][0] for i in active])
        step = 0
        while True:
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, tokens, strict=True):
                proposals[i].token_ids.append(token)
            keep = [j for j, i in enumerate(active) if len(proposals[i].token_ids) < ks[i]]
            if not keep:
                return proposals
            active, hidden, step = [active[j] for j in keep], hidden[keep], step + 1
            # Step `step` at position L - 1 + step: the proposal before it and the previous output.
            items = []
            for i in active:
                seq = seqs[i]
                position = seq.num_tokens - 2 + step
                own = -(-(seq.num_tokens - 1) // self.block_size)  # blocks holding positions < L
                table = seq.block_table[:own] + list(range(scratch[i], scratch[i] + self.scratch_per_seq))
                view = _shifted(seq, seq.token_ids + proposals[i].token_ids, table)
                items.append(ScheduledSeq(view, position, 1, True))
            next_ids, positions, meta, _ = self.runner.prepare(items)
            hidden = self.model.mtp_forward(self.mtp, next_ids, positions, hidden, meta, step)

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        return [0] * len(seqs)  # observe() keeps every sequence's output current

    def take_forward_times(self) -> list[tuple[int, float]] | None:
        return None

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.seq_id, None)


def _shifted(seq: Sequence, tokens: list[int], block_table: list[int] | None = None) -> Sequence:
    """A view of `seq` whose token at position p is tokens[p + 1] (the MTP's input at p is the
    token after it), on `block_table` (default the sequence's)."""
    return Sequence(
        seq.seq_id, seq.request_id, seq.index, tokens[1:], seq.prompt_len, seq.params,
        block_table=seq.block_table if block_table is None else block_table, state_slot=seq.state_slot,
    )  # fmt: skip
