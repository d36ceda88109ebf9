"""The model runner: turns a scheduled batch into tensors, runs the network, samples.

It owns the KV pool (one key and one value tensor per full-attention layer), a hybrid model's
linear-attention state slots (a conv and a recurrent state tensor per linear layer, indexed by
the slot ids the scheduler hands out; the prefix cache's state checkpoints are the rows after
the slots) and the per-sequence random generators. It knows nothing
of HTTP or of scheduling policy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tuili.engine.block_manager import BlockCopies, blocks_for, slot
from tuili.engine.decode_graphs import DecodeGraphs, DecodeStep
from tuili.engine.pool import PoolPlan
from tuili.engine.prompt_logprobs import PromptLogprobs, PromptSpan, prompt_spans, score
from tuili.engine.request import Sequence
from tuili.engine.scheduler import ScheduledSeq
from tuili.engine.spec.verify import Proposal, verify
from tuili.engine.stopping import StopTokens
from tuili.layers.attention import (
    AttentionGroup,
    AttentionMetadata,
    CausalSpan,
    KVCache,
    NativeCpuAttention,
    PagedBatch,
)
from tuili.layers.deltanet import DeltaNetState, StateBatch
from tuili.layers.grammar import GrammarCompiler, GrammarState, TokenMasks
from tuili.layers.linear import PanelLinear
from tuili.layers.moe import QuantizedExperts, SparseMoE
from tuili.layers.pooler import MeanAccumulator
from tuili.layers.quant import QuantizedLinear
from tuili.layers.sampler import SampledToken, Sampler, SamplingRow, seeded_stream
from tuili.models.llama import LlamaForCausalLM
from tuili.models.qwen3_next import Qwen3NextForCausalLM

CausalLM = LlamaForCausalLM | Qwen3NextForCausalLM


@dataclass(frozen=True)
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype  # the working dtype of activations and weights
    stop_tokens: StopTokens  # what each sampling row suppresses before min_tokens
    enforce_eager: bool = False  # no CPU decode graphs
    grammars: GrammarCompiler | None = None  # structured output; None: the model has no tokenizer


@dataclass
class StepResult:
    """What one forward produced: the new tokens of each item whose chunk ends its sequence (in
    batch order), and the prompt logprobs its prompt chunks scored (tuili/engine/prompt_logprobs.py)."""

    sampled: list[list[SampledToken]]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: PoolPlan, config: RunnerConfig) -> None:
        device, dtype = config.device, config.dtype
        self.model = model
        self.device = device
        self.block_size = block_size = pool.block_size
        self.stop_tokens = config.stop_tokens
        self.sampler = Sampler(model.platform)
        self._generators: dict[int, torch.Generator] = {}
        # Structured output: each constrained sequence's grammar state, and the thread that
        # fills a step's token masks while the forward pass runs.
        self.grammars = config.grammars
        self._grammar_states: dict[int, GrammarState] = {}
        self._mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuili-grammar")
        # Embeddings: each MEAN-pooled prompt's sum of hidden states over its chunks so far, and
        # the vectors of prompts whose last chunk ran, until the engine takes them.
        self._pool_sums: dict[int, MeanAccumulator] = {}
        self._pooled: dict[int, list[float]] = {}
        cfg = model.config
        kv_dtype = pool.kv_dtype
        # Decodes go to the attention backend's paged reader where it has one (the native CPU
        # kernel; the portable fixed-order attention), else into gathered groups.
        self.paged_decodes = model.attention.reads_paged_decodes
        # ... and every prompt chunk too, where the backend asks (its batch-invariant mode).
        self.paged_prompts = model.attention.reads_paged_prompts
        # Pure decode steps replay CPU graphs where the native kernels do all their work: not in
        # a mixture of experts, whose routing (softmax, top-k, sort by expert) is torch ops and
        # whose products depend on the step's routing, which a graph cannot replay.
        self.graphs: DecodeGraphs | None = None
        self.hybrid = cfg.is_hybrid
        # With keep_hidden_states(): the last forward's final hidden states, every row in batch
        # order (speculative decoding's MTP proposer reads them).
        self.hidden_states: torch.Tensor | None = None
        self._keep_hidden = False
        native_cpu = isinstance(model.attention, NativeCpuAttention)  # the graphs replay native calls only
        if native_cpu and kv_dtype == dtype and not config.enforce_eager and cfg.moe is None:
            max_blocks = blocks_for(pool.max_model_len, block_size)
            self.graphs = DecodeGraphs(model, block_size, max_blocks)
        shape = (pool.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        for attn in model.attention_layers():
            attn.kv_cache = KVCache.allocate(shape, kv_dtype, device)
        linear_layers = model.linear_attention_layers()
        if linear_layers and pool.num_state_slots < 1:
            raise ValueError("a model with linear-attention layers needs a pool plan with state slots")
        self.num_state_slots = pool.num_state_slots  # checkpoint c is state row num_state_slots + c
        # Speculative decoding: slot s's state after the first t tokens of a verification chunk
        # (1 <= t <= k) is row verify_row(s, t), after the checkpoints; rows tied to a slot
        # cannot leak.
        self.verify_rows_per_slot = pool.verify_rows_per_slot
        self._first_verify_row = pool.num_state_slots + pool.num_state_checkpoints
        for layer in linear_layers:
            conv_dim, kernel, heads = layer.state_shapes()
            rows = self._first_verify_row + pool.num_state_slots * pool.verify_rows_per_slot
            layer.state = DeltaNetState.allocate(rows, conv_dim, kernel, heads, dtype, device)
        # The prefix cache's second tier: the same layout in host memory (pinned on a GPU so
        # host-to-device copies run asynchronously), as raw bytes (index_put has no float8
        # kernel; copies of bytes are exact). On a CPU it is simply a separate pool.
        element = torch.empty((), dtype=kv_dtype).element_size()
        host_shape = (pool.num_host_blocks, *shape[1:], element)
        pin = device.type == "cuda"
        self._host_pools = [
            (
                torch.zeros(host_shape, dtype=torch.uint8, pin_memory=pin),
                torch.zeros(host_shape, dtype=torch.uint8, pin_memory=pin),
            )
            for _ in model.attention_layers()
        ] if pool.num_host_blocks else []
        # ... and a hybrid's state checkpoints spilled there: each linear layer's conv and
        # recurrent rows, one host row per checkpoint.
        self._host_states = [
            tuple(torch.zeros(pool.num_host_checkpoints, *t.shape[1:], dtype=t.dtype, pin_memory=pin)
                  for t in (layer.state.conv, layer.state.recurrent))
            for layer in linear_layers if layer.state is not None
        ] if pool.num_host_checkpoints else []  # fmt: skip

    @torch.inference_mode()
    def copy_blocks(self, copies: BlockCopies) -> None:
        """Spill evicted blocks (and state checkpoints) to the host tier, then bring host hits
        back, before the forward that may overwrite them. Device-to-host copies are synchronous
        (the host pool is read by later steps); host-to-device ones are queued on the compute
        stream, ahead of the forward that reads them."""
        if not copies:
            return
        if copies.to_host or copies.to_device:
            for host_pools, attn in zip(self._host_pools, self.model.attention_layers(), strict=True):
                assert attn.kv_cache is not None
                for host, device_pool in zip(host_pools, (attn.kv_cache.key, attn.kv_cache.value), strict=True):
                    self._copy_rows(host, device_pool.unsqueeze(-1).view(torch.uint8), copies.to_host, copies.to_device)
        if copies.states_to_host or copies.states_to_device:
            row = self.num_state_slots  # checkpoint c is state row num_state_slots + c
            to_host = [(row + c, h) for c, h in copies.states_to_host]
            to_device = [(h, row + c) for h, c in copies.states_to_device]
            for host_states, layer in zip(self._host_states, self.model.linear_attention_layers(), strict=True):
                assert layer.state is not None
                for host, device_rows in zip(host_states, (layer.state.conv, layer.state.recurrent), strict=True):
                    self._copy_rows(host, device_rows, to_host, to_device)

    def _copy_rows(
        self, host: torch.Tensor, device_rows: torch.Tensor, to_host: list[tuple[int, int]],
        to_device: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """Rows of `device_rows` to rows of `host` ((device row, host row) pairs), then back."""
        if to_host:
            src = torch.tensor([d for d, _ in to_host], device=self.device)
            host[torch.tensor([h for _, h in to_host])] = device_rows[src].cpu()
        if to_device:
            dst = torch.tensor([d for _, d in to_device], device=self.device)
            device_rows[dst] = host[torch.tensor([h for h, _ in to_device])].to(self.device, non_blocking=True)

    def keep_hidden_states(self) -> None:
        """Keep every forward's final hidden states in `hidden_states`. Decode steps then run
        eagerly: a CPU graph returns logits only."""
        self._keep_hidden = True
        self.graphs = None

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The inputs of a forward over `batch`: token ids, positions, attention metadata (KV slots
        from each sequence's block table) and the rows that sample."""
        return self._prepare(batch)

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSeq], proposals: dict[Sequence, Proposal] | None = None,
    ) -> StepResult:
        """Run one forward over `batch`; return the new tokens of each item whose chunk ends
        its sequence (in batch order): one token, or for a verification chunk its accepted
        proposals and the target's token after them (tuili/engine/spec/verify.py); and the
        prompt logprobs of the prompt chunks that score them.
        `proposals` gives the distribution a draft model drew each verified proposal from.
        Structured-output sequences are never verified (the speculator proposes nothing for
        them), so their masks apply to one row each."""
        sampling = [item for item in batch if item.samples]
        masks = self._token_masks([item.seq for item in sampling])  # filled while the forward below runs
        spans = prompt_spans(batch)
        if spans:
            logits, scored = self.score_and_sample_logits(batch, spans)
        else:
            logits, scored = self.sample_logits(batch), []
        if logits is None:
            return StepResult([], scored)
        if not any(item.draft for item in sampling):
            return StepResult([[t] for t in self._sample(logits, [item.seq for item in sampling], masks)], scored)
        rows: list[SamplingRow] = []
        verified: list[Proposal | None] = []
        for item in sampling:
            rows.extend(self._row(item.seq, item.draft[:j]) for j in range(len(item.draft) + 1))
            if item.draft:
                probs = (proposals or {}).get(item.seq, Proposal([])).probs
                verified.append(Proposal(list(item.draft), None if probs is None else probs[: len(item.draft)]))
            else:
                verified.append(None)
        sampled = verify(logits, rows, verified)
        if self.hybrid:
            self._keep_accepted_states(sampling, sampled)
        return StepResult(sampled, scored)

    def verify_row(self, slot: int, tokens: int) -> int:
        """The state row that holds slot `slot`'s state after the first `tokens` tokens of its
        verification chunk (its last sampled token, then tokens - 1 proposals)."""
        assert 1 <= tokens <= self.verify_rows_per_slot, (tokens, self.verify_rows_per_slot)
        return self._first_verify_row + slot * self.verify_rows_per_slot + tokens - 1

    def _keep_accepted_states(self, sampling: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        """Leave each verifying hybrid sequence's state slot at its last accepted position. The
        chunk ran its last token and every proposal, so the slot holds the state after all of
        them; a sequence that kept `a` < k proposals (it emits a + 1 tokens) needs the state
        after a + 1 of the chunk's tokens, which the forward saved in its verification row."""
        slots, rows = [], []
        for item, tokens in zip(sampling, sampled, strict=True):
            kept = len(tokens) - 1
            if item.draft and kept < len(item.draft):
                slot_id = item.seq.state_slot
                assert slot_id is not None
                slots.append(slot_id)
                rows.append(self.verify_row(slot_id, kept + 1))
        if not slots:
            return
        slot_index = torch.tensor(slots, dtype=torch.long, device=self.device)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.model.linear_attention_layers():
            state = layer.state
            assert state is not None
            state.conv[slot_index] = state.conv[row_index]
            state.recurrent[slot_index] = state.recurrent[row_index]

    @torch.inference_mode()
    def sample_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """Run one forward over `batch`: the float32 logits of the rows that sample, in batch
        order (every position of a verification chunk, the last of any other chunk that ends
        its sequence); None when no chunk does."""
        pooling = any(item.seq.pooling is not None for item in batch)
        if not pooling and self.replays(batch):
            assert self.graphs is not None
            logits = self._replay(self.graphs.step(batch))
            if logits is not None:  # every row's: keep a verification's rows, another chunk's last
                rows, end = [], 0
                for item in batch:
                    end += item.num_tokens
                    if item.samples:
                        rows.extend(range(end - len(item.draft) - 1, end))
                if len(rows) == end:
                    return logits
                return logits[rows] if rows else None
        return self._eager_logits(batch, pooling)

    def graph_captures(self) -> int:
        """CPU graph captures tried so far (a step that tried one took several steady steps' time)."""
        return 0 if self.graphs is None else self.graphs.captures

    def replays(self, batch: list[ScheduledSeq]) -> bool:
        """Whether a forward over `batch` may replay a CPU graph (a pure decode step, a
        verification, or short sampled chunks, of a shape not refused)."""
        return self.graphs is not None and self.graphs.takes(batch)

    def _replay(self, step: DecodeStep) -> torch.Tensor | None:
        """The step's logits from its CPU graph, or None: run it eagerly."""
        assert self.graphs is not None
        return self.graphs.logits(step)

    def _eager_logits(self, batch: list[ScheduledSeq], pooling: bool) -> torch.Tensor | None:
        input_ids, positions, meta, sample_index = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if self._keep_hidden:
            self.hidden_states = hidden
        if pooling:
            self._pool(batch, hidden)
        if len(sample_index) == 0:
            return None
        if len(sample_index) < hidden.shape[0]:
            hidden = hidden[sample_index]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def score_and_sample_logits(
        self, batch: list[ScheduledSeq], spans: list[PromptSpan],
    ) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        """sample_logits, for a batch whose prompt chunks also score the prompt (`spans`): the
        sampling rows' logits and the prompt logprobs, from one forward (never a decode graph)."""
        input_ids, positions, meta, sample_index = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if self._keep_hidden:
            self.hidden_states = hidden
        if any(item.seq.pooling is not None for item in batch):
            self._pool(batch, hidden)
        scored = score(hidden, spans, self.model.compute_logits)
        return (self.model.compute_logits(hidden[sample_index]) if len(sample_index) else None), scored

    def _pool(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Pool the final hidden states of the embedding sequences' chunks (their rows of
        `hidden`, in batch order). A MEAN chunk adds its rows to the sequence's accumulator; a
        chunk at position 0 starts it afresh (a first chunk, or the recompute after a
        preemption; such a sequence never starts from a cached prefix). The last chunk makes
        the vector."""
        row = 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            pooling = seq.pooling
            if pooling is not None:
                rows = hidden[row : row + n]
                mean = None
                if pooling.needs_every_position:
                    if item.start == 0:
                        self._pool_sums[seq.seq_id] = MeanAccumulator(rows.shape[1], rows.device)
                    mean = self._pool_sums[seq.seq_id]
                    mean.add(rows)
                if item.start + n == seq.num_tokens:
                    vector = rows[-1].float() if mean is None else mean.mean()
                    if pooling.normalize:
                        vector = torch.nn.functional.normalize(vector, dim=0)
                    self._pooled[seq.seq_id] = vector.cpu().tolist()
                    self._pool_sums.pop(seq.seq_id, None)
            row += n

    def take_pooled(self) -> dict[int, list[float]]:
        """The vectors of the embedding sequences whose prompt's last chunk has run since the
        last call, by seq_id; each is handed out once."""
        pooled, self._pooled = self._pooled, {}
        return pooled

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None) -> list[SampledToken]:
        """Sample, then advance each constrained sequence's grammar past its new token."""
        sampled = self.sampler(logits, [self._row(seq) for seq in seqs], masks)
        if masks is not None:
            for row in masks.rows:
                self._grammar_states[seqs[row].seq_id].accept(sampled[row].token_id)
        return sampled

    def _token_masks(self, seqs: list[Sequence]) -> TokenMasks | None:
        """Start filling the token masks of the constrained sequences among `seqs` (None: none is)."""
        if not any(seq.params.structured_outputs is not None for seq in seqs):
            return None
        if self.grammars is None:
            raise RuntimeError("a sequence asks for structured output but the runner has no grammar compiler")
        states: list[GrammarState | None] = []
        for seq in seqs:
            spec = seq.params.structured_outputs
            state = None
            if spec is not None:
                state = self._grammar_states.get(seq.seq_id)
                if state is None:
                    state = self._grammar_states[seq.seq_id] = self.grammars.new_state(spec)
            states.append(state)
        return TokenMasks(states, self.model.config.vocab_size, self._mask_filler)

    @torch.inference_mode()
    def logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits of every scheduled token ([T, vocab]), for scoring prompts."""
        input_ids, positions, meta, _ = self._prepare(batch)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def weight_bytes(self) -> int:
        """Bytes of the weights held: parameters and quantized modules' codes and scales, each
        storage once (a tied embedding is one tensor)."""
        return sum(self._weight_storages().values())

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step of one sequence reads: all of them, except that the
        token lookup reads only a few rows of the embedding matrix, the logits read what the
        output head reads for one row (the embedding matrix when tied, a decode copy where there
        is one), and a mixture-of-experts layer reads only the token's top-k experts."""
        storages = self._weight_storages()
        head = self.model.lm_head
        lookup = self.model.model.embed_tokens
        unread = [*lookup.parameters(), *lookup.buffers(), *head.parameters(), *head.buffers()]
        for tensor in unread:
            storages.pop(tensor.untyped_storage().data_ptr(), None)
        for tensor in head.weights_read(1, self.device):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        for layer in self.model.modules():
            if isinstance(layer, SparseMoE):
                # Every expert tensor (float or packed) is [E, ...]: k of the E slices are read.
                for tensor in (*layer.experts.parameters(), *layer.experts.buffers()):
                    key = tensor.untyped_storage().data_ptr()
                    storages[key] = storages[key] * layer.top_k // layer.experts.num_experts
        return sum(storages.values())

    def _weight_storages(self) -> dict[int, int]:
        packed = (QuantizedLinear, PanelLinear, QuantizedExperts)
        quantized = (b for m in self.model.modules() if isinstance(m, packed) for b in m.buffers())
        tensors = [*self.model.parameters(), *quantized]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state when a sequence finishes or is aborted."""
        self._generators.pop(seq.seq_id, None)
        self._grammar_states.pop(seq.seq_id, None)
        self._pool_sums.pop(seq.seq_id, None)
        self._pooled.pop(seq.seq_id, None)

    def _row(self, seq: Sequence, proposed: tuple[int, ...] = ()) -> SamplingRow:
        """The sequence's sampling row; its token history is read only if a penalty needs it.
        With `proposed` tokens: the row of the token after them, as if they had been generated."""
        params = seq.params
        generator = None
        if params.seed is not None:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                generator = self._generators[seq.seq_id] = seeded_stream(params.seed, seq.index, self.device)
        return SamplingRow(
            params=params,
            token_ids=seq.token_ids + list(proposed) if proposed else seq.token_ids,
            prompt_len=seq.prompt_len,
            generator=generator,
            suppressed_token_ids=self.stop_tokens.suppressed(
                params, seq.num_output_tokens + len(proposed), self._can_end(seq),
            ),
        )

    def _can_end(self, seq: Sequence) -> bool:
        """Whether a grammar would let `seq` end now (False for an unconstrained sequence)."""
        state = self._grammar_states.get(seq.seq_id)
        return state is not None and state.can_end

    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        # Sequences that read the cache, as (first row, query rows, first position, block table):
        # decodes, and prefill chunks that continue earlier ones.
        decodes: list[tuple[int, int, int, list[int]]] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        spans: list[CausalSpan] = []
        # Hybrid models: each item's (first row, first position, tokens, state slot).
        state_items: list[tuple[int, int, int, int]] = []
        restores: list[tuple[int, int]] = []  # (slot, checkpoint row)
        saves: list[tuple[int, int, int]] = []  # (first row, tokens into the item, checkpoint row)
        for item in batch:
            seq, start, n = item.seq, item.start, item.num_tokens
            query_start = len(input_ids)
            if self.hybrid:
                state_slot = seq.state_slot
                assert state_slot is not None, f"sequence {seq.seq_id} runs without a state slot"
                state_items.append((query_start, start, n, state_slot))
                if item.restore_checkpoint is not None:
                    restores.append((state_slot, self.num_state_slots + item.restore_checkpoint))
                for depth, checkpoint in item.save_checkpoints:
                    saves.append((query_start, depth - start, self.num_state_slots + checkpoint))
                # A verification chunk [last sampled token, d_1..d_k] saves the state after each
                # of its first k tokens: keeping a < k proposals restores the one after a + 1.
                for tokens in range(1, len(item.draft) + 1):
                    saves.append((query_start, tokens, self.verify_row(state_slot, tokens)))
            input_ids.extend(item.token_ids())
            span = range(start, start + n)
            positions.extend(span)
            table = seq.block_table
            slots.extend(slot(table, p, bs) for p in span)
            if item.draft:  # verification: every position's logits
                sample_index.extend(range(query_start, query_start + n))
            elif item.samples:
                sample_index.append(len(input_ids) - 1)
            # A verification chunk (item.draft) is a few query rows, read like decodes.
            if n == 1 or self.paged_prompts or item.draft:
                decodes.append((query_start, n, start, table))
            elif start == 0:
                spans.append(CausalSpan(query_start, n))
            else:
                chunks.append((query_start, n, start, table))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True)
        groups = [self._group([chunk]) for chunk in chunks]
        if decodes and self.paged_decodes:
            meta = AttentionMetadata(slot_mapping, groups, spans, self._paged_batch(decodes))
        else:
            meta = AttentionMetadata(slot_mapping, ([self._group(decodes)] if decodes else []) + groups, spans)
        if self.hybrid:
            # A sequence's first chunk after admission (or a preemption) starts its slot from zero
            # at position 0, or from the checkpoint its cached prefix ends at; later chunks
            # continue what the slot holds.
            meta.states = StateBatch.build(state_items, dev, restores, saves)
        return (
            torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            meta,
            torch.tensor(sample_index, dtype=torch.long).to(dev, non_blocking=True),
        )

    @staticmethod
    def _paged_batch(seqs: list[tuple[int, int, int, list[int]]]) -> PagedBatch:
        """Sequences given as (first row, query rows, first position, block table)."""
        max_blocks = max((len(table) for *_, table in seqs), default=0)
        tables = [table + [0] * (max_blocks - len(table)) for *_, table in seqs]
        return PagedBatch(
            block_tables=torch.tensor(tables, dtype=torch.int32).view(len(seqs), max_blocks),
            seq_info=torch.tensor([s[:3] for s in seqs], dtype=torch.int32).view(len(seqs), 3),
        )

    def _group(self, seqs: list[tuple[int, int, int, list[int]]]) -> AttentionGroup:
        """One attention call for sequences given as (first row, query rows, first position,
        block table)."""
        max_blocks = max(len(table) for *_, table in seqs)
        block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for *_, table in seqs], dtype=torch.long)
        query_start = torch.tensor([s[0] for s in seqs], dtype=torch.long)
        qlen = torch.tensor([s[1] for s in seqs], dtype=torch.long)
        start = torch.tensor([s[2] for s in seqs], dtype=torch.long)
        max_q, max_ctx = int(qlen.max()), int((start + qlen).max())

        offsets = torch.arange(max_q)
        token_valid = offsets[None, :] < qlen[:, None]
        token_index = torch.where(token_valid, query_start[:, None] + offsets[None, :], 0)
        # Causal over absolute positions: query at position p sees keys 0..p. Padding rows
        # see key 0 only, so no row is fully masked (which would give NaN).
        query_pos = start[:, None] + offsets[None, :]
        keys = torch.arange(max_ctx)
        mask = keys[None, None, :] <= query_pos[:, :, None]
        mask = torch.where(token_valid[:, :, None], mask, keys[None, None, :] == 0)
        dev = self.device
        return AttentionGroup(
            block_tables=block_tables.to(dev, non_blocking=True),
            token_index=token_index.to(dev, non_blocking=True),
            token_valid=token_valid.to(dev, non_blocking=True),
            mask=mask.unsqueeze(1).to(dev, non_blocking=True),
        )
