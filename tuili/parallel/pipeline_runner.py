"""The runner of a pipeline-parallel engine: each rank is one stage (tuili/parallel/pipeline.py);
the scheduler, the block manager and the sampler live on rank 0 (the first stage) only.

A step: rank 0 cuts the scheduled batch into up to M micro-batches (contiguous runs of whole
items, balanced by tokens, of MIN_MICRO_BATCH_TOKENS or more: a decode step stays whole), prepares each one's inputs as ModelRunner does (token ids,
positions, attention metadata, the rows to sample) and broadcasts them all. Then every stage
goes through the micro-batches in order: receive the residual stream from the stage before
(the first stage embeds the tokens), run its layers, send the result on without waiting for
the send (the last stage instead projects the sampling rows to logits and sends those to rank
0). So while stage s runs micro-batch i, stage s+1 runs micro-batch i-1: within a step the
stages overlap except for the pipeline's fill and drain. Steps do not overlap: the next step's
batch depends on the tokens this one samples, so rank 0 waits for the last micro-batch's
logits before it samples (once, for the whole batch, as on one device).

Prompt logprobs are scored where the final hidden states are, on the last stage, and gathered
to rank 0 at the end of the step. Decode graphs are off (a replayed graph cannot send).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from tuili.engine.pool import PoolPlan
from tuili.engine.prompt_logprobs import (
    PromptLogprobs,
    PromptSpan,
    project_blocks,
    prompt_spans,
    score,
    score_rows,
)
from tuili.engine.runner import RunnerConfig
from tuili.engine.scheduler import ScheduledSeq
from tuili.parallel.group import TensorParallelGroup
from tuili.parallel.pipeline import StageNetwork
from tuili.parallel.ranked_runner import RankedRunner

_EXECUTE = "execute"
# A step is cut into micro-batches of at least this many tokens. Each micro-batch makes every
# stage read all its weights once more, so a small one is weight-streaming-bound and costs
# more than the overlap it buys: on the 2-core test machine, PP=2 over SmolLM2, decode steps of 4
# and 16 sequences took 2-3x as long cut in two as whole, and a prefill of 4 x 64 tokens 1.6x,
# while one of 4 x 256 tokens took 0.7x (docs/engine.md, "Pipeline parallelism").
MIN_MICRO_BATCH_TOKENS = 256


@dataclass(frozen=True)
class PromptTokens:
    """What scoring reads of a sequence (tuili/engine/prompt_logprobs.py): its tokens and how
    many top logprobs it asks for; sent to the last stage instead of the Sequence itself."""

    token_ids: list[int]
    params: Any  # an object with prompt_logprobs


@dataclass(frozen=True)
class TopK:
    prompt_logprobs: int


@dataclass
class MicroBatch:
    """One micro-batch's inputs (ModelRunner._prepare's), the rows whose logits rank 0 wants
    (`logit_rows`: indices into its tokens), and its prompt spans to score."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any
    logit_rows: torch.Tensor
    spans: list[PromptSpan]


