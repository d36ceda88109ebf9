"""Where tuili/perf meets the engine it measures: `build_engine`, the one way perf builds one.

`tuili probe` (host overheads of toy engines) and `tuili plan --measure` (the planned shape, run
for real) time engine steps from the outside; everything else in perf/ judges numbers and never
imports the engine.
"""

from __future__ import annotations

from tuili.engine.core import LLMEngine
from tuili.engine.llm import LLM
from tuili.engine.stats import StepRecord


class StepLog:
    """An observer keeping the last step's record. It wants device time, so that a step timed
    around `engine.step()` includes the device's work on a GPU too."""

    wants_device_time = True

    def __init__(self) -> None:
        self.last: StepRecord | None = None

    def on_step(self, record: StepRecord) -> None:
        self.last = record


def build_engine(model: str, **options) -> tuple[LLMEngine, StepLog]:
    """The only way perf builds an engine: `model` (a checkpoint path) with LLM's `options`
    (EngineConfig fields; LLM's offline defaults for the rest), with a StepLog attached. With
    `tensor_parallel_size` or `pipeline_parallel_size` above 1 this process becomes rank 0 and
    starts the other ranks as worker processes on this machine; the caller ends them with
    `engine.close()` on every path (the observer sees rank 0's steps, the whole group's)."""
    engine = LLM(model, **options).engine
    log = StepLog()
    engine.add_observer(log)
    return engine, log
