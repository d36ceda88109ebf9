"""What the runners of several ranks share (tensor-parallel: runner.py; pipeline: pipeline_runner.py).

Rank 0 runs the engine; every other rank runs `serve()`, a loop over rank 0's broadcast
messages, each a tuple whose first item names it. Three kinds are common to both: STOP (sent by
TensorParallelGroup.stop), COPY (host-tier block copies, made on every rank) and WEIGHTS (each
rank's weight bytes, gathered to rank 0); a runner handles its own kinds in `_handle`.
"""

from __future__ import annotations

import torch

from tuili.engine.block_manager import BlockCopies
from tuili.engine.pool import PoolPlan
from tuili.engine.runner import CausalLM, ModelRunner, RunnerConfig
from tuili.parallel.group import STOP, TensorParallelGroup

COPY, WEIGHTS = "copy", "weights"


class RankedRunner(ModelRunner):
    def __init__(self, model: CausalLM, pool: PoolPlan, config: RunnerConfig, group: TensorParallelGroup) -> None:
        super().__init__(model, pool, config)
        self.group = group

    @torch.inference_mode()
    def copy_blocks(self, copies: BlockCopies) -> None:
        if copies:
            self.group.broadcast((COPY, copies))
        super().copy_blocks(copies)

    def weight_bytes_per_rank(self) -> list[int]:
        """Bytes of weights each rank holds (measured by each rank over its own modules)."""
        self.group.broadcast((WEIGHTS,))
        return self.group.gather_objects(self.weight_bytes())

    @torch.inference_mode()
    def serve(self) -> None:
        """A rank other than 0: run rank 0's steps until it says stop (a lost rank raises
        WorkerLostError)."""
        while True:
            message = self.group.broadcast(None)
            kind = message[0]
            if kind == STOP:
                return
            if kind == COPY:
                ModelRunner.copy_blocks(self, message[1])  # this rank's copy; nothing to send on
            elif kind == WEIGHTS:
                self.group.gather_objects(self.weight_bytes())
            else:
                self._handle(message)

    def _handle(self, message: tuple) -> None:
        """A message of this runner's own kinds, on a rank other than 0."""
        raise NotImplementedError
