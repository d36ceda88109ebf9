"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens.

The draft runs in the same engine, on its own ModelRunner with its own KV pool (as many tokens
as the target's pool, in the draft's bytes) and BlockManager (no prefix cache). Each target
sequence has a shadow sequence on the draft's side; before proposing, the shadow is synced to
the target's tokens: its KV stays valid up to the first token where the target's text and the
shadow's (which ended with the last proposals) differ, and the blocks after that are freed.
Then one batched forward computes each shadow's missing tokens (the whole prompt the first
time) and draws the first proposal; k-1 batched decode forwards draw the others.

A self-draft (the target quantized, "model": "self") does not compute what the target already
has: its KV layers are the target's in shape and dtype, so before it proposes a shadow adopts
the target's keys and values for every token the target has computed (the prompt, the
proposals it kept, overwriting the shadow's own KV of those) and computes only the last token
and its new proposals. Its context is then the target's own (better guesses, not different
outputs: the target verifies every one), and SmolLM2-135M's int4 self-draft no longer spends
~210 ms (more than the bf16 target's 150 ms prefill) on a 247-token prompt, nor a forward per
kept proposal. Hybrid targets (their linear-attention state is no KV) and caches of other
dtypes (fp8 KV for the target) compute as any draft does.

A proposal is drawn with the target request's own sampling rules (penalties, suppression before
min_tokens, temperature, top-k/p, min-p) from the draft's logits: greedy requests take the
arg-max, others draw from q and hand q to the rejection sampler. A seeded request's draft draws
come from a generator of its own, derived from the seed but distinct from the target's stream.
A shadow that cannot get blocks proposes nothing this step.

