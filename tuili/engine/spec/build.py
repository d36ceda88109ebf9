"""Builds the engine's Speculator from its validated SpeculativeConfig."""

from __future__ import annotations

from pathlib import Path

import torch

from tuili.config import EngineConfig, ModelConfig, SpeculativeConfig
from tuili.engine.pool import PoolPlan
from tuili.engine.runner import ModelRunner
from tuili.engine.spec.draft import DraftModel
from tuili.engine.spec.mtp import MTPProposer
from tuili.engine.spec.speculator import PromptLookup, Proposer, Speculator
from tuili.engine.stopping import StopTokens
from tuili.errors import TuiliError
from tuili.platform import Platform


def build_speculator(
    config: EngineConfig, target: ModelConfig, target_path: Path, pool: PoolPlan, platform: Platform,
    dtype: torch.dtype, stop_tokens: StopTokens, runner: ModelRunner,
) -> Speculator:  # fmt: skip
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig)  # EngineConfig.validate parsed it
    if config.tensor_parallel_size > 1 and (target.is_hybrid or spec.method == "mtp"):
        # Rank 0 alone verifies: the workers' linear-attention states would not roll back, and
        # they do not run the MTP layers.
        raise TuiliError(
            f"speculative_config method={spec.method!r} is not supported with tensor_parallel_size="
            f"{config.tensor_parallel_size} for {target.architecture} yet"
            + (": MTP runs on one device" if spec.method == "mtp" else
               ": a rejection's linear-attention state is restored on rank 0 only")
        )  # fmt: skip
    proposer: Proposer
    if spec.method == "ngram":
        proposer = PromptLookup(spec)
    elif spec.method == "mtp":
        proposer = MTPProposer(runner, pool, spec.num_speculative_tokens, config.max_num_seqs, str(target_path))
    else:
        # A self-draft adopts the target's KV: on one device, where rank 0's runner holds all of it.
        whole = config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1
        proposer = DraftModel(spec, config, str(target_path), target.vocab_size, pool, platform, dtype, stop_tokens,
                              runner if whole else None)
    return Speculator(spec, proposer, pool.max_model_len)
