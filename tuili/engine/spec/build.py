"""Builds the engine's Speculator from its validated SpeculativeConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuili.config import EngineConfig, SpeculativeConfig
from tuili.engine.spec.speculator import PromptLookup, Proposer, Speculator
from tuili.errors import TuiliError

if TYPE_CHECKING:
    from tuili.engine.core import LLMEngine


def build_speculator(config: EngineConfig, engine: LLMEngine) -> Speculator:
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig)  # EngineConfig.validate parsed it
    if engine.model_config.is_hybrid:
        raise TuiliError(
            f"speculative_config is not supported for {engine.model_config.architecture} yet: rejected tokens "
            "would need its linear-attention state restored per proposal position"
        )
    proposer: Proposer
    if spec.method == "ngram":
        proposer = PromptLookup(spec)
    else:
        from tuili.engine.spec.draft import DraftModel  # loads a model: only when asked for

        proposer = DraftModel(
            spec, config, str(engine.model_path), engine.model_config.vocab_size, engine.pool, engine.platform,
            engine.dtype, engine.runner.stop_tokens,
        )
    return Speculator(spec, proposer, engine.max_model_len)
