"""Continuous batching with chunked prefill, fair across groups, preemption by recompute.

A sequence belongs to a group (`Sequence.group`: the server's API call, by default its
request), and groups share a step fairly: with G groups running or waiting, each is owed
1/G of the step's token budget (`max_num_batched_tokens`) and of the sequence slots
(`max_num_seqs`). With one group everything below reduces to first come, first served.

Every step, `schedule()`:
  0. makes slots: when every slot is taken and a waiting group holds fewer than its share,
     the newest running sequences of the groups holding the most slots (more than their
     share) are preempted, one per slot owed;
  1. schedules running sequences, oldest first, each up to its group's share of the budget
     left: one token when decoding, or the next slice of a prompt being prefilled;
  2. admits waiting sequences, the group with the fewest running sequences first (then
     arrival order; preempted sequences are at the front), while budget, slots and KV blocks
     last, each up to its group's share. A sequence that does not fit stops admission (no
     overtaking); a group whose share is spent waits for the next step;
  3. gives the budget still left to the scheduled sequences, oldest first, as far as their
     blocks can grow without preempting anyone: no budget is left idle because of shares.
A step that carries decodes may be given a smaller budget for prompt tokens
(`schedule(prefill_limit=)`, from the engine's StepPacer, so that prompt chunks do not stall
the decoding sequences): prompt work in steps 1-3 then shares that, fairly in the same way.
When a running sequence needs a block and none is free, the newest running sequence not yet
scheduled in this step is preempted: its blocks are freed and it goes back to the front of the
queue with `num_computed_tokens = 0`, to recompute prompt and generated tokens later. Its
sampled tokens are kept, so the resumed output is the same as an uninterrupted run.

Speculative decoding: a decoding sequence may carry proposed tokens (`Sequence.spec_token_ids`,
set by the engine's speculator before `schedule()`). Then it is scheduled as a verification
chunk: its last sampled token and as many proposals as the budget, its group's share and the
free blocks allow (never preempting anyone for a proposal), all computed in one chunk
(`ScheduledSeq.draft`). `update()` is told how many proposals were accepted: the sequence keeps
the KV of those, and the blocks beyond its next token go back to the pool (they hold only
rejected tokens' KV and were never registered in the prefix cache, which registers only
computed slots).

Hybrid models (linear attention beside full attention): a sequence also holds a state slot
while it runs (StateSlots), taken at admission and returned with its blocks on finish, abort and
preemption; max_num_seqs is never more than the slots, so admission never waits on one.
With prefix caching, a hybrid sequence's cached prefix is cut to the deepest state checkpoint
at or below its cached KV (StateCheckpoints): it is admitted with that checkpoint to restore
into its slot, and each scheduled prompt chunk is given checkpoint ids for the boundaries it
crosses, which the forward fills and `update()` files.

The scheduler knows no tensors: it works on Sequence, BlockManager, StateSlots and
StateCheckpoints (ids) only.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tuili.engine.block_manager import BlockCopies, BlockManager, PrefixMatch
from tuili.engine.request import Sequence, SequenceStatus
from tuili.engine.state_checkpoints import StateCheckpoints
from tuili.engine.state_slots import StateSlots


@dataclass(frozen=True)
class ScheduledSeq:
    """This step computes `seq.token_ids[start : start + num_tokens]`; `samples` is True when
    that reaches the end of the sequence, so the last logits pick a new token. Fixed when
    scheduled, so it stays true after the sequence advances.

    Hybrid models with prefix caching: `restore_checkpoint` is the state checkpoint the
    sequence's slot starts from (its first chunk after admission, at `start` = the checkpoint's
    depth); `save_checkpoints` are (depth, checkpoint id) pairs, start < depth <= start +
    num_tokens, whose state the forward copies out after computing the token before `depth`."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    restore_checkpoint: int | None = None
    save_checkpoints: tuple[tuple[int, int], ...] = ()
    # Verification: the proposed tokens computed after the sequence's last token (num_tokens =
    # 1 + len(draft)); every one of those rows is sampled.
    draft: tuple[int, ...] = ()

    @classmethod
    def next_chunk(cls, seq: Sequence, num_tokens: int, restore_checkpoint: int | None = None,
                   save_checkpoints: tuple[tuple[int, int], ...] = ()) -> ScheduledSeq:
        start = seq.num_computed_tokens
        if num_tokens > seq.num_tokens - start:  # the decode token and proposals after it
            return cls(seq, start, num_tokens, True, draft=tuple(seq.spec_token_ids[: num_tokens - 1]))
        # An embedding's last prompt chunk is pooled (by the runner), not sampled.
        samples = start + num_tokens == seq.num_tokens and seq.pooling is None
        return cls(seq, start, num_tokens, samples, restore_checkpoint, save_checkpoints)

    def token_ids(self) -> list[int]:
        """The tokens this chunk computes."""
        if self.draft:
            return [self.seq.token_ids[self.start], *self.draft]
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


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
        else, including the recompute of generated tokens after a preemption, is prefill.
        Verification chunks are neither (`verify_chunks`)."""
        chunks, decodes = [], []
        for item in self.scheduled:
            if item.draft:
                continue
            if item.num_tokens == 1 and item.start >= item.seq.prompt_len:
                decodes.append(item.start + 1)
            else:
                chunks.append((item.start, item.num_tokens))
        return chunks, decodes

    def verify_chunks(self) -> list[tuple[int, int]]:
        """Verification chunks as (tokens cached before, positions computed: 1 + proposals)."""
        return [(item.start, item.num_tokens) for item in self.scheduled if item.draft]


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
        state_slots: StateSlots | None = None, checkpoints: StateCheckpoints | None = None,
    ) -> None:  # fmt: skip
        if state_slots is not None and max_num_seqs > state_slots.num_slots:
            raise ValueError(f"max_num_seqs={max_num_seqs} exceeds the {state_slots.num_slots} state slots")
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.state_slots = state_slots  # hybrid models only
        self.checkpoints = checkpoints  # hybrid models with prefix caching only
        self.waiting: deque[Sequence] = deque()
        self._waiting_groups: Counter[str] = Counter()  # waiting sequences per group
        self.running: list[Sequence] = []  # ordered by arrival

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._waiting_groups[seq.group] += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_limit: int | None = None) -> SchedulerOutput:
        """Plan the next step. `prefill_limit`: the most prompt tokens (anything but a decode's
        one token) the step may hold when it also holds decodes; None for no limit but the budget."""
        out = SchedulerOutput()
        if self.checkpoints is not None:
            self.checkpoints.reset_pending()  # a step that raised before update() reserved these
        budget = self.max_num_batched_tokens
        waiting_groups = +self._waiting_groups  # the groups with waiting sequences
        running_groups = Counter(seq.group for seq in self.running)
        num_groups = max(1, len(waiting_groups.keys() | running_groups.keys()))
        token_share = max(1, budget // num_groups)
        self._make_slots(waiting_groups, running_groups, num_groups, out)
        # Prompt work is limited only beside decodes (nothing streams otherwise).
        decoding = prefill_limit is not None and any(_decodes(seq) for seq in self.running)
        prefill_left = min(prefill_limit, budget) if decoding else budget
        prefill_share = max(1, prefill_left // num_groups)

        allotted: dict[Sequence, int] = {}  # the tokens each scheduled sequence computes, in order
        restores: dict[Sequence, int] = {}  # admitted sequences whose state starts from a checkpoint
        spent: Counter[str] = Counter()  # tokens per group
        prefill_spent: Counter[str] = Counter()  # prompt tokens per group
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, token_share - spent[seq.group])
            if not _decodes(seq):
                n = min(n, prefill_left, prefill_share - prefill_spent[seq.group])
            if n <= 0:
                continue  # its group's share is spent: step 3 may add to it
            if n == 1 and seq.spec_token_ids:
                n += self._proposals_that_fit(seq, budget - 1, token_share - spent[seq.group] - 1)
            if not self._make_room(seq, seq.num_computed_tokens + n, allotted, out):
                continue  # seq itself was preempted
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            allotted[seq] = n
            spent[seq.group] += n
            budget -= n
            if not _decodes(seq):
                prefill_spent[seq.group] += n
                prefill_left -= n

        admitted: Counter[str] = Counter(seq.group for seq in self.running)
        # Each group's waiting sequences, groups in queue order (with one group, the queue itself).
        queues: dict[str, deque[Sequence]] = {}
        waiting_groups = +self._waiting_groups  # again: preemptions above added to the queue
        if len(waiting_groups) == 1:
            queues[next(iter(waiting_groups))] = deque(self.waiting)
        elif waiting_groups:
            for seq in self.waiting:
                queues.setdefault(seq.group, deque()).append(seq)
        while self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs:
            def room(group: str) -> int:  # prompt tokens `group` may still add in this step
                return min(token_share - spent[group], prefill_share - prefill_spent[group])

            seq = self._next_waiting(queues, admitted, room)
            if seq is None:
                break  # every waiting group has spent its share of this step
            match, restore = self._match_prefix(seq)
            seq.num_computed_tokens = match.tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, room(seq.group), prefill_left)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.free(seq)  # the matched blocks stay cached for the next try
                seq.num_computed_tokens = 0
                break
            if not seq.scores_prompt:  # it did not look (vLLM counts no query either)
                self.blocks.record_query(seq, match)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = match.tokens
            self.waiting.remove(seq)
            self._waiting_groups[seq.group] -= 1
            queues[seq.group].popleft()
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            if self.state_slots is not None:
                self.state_slots.take(seq)
            if restore is not None:
                restores[seq] = restore
                self.checkpoints.stats.restored += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            allotted[seq] = n
            admitted[seq.group] += 1
            spent[seq.group] += n
            prefill_spent[seq.group] += n
            budget -= n
            prefill_left -= n

        if budget and prefill_left and num_groups > 1:  # shares held back budget: give it out, oldest first
            for seq in self.running:
                if budget == 0 or prefill_left == 0:
                    break
                have = allotted.get(seq, 0)
                more = min(seq.num_tokens - seq.num_computed_tokens - have, budget, prefill_left)
                if more <= 0 or seq.status is not SequenceStatus.RUNNING:
                    continue
                total = seq.num_computed_tokens + have + more
                if not self.blocks.can_grow(seq, total):
                    continue
                self.blocks.grow(seq, total)
                allotted[seq] = have + more
                budget -= more
                prefill_left -= more  # a decode has no more than its one token to take

        if self.checkpoints is None:
            out.scheduled = [ScheduledSeq.next_chunk(seq, n) for seq, n in allotted.items()]
        else:
            reserve = self.checkpoints.reserve
            out.scheduled = [
                ScheduledSeq.next_chunk(seq, n, restores.get(seq), reserve(seq, seq.num_computed_tokens, n))
                for seq, n in allotted.items()
            ]
        out.copies = self.blocks.take_copies()
        if self.checkpoints is not None:
            self.checkpoints.take_copies(out.copies)
        return out

    def _match_prefix(self, seq: Sequence) -> tuple[PrefixMatch, int | None]:
        """Attach `seq`'s cached prefix; with state checkpoints (a hybrid model), only as deep
        as the deepest checkpoint on it, returned beside the match for the slot to start from.
        A sequence pooled over every position (a MEAN embedding) takes no cached prefix: the
        hidden states of the cached positions are not kept. Nor does a sequence that scores its
        prompt (prompt logprobs), as in vLLM: the cache holds the prefix's KV but not the
        logprobs its computation would give."""
        if seq.scores_prompt or (seq.pooling is not None and seq.pooling.needs_every_position):
            return PrefixMatch(), None
        if self.checkpoints is None:
            return self.blocks.match_prefix(seq), None
        digests = self.blocks.prefix_digests(seq)
        found = self.checkpoints.deepest(digests)
        if found is None:
            return PrefixMatch(), None
        match = self.blocks.match_prefix(seq, found[0])
        if match.tokens < found[0]:  # some KV blocks below the checkpoint were evicted
            self.blocks.free(seq)  # the matched ones stay cached: the second match holds them again
            found = self.checkpoints.deepest(digests[: match.tokens // self.blocks.block_size])
            if found is None:
                return PrefixMatch(), None
            match = self.blocks.match_prefix(seq, found[0])
        return match, found[1]

    def _proposals_that_fit(self, seq: Sequence, budget: int, share: int) -> int:
        """How many of a decoding sequence's proposals to verify: as many as the budget and its
        group's share leave room for, and the free blocks hold without preempting anyone."""
        k = min(len(seq.spec_token_ids), budget, share)
        while k > 0 and not self.blocks.can_grow(seq, seq.num_computed_tokens + 1 + k):
            k -= 1
        return max(k, 0)

    @staticmethod
    def _next_waiting(queues: dict[str, deque[Sequence]], admitted: Counter[str],
                      room: Callable[[str], int]) -> Sequence | None:
        """The waiting sequence to admit next: the first of the group with the fewest running
        sequences (the earlier group in the queue on a tie) that has room left in this step."""
        best = None
        for group, queue in queues.items():
            if queue and room(group) > 0 and (best is None or admitted[group] < admitted[best]):
                best = group
        return queues[best][0] if best is not None else None

    def _make_slots(self, waiting_groups: Counter[str], running_groups: Counter[str], num_groups: int,
                    out: SchedulerOutput) -> None:
        """Preempt sequences of the groups over their share of the slots, as many as the
        waiting groups under their share are owed beyond the free slots."""
        if not waiting_groups or len(self.running) < self.max_num_seqs or num_groups == 1:
            return
        share = max(1, self.max_num_seqs // num_groups)
        owed = sum(min(share - running_groups[g], count) for g, count in waiting_groups.items()
                   if running_groups[g] < share)
        owed -= self.max_num_seqs - len(self.running)
        while owed > 0:
            group, holding = running_groups.most_common(1)[0]
            if holding <= share:
                return
            victim = next(seq for seq in reversed(self.running) if seq.group == group)
            self._preempt(victim)
            out.preempted.append(victim)
            running_groups[group] -= 1
            owed -= 1

    def _make_room(self, seq: Sequence, num_tokens: int, allotted: dict[Sequence, int], out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences not yet scheduled in this step until `seq` can
        hold `num_tokens`. Returns False when `seq` itself had to be preempted."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = next(v for v in reversed(self.running) if v not in allotted)  # seq at the latest
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
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._waiting_groups[seq.group] += 1

    def update(self, out: SchedulerOutput, accepted: dict[Sequence, int] | None = None) -> None:
        """Record that the scheduled tokens are now in the KV cache (call after the forward).
        `accepted`: per verifying sequence, how many of its proposals were kept; the KV of the
        rejected ones is dropped and their blocks freed."""
        for item in out.scheduled:
            seq = item.seq
            if item.draft:
                seq.num_computed_tokens += 1 + (accepted or {}).get(seq, 0)
                seq.spec_token_ids = []
                self.blocks.trim(seq, seq.num_computed_tokens + 1)
            else:
                seq.num_computed_tokens += item.num_tokens
                if seq.spec_token_ids:  # proposed, but no room to verify them this step
                    seq.spec_token_ids = []
            self.blocks.register_full_blocks(seq)
        if self.checkpoints is not None:
            self.checkpoints.commit()

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._waiting_groups[seq.group] -= 1
        self.blocks.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _decodes(seq: Sequence) -> bool:
    """Whether `seq` is decoding: only its newest sampled token is left to compute."""
    return seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_computed_tokens >= seq.prompt_len
