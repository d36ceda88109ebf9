"""Continuous batching with chunked prefill, first come first served, preemption by recompute.

Every step, `schedule()` spends a token budget (`max_num_batched_tokens`):
  1. running sequences first, oldest first: one token each when decoding, or the next
     slice of a prompt being prefilled in chunks;
  2. then waiting sequences, oldest first, while budget, sequence slots and KV blocks last.
     A waiting sequence that does not fit stops admission (no overtaking), so arrival order
     is kept.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue with
`num_computed_tokens = 0`, to recompute prompt and generated tokens later. Its sampled
tokens are kept, so the resumed output is the same as an uninterrupted run.

Hybrid models (linear attention beside full attention): a sequence also holds a state slot
while it runs (StateSlots), taken at admission and returned with its blocks on finish, abort and
preemption; max_num_seqs is never more than the slots, so admission never waits on one.

The scheduler knows no tensors: it works on Sequence, BlockManager and StateSlots (ids) only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tuili.engine.block_manager import BlockCopies, BlockManager
from tuili.engine.request import Sequence, SequenceStatus
from tuili.engine.state_slots import StateSlots


@dataclass(frozen=True)
class ScheduledSeq:
    """This step computes `seq.token_ids[start : start + num_tokens]`; `samples` is True when
    that reaches the end of the sequence, so the last logits pick a new token. Fixed when
    scheduled, so it stays true after the sequence advances."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @classmethod
    def next_chunk(cls, seq: Sequence, num_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)  # host-tier copies to run first

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def split_prefill_decode(self) -> tuple[list[tuple[int, int]], list[int]]:
        """This step as prefill chunks (tokens cached before, chunk length) and decode context
        lengths (including the new token). A decode computes one generated token; anything
        else, including the recompute of generated tokens after a preemption, is prefill."""
        chunks, decodes = [], []
        for item in self.scheduled:
            if item.num_tokens == 1 and item.start >= item.seq.prompt_len:
                decodes.append(item.start + 1)
            else:
                chunks.append((item.start, item.num_tokens))
        return chunks, decodes


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
        state_slots: StateSlots | None = None,
    ) -> None:  # fmt: skip
        if state_slots is not None and max_num_seqs > state_slots.num_slots:
            raise ValueError(f"max_num_seqs={max_num_seqs} exceeds the {state_slots.num_slots} state slots")
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.state_slots = state_slots  # hybrid models only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by arrival

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        scheduled_ids: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, scheduled_ids, out):
                continue  # seq itself was preempted
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            match = self.blocks.match_prefix(seq)
            seq.num_computed_tokens = match.tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.free(seq)  # the matched blocks stay cached for the next try
                seq.num_computed_tokens = 0
                break
            self.blocks.record_query(seq, match)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = match.tokens
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            if self.state_slots is not None:
                self.state_slots.take(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
            budget -= n
        out.copies = self.blocks.take_copies()
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` can hold `num_tokens`.
        Returns False when `seq` itself had to be preempted."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            assert victim.seq_id not in scheduled_ids, "victims come from the unscheduled tail"
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)  # recompute restarts the state from zero
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens are now in the KV cache (call after the forward)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.register_full_blocks(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