A hybrid draft (linear-attention layers, e.g. the quantized copy of a Qwen3.5 target) cannot trim
its state like blocks: each shadow holds a state slot of the draft's, and every forward saves
the state after its last token into a ring of k + 2 rows of that slot (the pool's checkpoint
rows). A sync that rewinds the shadow to where its text still agrees with the target's restores
the row of that depth before its next forward; the ring covers every depth a rewind can reach
(the last proposals' forwards), and a shadow whose depth is no longer there recomputes from its
first token.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from tuili.config import SELF_DRAFT, EngineConfig, SpeculativeConfig, packed_compute_dtype
from tuili.engine.block_manager import BlockManager, slot
from tuili.engine.pool import PoolPlan, kv_bytes_per_block, state_bytes_per_slot
from tuili.engine.request import Sequence
from tuili.engine.runner import ModelRunner, RunnerConfig
from tuili.engine.scheduler import ScheduledSeq
from tuili.engine.spec.verify import Proposal
from tuili.engine.state_slots import StateSlots
from tuili.engine.stopping import StopTokens
from tuili.errors import TuiliError
from tuili.layers.attention import KVCache
from tuili.layers.sampler import SampledToken, Sampler, SamplingRow, seeded_stream
from tuili.models.loader import load_model
from tuili.platform import Platform

logger = logging.getLogger(__name__)

_DRAFT_SEED_SALT = 0x5DEECE66D  # keeps a seeded request's draft stream apart from its target stream


class DraftModel:
    def __init__(
        self, spec: SpeculativeConfig, config: EngineConfig, target_path: str, target_vocab: int, pool: PoolPlan,
        platform: Platform, dtype: torch.dtype, stop_tokens: StopTokens, target: ModelRunner | None = None,
    ) -> None:  # fmt: skip
        """`target`: the target's runner, whose KV a self-draft adopts where the layouts agree."""
        path = target_path if spec.model == SELF_DRAFT else spec.model
        if spec.adaptive:
            # The draft never decides a token (the target verifies every one), and with adaptive k
            # its proposals depend on the batch anyway: it runs the fastest kernel at every row
            # count (an int4 catch-up chunk as AMX/oneDNN products, not in GEMV row blocks: 3x
            # faster). With a fixed k it keeps the engine's setting, so that a seeded sampled
            # request's proposals, and so its text, do not depend on the batch.
            platform = dataclasses.replace(platform, batch_invariant=False)
        loaded = load_model(
            path, dtype, platform, pool.max_model_len, spec.quantization,
            packed_compute_dtype(config.dtype, platform.device, dtype),
        )
        cfg = loaded.config
        if cfg.vocab_size > target_vocab:
            raise TuiliError(f"speculative_config model={spec.model!r} has vocab_size={cfg.vocab_size}, more than "
                             f"the target's {target_vocab}: a draft must share the target's tokenizer")
        self.vocab_size = target_vocab
        self.stop_tokens = stop_tokens
        block_bytes = kv_bytes_per_block(cfg, pool.block_size, dtype)
        # A hybrid draft: a state slot per shadow, and a ring of `_ring` state rows per slot for
        # the states after its last forwards (rows of the pool's checkpoint kind), so that a
        # shadow whose proposals were rejected restores the state where its text still agrees.
        slot_bytes = state_bytes_per_slot(cfg, dtype)
        num_slots = config.max_num_seqs if cfg.is_hybrid else 0
        self._ring = spec.num_speculative_tokens + 2
        self.pool = PoolPlan(pool.num_blocks, pool.block_size, 0, dtype, pool.max_model_len, block_bytes, num_slots,
                             slot_bytes, num_slots * self._ring)  # fmt: skip
        self.state_slots = StateSlots(num_slots) if num_slots else None
        logger.info(
            "draft model %s%s: its own KV pool of %d blocks (%.1f MiB)%s", path,
            f" ({spec.quantization})" if spec.quantization else "", pool.num_blocks,
            pool.num_blocks * block_bytes / 2**20,
            f" and linear-attention state for {num_slots} sequences ({num_slots * (1 + self._ring) * slot_bytes / 2**20:.1f} MiB)"
            if num_slots else "",
        )  # fmt: skip
        self.runner = ModelRunner(loaded.model, self.pool, RunnerConfig(platform.device, dtype, stop_tokens,
                                                                         config.enforce_eager))
        self.blocks = BlockManager(pool.num_blocks, pool.block_size, enable_prefix_caching=False)
        self.device = platform.device
        self._shadows: dict[int, Sequence] = {}  # by the target sequence's seq_id
        self._generators: dict[int, torch.Generator] = {}
        self._synced: dict[int, int] = {}  # by seq_id: target tokens the shadow's tokens equalled at the last sync
        # Hybrid drafts, by seq_id: the depth the slot's state is after; depth -> ring row holding
        # the state after it; the ring row the next forward starts from.
        self._slot_depth: dict[int, int] = {}
        self._saved: dict[int, dict[int, int]] = {}
        self._restore: dict[int, int] = {}
        self._forward_times: list[tuple[int, float]] = []  # (shadows, seconds) of one-token forwards
        self._adopted = self._shared_caches(target) if spec.model == SELF_DRAFT and target is not None else []
        self._own_from: dict[int, int] = {}  # by seq_id: where the shadow's KV stops being the target's

    def weight_bytes(self) -> int:
        """Bytes of weights one draft forward of one sequence reads."""
        return self.runner.decode_weight_bytes()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        active: list[tuple[int, Sequence, int]] = []  # (index, shadow, k)
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            shadow = self._sync(seq)
            if shadow is not None and self.blocks.can_grow(shadow, shadow.num_tokens + k - 1):
                self.blocks.grow(shadow, shadow.num_tokens + k - 1)
                self._adopt(seq, shadow)
                active.append((i, shadow, k))
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        while active:
            batch = [self._item(shadow, n, n == shadow.num_tokens - shadow.num_computed_tokens)
                     for (_, shadow, _), n in zip(active, self._chunk_sizes(active), strict=True)]
            started, captures = time.perf_counter(), self.runner.graph_captures()
            logits = self.runner.sample_logits(batch)
            for item in batch:
                item.seq.num_computed_tokens += item.num_tokens
            drawing = [entry for entry, item in zip(active, batch, strict=True) if item.samples]
            if drawing:
                assert logits is not None
                tokens, probs = self._draw(logits, [self._row(seqs[i], shadow) for i, shadow, _ in drawing])
                for (i, shadow, _), token, q in zip(drawing, tokens, probs, strict=True):
                    shadow.token_ids.append(token)
                    proposals[i].token_ids.append(token)
                    if q is not None:
                        q_rows[i].append(q)
            if all(item.num_tokens == 1 for item in batch) and self.runner.graph_captures() == captures:
                self._forward_times.append((len(batch), time.perf_counter() - started))
            active = [(i, shadow, k) for i, shadow, k in active if len(proposals[i].token_ids) < k]
        for i, rows in q_rows.items():
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals

    def _shared_caches(self, target: ModelRunner) -> list[tuple[KVCache, KVCache]]:
        """(target's, draft's) KV cache of each layer, where a shadow may copy the target's KV
        into its own: the same layers, block size, heads and dtype, unscaled (not fp8), and no
        linear-attention state; else none."""
        theirs, ours = target.model.attention_layers(), self.runner.model.attention_layers()
        if target.model.linear_attention_layers() or len(theirs) != len(ours) or target.block_size != self.pool.block_size:
            return []
        pairs = [(t.kv_cache, o.kv_cache) for t, o in zip(theirs, ours, strict=True)]
        for t, o in pairs:
            assert t is not None and o is not None
            if (t.key.shape[1:] != o.key.shape[1:] or t.key.dtype != o.key.dtype or t.key.device != o.key.device
                    or t.key_scale is not None or o.key_scale is not None):
                return []
        return pairs  # type: ignore[return-value]

    def _adopt(self, seq: Sequence, shadow: Sequence) -> None:
        """A self-draft's shadow takes the target's KV for every token the target has computed:
        those it had not computed, and those it computed itself since the last adoption (the
        last token then, the proposals the target kept). Their blocks are the shadow's already."""
        if not self._adopted:
            return
        start = min(shadow.num_computed_tokens, self._own_from.get(seq.seq_id, 0))
        stop = seq.num_computed_tokens
        if stop > start:
            size = self.pool.block_size
            source = torch.tensor([slot(seq.block_table, p, size) for p in range(start, stop)], device=self.device)
            dest = torch.tensor([slot(shadow.block_table, p, size) for p in range(start, stop)], device=self.device)
            for theirs, ours in self._adopted:
                for a, b in ((theirs.key, ours.key), (theirs.value, ours.value)):
                    b.view(-1, *b.shape[2:])[dest] = a.view(-1, *a.shape[2:])[source]
        shadow.num_computed_tokens = max(shadow.num_computed_tokens, stop)
        self._own_from[seq.seq_id] = stop  # the shadow's own KV from here on

    def _chunk_sizes(self, active: list[tuple[int, Sequence, int]]) -> list[int]:
        """Tokens each shadow computes in the next forward. A shadow a few tokens behind (the
        target kept all proposals: the last one and the bonus token) catches up in one chunk
        where the runner replays a CPU graph of such a step (two rows cost about what one does),
        else one token per forward, a pure decode step that replays one; a shadow far behind (its
        prompt) catches up in one chunk either way."""
        missing = [shadow.num_tokens - shadow.num_computed_tokens for _, shadow, _ in active]
        whole = [ScheduledSeq(shadow, shadow.num_computed_tokens, n, True) for (_, shadow, _), n in zip(active, missing, strict=True)]
        if self.runner.replays(whole):
            return missing
        return [n if n > k + 1 else 1 for (_, _, k), n in zip(active, missing, strict=True)]

    def observe(self, batch: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        pass  # the shadow syncs to the target's tokens when it next proposes

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """Tokens each shadow computes before it proposes: all of them without a shadow, else
        those after the last sync's agreement (a lower bound of where the texts still agree)."""
        found = []
        for seq in seqs:
            shadow = self._shadows.get(seq.seq_id)
            done = 0 if shadow is None else min(shadow.num_computed_tokens, self._synced.get(seq.seq_id, 0))
            if self._adopted:  # the target's computed tokens are adopted, not computed
                done = max(done, seq.num_computed_tokens)
            found.append(seq.num_tokens - done)
        return found

    def take_forward_times(self) -> list[tuple[int, float]] | None:
        """The logits of each forward in which every shadow computed one token (a proposal or
        a one-token catch-up), timed; chunks (a prompt, a long catch-up) are the backlog's cost,
        and a forward that captured a CPU graph paid a one-off cost."""
        times, self._forward_times = self._forward_times, []
        return times

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow)
            self.runner.release(shadow)
            if self.state_slots is not None:
                self.state_slots.free(shadow)
        for kept in (self._generators, self._synced, self._slot_depth, self._saved, self._restore, self._own_from):
            kept.pop(seq.seq_id, None)

    def _item(self, shadow: Sequence, n: int, samples: bool) -> ScheduledSeq:
        """The shadow's next n tokens as a forward's item; a hybrid draft's restores the ring row
        its sync chose and saves the state after the n tokens into the ring."""
        start = shadow.num_computed_tokens
        if self.state_slots is None:
            return ScheduledSeq(shadow, start, n, samples)
        slot = shadow.state_slot
        assert slot is not None
        seq_id, depth = shadow.seq_id, start + n
        row = slot * self._ring + depth % self._ring
        saved = self._saved.setdefault(seq_id, {})
        for stale in [d for d, r in saved.items() if r == row]:
            del saved[stale]
        saved[depth] = row
        self._slot_depth[seq_id] = depth
        return ScheduledSeq(shadow, start, n, samples, self._restore.pop(seq_id, None), ((depth, row),))

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of `seq` holding its tokens, its KV valid up to where they differ (None: a
        hybrid draft with no free state slot)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            if self.state_slots is not None and not self.state_slots.num_free:
                return None
            shadow = dataclasses.replace(seq, token_ids=[], block_table=[], block_digests=[], num_computed_tokens=0,
                                         spec_token_ids=[], state_slot=None)
            if self.state_slots is not None:
                self.state_slots.take(shadow)
            self._shadows[seq.seq_id] = shadow
        # The shadow's tokens are the target's as of the last sync, then that step's proposals:
        # only those can differ from the target's tokens now.
        # At least the last token is computed again: its logits draw the first proposal (the
        # shadow may be ahead when its proposals were not verified: the target was preempted).
        limit = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        valid = min(self._synced.get(seq.seq_id, 0), limit)
        old, new = shadow.token_ids, seq.token_ids
        while valid < limit and old[valid] == new[valid]:
            valid += 1
        if self.state_slots is not None:
            valid = self._rewind_state(seq.seq_id, valid)
        shadow.token_ids = list(new)
        shadow.num_computed_tokens = valid
        self._synced[seq.seq_id] = seq.num_tokens
        self.blocks.trim(shadow, valid)
        return shadow

    def _rewind_state(self, seq_id: int, valid: int) -> int:
        """Where a hybrid shadow resumes: `valid` if its slot holds the state after `valid`
        tokens or a ring row does (restored before its next forward), else 0 (recomputed)."""
        self._restore.pop(seq_id, None)
        if valid == self._slot_depth.get(seq_id, 0) or valid == 0:
            return valid
        row = self._saved.get(seq_id, {}).get(valid)
        if row is None:
            return 0
        self._restore[seq_id] = row
        return valid

    def _row(self, seq: Sequence, shadow: Sequence) -> SamplingRow:
        params = seq.params
        generator = None
        if params.seed is not None:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                generator = self._generators[seq.seq_id] = seeded_stream(
                    params.seed, seq.index, self.device, salt=_DRAFT_SEED_SALT
                )
        return SamplingRow(params, shadow.token_ids, seq.prompt_len, generator,
                           self.stop_tokens.suppressed(params, shadow.num_tokens - seq.prompt_len))

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's proposal, and the distribution it was drawn from (None: greedy, arg-max)."""
        if logits.shape[1] < self.vocab_size:  # a draft with fewer ids never proposes the others
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
        processed = Sampler.process(logits, rows)
        tokens = processed.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(rows)
        sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            table = Sampler.draw_probabilities(processed[sampled], [rows[r] for r in sampled])
            cdf = table.to(torch.float64).cumsum(dim=-1)
            for i, r in enumerate(sampled):
                u = torch.rand(1, dtype=torch.float64, device=logits.device, generator=rows[r].generator)
                total = cdf[i, -1:]
                target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
                tokens[r] = int(torch.searchsorted(cdf[i], target, right=True))
                probs[r] = table[i]
        return tokens, probs
