"""A tensor- or pipeline-parallel worker rank: builds its shard of the engine, then runs rank 0's steps.

Started by rank 0 as `python -m tuili.parallel.worker` (the engine config in the environment,
tuili/parallel/group.py), or reached from `tuili serve` / `tuili generate` on a rank other than
0 under torchrun (`run_worker`). Exit status: 0 when rank 0 stopped it, 1 when a rank was lost.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import sys

from tuili.config import EngineConfig
from tuili.engine.core import LLMEngine
from tuili.parallel.group import CONFIG_ENV, WorkerLostError, under_torchrun
from tuili.parallel.ranked_runner import RankedRunner

logger = logging.getLogger(__name__)


def is_worker_rank(config: EngineConfig) -> bool:
    """Whether this process is a rank other than 0 of a tensor- or pipeline-parallel launch (torchrun)."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return world > 1 and under_torchrun() and int(os.environ["RANK"]) != 0


def run_worker(config: EngineConfig) -> int:
    engine = LLMEngine(config)
    runner = engine.runner
    assert isinstance(runner, RankedRunner)
    try:
        runner.serve()
    except WorkerLostError as e:
        logger.error("%s worker stops: %s", runner.group.kind, e)
        return 1
    finally:
        engine.close()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = pickle.loads(base64.b64decode(os.environ[CONFIG_ENV]))
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
