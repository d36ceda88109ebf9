"""The runner of a tensor-parallel engine: the scheduler and the sampler live on rank 0 only.

Each step rank 0 prepares the flat batch inputs as ModelRunner does (token ids, positions,
attention metadata, the rows to sample), broadcasts them, and every rank runs its shard of the
forward (the all-reduces inside it keep the ranks in step); the logits are gathered to rank 0,
which samples. Workers run `serve()` (ranked_runner.py): the same forwards on rank 0's inputs until told to stop.
Pure decode steps replay CPU graphs where the group's all-reduce is the native shared-memory
one (tuili/parallel/shm.py), which a graph records like any kernel: rank 0 sends the step's
plain inputs (DecodeStep) and every rank replays its own graph. Over gloo every step is eager.
"""

from __future__ import annotations

import torch

from tuili.engine.decode_graphs import DecodeStep
from tuili.engine.prompt_logprobs import PromptLogprobs, PromptSpan, project_blocks, score, score_rows
from tuili.engine.scheduler import ScheduledSeq
from tuili.parallel.ranked_runner import RankedRunner

_EXECUTE, _GRAPH, _SCORE, _LOGITS = "execute", "graph", "score", "logits"


class ParallelModelRunner(RankedRunner):
    def _replay(self, step: DecodeStep) -> torch.Tensor | None:
        """Every rank replays its shard's graph of the step (the all-reduces inside it; the
        logits gathered after it). A rank's graph runs the same collectives as its eager forward,
        so ranks stay in step even if one of them runs the step eagerly."""
        self.group.broadcast((_GRAPH, step))
        return super()._replay(step)

    def _eager_logits(self, batch: list[ScheduledSeq], pooling: bool) -> torch.Tensor | None:
        """ModelRunner's forward, on every rank: rank 0 broadcasts the inputs, all run their
        shard, the logits of the sampling rows come back to rank 0 (which samples, in execute)."""
        inputs = self._prepare(batch)
        num_sampling = len(inputs[3])
        self.group.broadcast((_EXECUTE, inputs, num_sampling))
        return self._forward(inputs, num_sampling)

    @torch.inference_mode()
    def score_and_sample_logits(
        self, batch: list[ScheduledSeq], spans: list[PromptSpan],
    ) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        """ModelRunner's, on every rank: the workers project the same blocks of prompt rows
        (each projection gathers the logits to rank 0), then the sampling rows."""
        inputs = self._prepare(batch)
        num_sampling = len(inputs[3])
        self.group.broadcast((_SCORE, inputs, num_sampling, score_rows(spans)))
        hidden = self.model(*inputs[:3])
        scored = score(hidden, spans, self.model.compute_logits)
        return self._sample_rows(hidden, inputs[3], num_sampling), scored

    @torch.inference_mode()
    def logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        inputs = self._prepare(batch)
        self.group.broadcast((_LOGITS, inputs))
        return self.model.compute_logits(self.model(*inputs[:3]))

    def _forward(self, inputs: tuple, num_sampling: int) -> torch.Tensor | None:
        input_ids, positions, meta, sample_index = inputs
        return self._sample_rows(self.model(input_ids, positions, meta), sample_index, num_sampling)

    def _sample_rows(self, hidden: torch.Tensor, sample_index: torch.Tensor, num_sampling: int) -> torch.Tensor | None:
        if not num_sampling:
            return None
        if num_sampling < hidden.shape[0]:
            hidden = hidden[sample_index]
        return self.model.compute_logits(hidden)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == _EXECUTE:
            self._forward(message[1], message[2])
        elif kind == _GRAPH:
            super()._replay(message[1])
        elif kind == _SCORE:
            _, inputs, num_sampling, rows = message
            hidden = self.model(*inputs[:3])
            for _block in project_blocks(hidden, rows, self.model.compute_logits):
                pass  # rank 0 reduces the gathered logits
            self._sample_rows(hidden, inputs[3], num_sampling)
        else:
            self.model.compute_logits(self.model(*message[1][:3]))
