"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``), scored as the prefill runs.

A chunk that computes prompt positions start .. start + n - 1 has, at the row of position p,
the model's distribution of the token at p + 1: so it scores prompt tokens start + 1 ..
min(start + n, prompt_len - 1) (the last prompt position predicts the first generated token,
which is sampling's business). Those rows are projected to the vocabulary PROJECT_ROWS at a
time, and each block is reduced at once to what is kept (the prompt token's logprob and rank,
and the top-k): no more than PROJECT_ROWS x vocab float32 logits exist at any moment, however
long the prompt or the chunk the scheduler gave.

The logprobs are of the raw model distribution (log_softmax of the logits; no penalty or
filter applies to a prompt), as vLLM returns them. The rank is 1 + the number of other tokens
at least as likely (vLLM's: ties count against the token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tuili.engine.request import Sequence
from tuili.engine.scheduler import ScheduledSeq

# Rows of hidden states projected to logits at once: 128 x a 152k vocabulary is 78 MB of float32.
PROJECT_ROWS = 128


@dataclass(frozen=True)
class PromptSpan:
    """The rows of one batch item that score prompt tokens: `num_rows` rows from `first_row`,
    the first at prompt position `first_token - 1`."""

    seq: Sequence
    first_row: int
    first_token: int  # the prompt position of the first token scored (>= 1)
    num_rows: int


@dataclass
class PromptLogprobs:
    """What one chunk scored: prompt tokens first_token .. first_token + len(logprobs) - 1."""

    seq: Sequence
    first_token: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]  # per token, the seq's prompt_logprobs most likely token ids
    top_logprobs: list[list[float]]


def prompt_spans(batch: list[ScheduledSeq]) -> list[PromptSpan]:
    """The items of `batch` that score prompt tokens, with their rows in the flat batch."""
    spans = []
    row = 0
    for item in batch:
        seq = item.seq
        if seq.scores_prompt and not item.draft:
            end = min(item.start + item.num_tokens, seq.prompt_len - 1)  # the last row scoring a prompt token
            if end > item.start:
                spans.append(PromptSpan(seq, row, item.start + 1, end - item.start))
        row += item.num_tokens
    return spans


def score_rows(spans: list[PromptSpan]) -> list[int]:
    """The flat batch rows the spans project, in order."""
    return [r for span in spans for r in range(span.first_row, span.first_row + span.num_rows)]


def project_blocks(hidden: torch.Tensor, rows: list[int],
                   project: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[torch.Tensor]:
    """Logits of `rows` of `hidden`, PROJECT_ROWS at a time, each made when asked for (a
    tensor-parallel worker runs through them for the collectives inside `project`)."""
    index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    for i in range(0, len(rows), PROJECT_ROWS):
        yield project(hidden[index[i : i + PROJECT_ROWS]])


def score(hidden: torch.Tensor, spans: list[PromptSpan],
          project: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprobs]:
    """Score the spans' prompt tokens from the final hidden states of a batch (`project` maps
    hidden rows to float32 logits)."""
    rows = score_rows(spans)
    targets = [t for span in spans for t in span.seq.token_ids[span.first_token : span.first_token + span.num_rows]]
    k_max = max(span.seq.params.prompt_logprobs for span in spans)
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for i, logits in zip(range(0, len(rows), PROJECT_ROWS), project_blocks(hidden, rows, project), strict=True):
        block = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(targets[i : i + PROJECT_ROWS], dtype=torch.long, device=block.device)
        chosen = block.gather(1, target.unsqueeze(1))
        logprobs += chosen.squeeze(1).tolist()
        ranks += (block >= chosen).sum(dim=1).tolist()
        if k_max:
            values, ids = block.topk(min(k_max, block.shape[1]), dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
        else:
            top_values += [[] for _ in range(block.shape[0])]
            top_ids += [[] for _ in range(block.shape[0])]
    results = []
    offset = 0
    for span in spans:
        k = span.seq.params.prompt_logprobs
        part = slice(offset, offset + span.num_rows)
        results.append(PromptLogprobs(
            span.seq, span.first_token, logprobs[part], ranks[part],
            [ids[:k] for ids in top_ids[part]], [values[:k] for values in top_values[part]],
        ))  # fmt: skip
        offset += span.num_rows
    return results