class PipelineModelRunner(RankedRunner):
    def __init__(self, model: StageNetwork, pool: PoolPlan, config: RunnerConfig, group: TensorParallelGroup) -> None:
        super().__init__(model, pool, config, group)  # type: ignore[arg-type]
        self.stage = model.stage
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.dtype = config.dtype

    # -- rank 0 --------------------------------------------------------------------------

    @torch.inference_mode()
    def sample_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        logits, _ = self._step(batch, score_prompts=False)
        return logits

    @torch.inference_mode()
    def score_and_sample_logits(
        self, batch: list[ScheduledSeq], spans: list[PromptSpan],
    ) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        logits, scored = self._step(batch, score_prompts=True)
        # The last stage scored stand-ins (PromptTokens): give each result its sequence back.
        return logits, [dataclasses.replace(s, seq=span.seq) for s, span in zip(scored, spans, strict=True)]

    @torch.inference_mode()
    def logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Every scheduled token's logits, for scoring (one micro-batch: not a serving path)."""
        input_ids, positions, meta, _ = self._prepare(batch)
        every_row = torch.arange(len(input_ids), device=self.device)
        micro = [MicroBatch(input_ids, positions, meta, every_row, [])]
        self.group.broadcast((_EXECUTE, micro, False))
        logits = self._run(micro, False)[0]
        assert logits is not None
        return logits

    def decode_weight_bytes(self) -> int:
        """Bytes of weights this stage reads in a decode step of one sequence: all its weights
        but the embedding table (a few rows are read) and, on the last stage, what the output
        head reads for one row."""
        storages = self._weight_storages()
        model = self.model
        lookup = model.model.embed_tokens if self.stage.is_first else None
        unread = [*lookup.parameters(), *lookup.buffers()] if lookup is not None else []
        if self.stage.is_last:
            unread += [*model.lm_head.parameters(), *model.lm_head.buffers()]
        for tensor in unread:
            storages.pop(tensor.untyped_storage().data_ptr(), None)
        if self.stage.is_last:
            for tensor in model.lm_head.weights_read(1, self.device):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(storages.values())

    def _step(self, batch: list[ScheduledSeq], score_prompts: bool) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        micro = [self._micro_batch(part, score_prompts) for part in split_batch(batch, self.stage.world)]
        self.group.broadcast((_EXECUTE, micro, score_prompts))
        pieces = [logits for logits in self._run(micro, score_prompts) if logits is not None]
        last = self.stage.world - 1
        scored = self.group.gather_objects([])[last * self.stage.tp] if score_prompts else []
        return (torch.cat(pieces) if pieces else None), scored

    def _micro_batch(self, part: list[ScheduledSeq], score_prompts: bool) -> MicroBatch:
        input_ids, positions, meta, sample_index = self._prepare(part)
        spans = []
        if score_prompts:
            for span in prompt_spans(part):
                seq = span.seq
                tokens = PromptTokens(seq.token_ids[: span.first_token + span.num_rows], TopK(seq.params.prompt_logprobs))
                spans.append(dataclasses.replace(span, seq=tokens))
        return MicroBatch(input_ids, positions, meta, sample_index, spans)

    # -- every stage ---------------------------------------------------------------------

    def _run(self, micro: list[MicroBatch], score_prompts: bool) -> list[torch.Tensor | None]:
        """Every micro-batch through this stage, in order. Rank 0 returns each one's logits (None
        for one without logit rows); the other ranks return nothing and, when `score_prompts`,
        meet rank 0's gather of what the last stage scored. Under tensor parallelism each rank
        of a stage exchanges its hidden states with its counterparts in the stages around it;
        the last stage's logits are whole on its first rank (VocabParallelHead), which sends them."""
        stage, group = self.stage, self.group
        pending = []  # waits of sends in flight: their tensors must live until they finish
        scored: list[PromptLogprobs] = []
        holds_logits = stage.is_last and stage.tp_rank == 0
        for i, mb in enumerate(micro):
            tokens = len(mb.input_ids)
            if stage.is_first:
                x, residual = self.model.embed(mb.input_ids), None
            else:
                stream = group.recv(torch.empty(2, tokens, self.hidden_size, dtype=self.dtype, device=self.device),
                                    stage.peer(stage.rank - 1), i)
                x, residual = stream[0], stream[1]
            x, residual = self.model.run_layers(x, residual, mb.positions, mb.meta)
            if not stage.is_last:
                pending.append(group.send(torch.stack((x, residual)), stage.peer(stage.rank + 1), i))
                continue
            hidden = self.model.finish(x, residual)
            if mb.spans and holds_logits:
                scored += score(hidden, mb.spans, self.model.compute_logits)
            elif mb.spans:  # the other ranks take part in each projection's gather
                for _block in project_blocks(hidden, score_rows(mb.spans), self.model.compute_logits):
                    pass
            if len(mb.logit_rows):
                logits = self.model.compute_logits(hidden[mb.logit_rows]).contiguous()
                if holds_logits:
                    pending.append(group.send(logits, 0, i))
        for wait in pending:
            wait()
        if not stage.is_scheduler:
            if score_prompts:
                group.gather_objects(scored)
            return []
        out: list[torch.Tensor | None] = []
        last = stage.world - 1
        for i, mb in enumerate(micro):
            rows = len(mb.logit_rows)
            out.append(group.recv(torch.empty(rows, self.vocab_size, device=self.device), last * stage.tp, i)
                       if rows else None)
        return out

    def _handle(self, message: tuple) -> None:
        """A stage other than the first: run rank 0's micro-batches."""
        self._run(message[1], message[2])


def split_batch(
    batch: list[ScheduledSeq], parts: int, min_tokens: int = MIN_MICRO_BATCH_TOKENS,
) -> list[list[ScheduledSeq]]:
    """`batch` as up to `parts` contiguous runs of whole items, as many as give each run about
    `min_tokens` tokens or more, each as near an equal share of the tokens as whole items allow
    (never an empty run). Contiguous: the sampling rows of the runs, in order, are the batch's."""
    total = sum(item.num_tokens for item in batch)
    parts = max(1, min(parts, len(batch), total // min_tokens))
    runs: list[list[ScheduledSeq]] = [[]]
    done = 0
    for index, item in enumerate(batch):
        left_items, left_runs = len(batch) - index, parts - len(runs)
        # Start a new run once this one has its share, or when the items left are just enough
        # to give each remaining run one.
        if runs[-1] and left_runs and (done >= total * len(runs) / parts or left_items <= left_runs):
            runs.append([])
        runs[-1].append(item)
        done += item.num_tokens
    return runs
