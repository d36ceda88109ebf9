"""What the engine tells about itself: a record of every step to its observers, and a
snapshot of its counters on demand (`LLMEngine.stats()`).

The engine knows no cost model and no hardware: whoever judges its steps (tuili/perf's
UtilizationMeter, a benchmark's timer) attaches as an observer and reads the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tuili.engine.block_manager import CacheStats

if TYPE_CHECKING:
    from tuili.engine.spec.speculator import SpecStats
    from tuili.engine.state_checkpoints import CheckpointStats


@dataclass(frozen=True)
class StepRecord:
    """One forward step, as scheduled and timed."""

    # Prefill chunks as (tokens already in the KV cache, chunk length); decodes as their context
    # length including the new token. A decode computes one generated token; anything else,
    # including the recompute of generated tokens after a preemption, is prefill.
    prefill_chunks: list[tuple[int, int]]
    decode_context_lens: list[int]
    num_sampled: int  # sequences that got a new token (a prefill chunk short of its end gets none)
    num_preempted: int  # sequences sent back to the queue to make room for this step
    prompt_tokens_computed: int  # prompt tokens run through the model (cache misses, recomputes)
    seconds: float  # wall time of the forward: host-tier copies, model, sampling
    # Whether `seconds` includes the device finishing its work: always on a CPU; on a GPU only
    # while an observer wants device time (a step that samples nothing returns earlier).
    synchronized: bool
    # Speculative decoding: verification chunks as (tokens already in the KV cache, positions
    # computed: the decode token and the proposals), and the draft model's forwards this step.
    verify_chunks: list[tuple[int, int]] = field(default_factory=list)
    num_accepted: int = 0  # proposals kept (each verification also yields the target's own token)
    draft_forwards: int = 0

    @property
    def num_tokens(self) -> int:
        return (sum(length for _, length in self.prefill_chunks) + len(self.decode_context_lens)
                + sum(length for _, length in self.verify_chunks))


class StepObserver(Protocol):
    """Receives every step's record, on the engine's thread, after the step's outputs are built."""

    # True: the engine waits for the device before it stops each step's clock (a synchronize
    # per step on a GPU, which costs throughput; nothing on a CPU).
    wants_device_time: bool

    def on_step(self, record: StepRecord) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    """The engine's state and counters at one moment (the counters since it started)."""

    num_requests: int  # unfinished requests
    num_running: int  # sequences holding KV blocks, scheduled every step
    num_waiting: int  # sequences queued for their first or resumed schedule
    num_blocks: int  # the KV pool's
    num_free_blocks: int  # free blocks, including cached ones a new sequence may reuse or evict
    num_cached_blocks: int  # blocks in the prefix cache (in use or free)
    kv_cache_usage: float  # fraction of the pool held by sequences (0 to 1)
    prefix_cache: CacheStats  # prompt tokens looked up, and hits per tier
    prompt_tokens_computed: int  # prompt tokens run through the model (cache misses, recomputes)
    generation_tokens: int  # tokens sampled, over all sequences
    num_steps: int  # forward steps run
    num_preemptions: int  # sequences preempted (each time counted)
    spec: SpecStats | None = None  # speculative decoding's counters, when it is on
    # a hybrid model's linear-attention state checkpoints (its prefix cache), when it has them
    state_checkpoints: CheckpointStats | None = None
