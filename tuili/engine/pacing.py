"""How many prompt tokens a step may carry beside decoding sequences without stalling them.

Chunked prefill puts prompt chunks in the same step as other sequences' decodes, and a step
is as slow as its work: on a 2-core CPU, 512 prompt tokens of SmolLM2-135M take ~350 ms while
a decode step of a few streams takes ~10 ms, so every stream waits 35 times its usual gap
for each such step. `StepPacer` bounds that stall, as Sarathi-Serve's stall-free batching
does, with the budget measured rather than configured: it learns from the engine's own step
records how long a decode-only step takes (`decode_seconds`) and what each prompt token adds
to a step (`seconds_per_prompt_token`), and allows a step that carries decodes

    (stretch - 1) * decode_seconds / seconds_per_prompt_token

prompt tokens, so such a step takes about `stretch` times a decode-only one. A step with no
decodes is not limited (nothing streams), nor is any step before both figures are known.
Prompts still progress while others stream (at least one token a step), at the price of a
slower prefill: with stretch 2, about half of each step's time.

Both figures are exponential moving averages, so the budget follows the load (more decoding
sequences make a decode-only step slower and allow more prompt tokens beside it).
"""

from __future__ import annotations

from tuili.engine.stats import StepRecord

# Weight of the newest step in each moving average: the budget settles within ~10 steps.
SMOOTHING = 0.2


class StepPacer:
    """A step observer (on the engine's thread) that keeps the prompt-token budget of steps
    carrying decodes; `prefill_limit()` is read by the engine before each schedule."""

    wants_device_time = True  # a GPU step's time without its device work would say nothing

    def __init__(self, stretch: float) -> None:
        if not stretch > 1.0:
            raise ValueError(f"stretch={stretch} is invalid: expected a number above 1")
        self.stretch = stretch
        self.decode_seconds: float | None = None  # a decode-only step's wall time
        self.seconds_per_prompt_token: float | None = None  # what a prompt token adds to a step

    def on_step(self, record: StepRecord) -> None:
        if not record.synchronized or record.seconds <= 0:
            return
        prompt_tokens = sum(length for _, length in record.prefill_chunks)
        if prompt_tokens == 0:
            if record.decode_context_lens:
                self.decode_seconds = _average(self.decode_seconds, record.seconds)
            return
        # A step's fixed part is about a decode-only step's; without a measure of that yet,
        # the whole step is charged to its prompt tokens (a larger cost: a smaller budget).
        added = record.seconds - (self.decode_seconds or 0.0) if record.decode_context_lens else record.seconds
        per_token = max(added, 0.0) / prompt_tokens
        if per_token > 0:
            self.seconds_per_prompt_token = _average(self.seconds_per_prompt_token, per_token)

    def prefill_limit(self) -> int | None:
        """Prompt tokens a step that carries decodes may hold; None while not yet measured."""
        if self.decode_seconds is None or not self.seconds_per_prompt_token:
            return None
        return max(1, int((self.stretch - 1.0) * self.decode_seconds / self.seconds_per_prompt_token))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
