"""The engine's hook for speculative decoding: proposals before a step, bookkeeping after it.

    proposals = speculator.propose(scheduler.running)   # sets Sequence.spec_token_ids
    out = scheduler.schedule()                           # verification chunks where room allows
    tokens = runner.execute(out.scheduled, proposals)    # verify.py accepts and samples
    speculator.proposer.observe(out.scheduled, tokens)   # MTP reads the step's hidden states
    speculator.record(out, tokens, seconds, steady)      # acceptance, step cost, counters

How many tokens each sequence is offered is AdaptiveK's choice, capped so that no proposal
passes max_tokens (the target's token after the proposals is always emitted) or max_model_len.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from tuili.config import SpeculativeConfig
from tuili.engine.request import Sequence, SequenceStatus
from tuili.engine.scheduler import ScheduledSeq, SchedulerOutput
from tuili.engine.spec.adaptive import AdaptiveK
from tuili.engine.spec.ngram import NgramProposer
from tuili.engine.spec.verify import Proposal
from tuili.layers.sampler import SampledToken


@dataclass
class SpecStats:
    """Counters since the engine started: proposals verified and kept."""

    method: str
    num_verifications: int = 0  # sequence-steps that verified proposals
    num_proposed_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, kept
    num_emitted_tokens: int = 0  # tokens those verifications emitted (kept + the target's own)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a verifying sequence got per step (1 without speculation)."""
        return self.num_emitted_tokens / self.num_verifications if self.num_verifications else 0.0


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]: ...

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """Tokens of each sequence the proposer must compute before its first proposal (a draft
        model's shadow catching up; 0 where proposing costs no catch-up)."""

    def take_forward_times(self) -> list[tuple[int, float]] | None:
        """(sequences, seconds) of each one-token-per-sequence forward since the last call, or
        None where the proposer's forwards are timed as the whole proposal (MTP) or it runs none."""

    def observe(self, batch: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        """After each target forward (MTP reads the target's hidden states here)."""

    def release(self, seq: Sequence) -> None: ...


class PromptLookup:
    """NgramProposer over each sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.ngram.propose(seq.token_ids, k)) for seq, k in zip(seqs, ks, strict=True)]

    def observe(self, batch: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        pass

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        return [0] * len(seqs)

    def take_forward_times(self) -> list[tuple[int, float]] | None:
        return None

    def release(self, seq: Sequence) -> None:
        pass


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.adaptive = AdaptiveK(config.num_speculative_tokens, config.adaptive)
        self.stats = SpecStats(config.method)

    def propose(self, running: list[Sequence]) -> dict[Sequence, Proposal]:
        """Propose for every running sequence that decodes next; their spec_token_ids are set.
        Sequences under a grammar (structured output) get none: their mask applies to one row."""
        seqs, limits = [], []
        for seq in running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            if seq.params.structured_outputs is not None:
                continue
            limit = self.max_model_len - seq.num_tokens
            if seq.params.max_tokens is not None:
                limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        ks = self.adaptive.choose([seq.seq_id for seq in seqs], limits, self.proposer.backlog(seqs))
        chosen = [(seq, k) for seq, k in zip(seqs, ks, strict=True) if k > 0]
        if not chosen:
            return {}
        started = time.perf_counter()
        proposals = self.proposer.propose([seq for seq, _ in chosen], [k for _, k in chosen])
        elapsed = time.perf_counter() - started
        self.adaptive.record_proposals(elapsed)
        forward_times = self.proposer.take_forward_times()
        if forward_times is not None:  # a draft model: its one-token forwards, catch-up chunks apart
            for sequences, seconds in forward_times:
                self.adaptive.record_draft_forward(seconds, sequences)
        elif self.config.method != "ngram":  # MTP: one forward per proposal depth
            self.adaptive.record_draft_forward(elapsed / max(k for _, k in chosen), len(chosen))
        out = {}
        for (seq, k), proposal in zip(chosen, proposals, strict=True):
            proposal.token_ids = proposal.token_ids[:k]
            if proposal.token_ids:
                seq.spec_token_ids = list(proposal.token_ids)
                out[seq] = proposal
        return out

    def record(
        self, out: SchedulerOutput, tokens: list[list[SampledToken]], seconds: float, steady: bool,
    ) -> dict[Sequence, int]:
        """After the forward: the proposals each verifying sequence kept (for Scheduler.update),
        counted in the stats and fed to the adaptive choice with the step's time, unless the step
        was not `steady` (it captured a CPU graph: a one-off cost, which the fit would take for the
        cost of its shape, the only sample of a verification shape explored once)."""
        accepted: dict[Sequence, int] = {}
        sampling = [item for item in out.scheduled if item.samples]
        for item, new in zip(sampling, tokens, strict=True):
            if item.draft:
                kept = len(new) - 1
                accepted[item.seq] = kept
                self.adaptive.record_acceptance(item.seq.seq_id, len(item.draft), kept)
                self.stats.num_verifications += 1
                self.stats.num_proposed_tokens += len(item.draft)
                self.stats.num_accepted_tokens += kept
                self.stats.num_emitted_tokens += len(new)
        decoding_only = all(item.draft or (item.num_tokens == 1 and item.start >= item.seq.prompt_len)
                            for item in out.scheduled)
        if out.scheduled and decoding_only and not out.preempted and steady:
            self.adaptive.record_step(out.num_tokens, bool(accepted), seconds)
        return accepted

    def release(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: forget what was kept for it."""
        self.adaptive.release(seq.seq_id)
        self.proposer.release(seq)
