"""Requests and their sequences: the scheduler's plain data, no tensors.

A request with n > 1 owns n sequences that share the prompt and sample independently.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tuili.pooling import PoolerConfig
from tuili.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks; gets tokens scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One output stream. Invariant: the KV cache holds exactly `num_computed_tokens`
    leading tokens of `token_ids`, in the blocks listed by `block_table`."""

    seq_id: int
    request_id: str
    index: int  # position among the request's n outputs
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at admission
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Hybrid models: the linear-attention state slot held while running (tuili/engine/state_slots.py).
    state_slot: int | None = None
    group: str = ""  # who it is scheduled fairly against (the server's API call); "": the default group
    # Speculative decoding: tokens proposed to follow token_ids, verified in the next step
    # (tuili/engine/spec/); cleared when the step is scheduled-and-verified or the sequence preempted.
    spec_token_ids: list[int] = field(default_factory=list)
    # An embedding request's pooling: the sequence finishes when its prompt has been computed,
    # with a vector instead of a token (tuili/pooling.py). None: it generates.
    pooling: PoolerConfig | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether computing this sequence's prompt also scores it (prompt logprobs): the
        request asks, this is its first output (one scores for all n), and the prompt has not
        been scored yet (a sequence preempted after sampling recomputes without scoring).
        Such a sequence never takes a cached prefix: the cache holds KV, not logprobs."""
        return self.params.prompt_logprobs is not None and self.index == 0 and self.num_output_tokens == 0


@dataclass
class Logprob:
    """One token's log probability, as vLLM's ``Logprob``: `rank` is 1 + the number of tokens
    at least as likely (1 for the most likely); `decoded_token` is the token's own text (None
    when the model has no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the position's token and its most likely alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """What one sequence has produced so far (cumulative, like vLLM's default)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[PositionLogprobs] | None  # per generated token: chosen + top alternatives
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs, per prompt position: None for the first (nothing
    # precedes it), then the prompt token and the top alternatives, as vLLM has it.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # An embedding request's vector (float32 values; `outputs` is then empty); None: it generates.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's pooled vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `LLM.embed` result for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
