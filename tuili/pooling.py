"""Embeddings from a decoder: how a prompt's final hidden states become one vector.

vLLM's names and defaults for decoder models (docs/engine.md, "Embeddings"): the engine's
`pooler_config` ({"pooling_type": "LAST" | "MEAN", "normalize": true}, its default LAST,
normalized) and the per-request `PoolingParams` (`normalize`, `dimensions`). The hidden states
pooled are the final ones, after the model's final norm, as transformers' `last_hidden_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuili.errors import RequestError, TuiliError

POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding request's vector is made: the last prompt token's hidden state or the
    mean over every prompt token's, then (`normalize`) scaled to unit L2 norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, value: dict[str, Any] | PoolerConfig | str | None) -> PoolerConfig:
        """vLLM's `pooler_config` dict (or a PoolerConfig, or just a pooling type such as
        "mean"); None: the default. Raises TuiliError naming a bad key or value."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            value = {"pooling_type": value.pooling_type, "normalize": value.normalize}
        elif isinstance(value, str):
            value = {"pooling_type": value}
        if not isinstance(value, dict):
            raise TuiliError(f"pooler_config={value!r} is invalid: expected a dict such as "
                             '{"pooling_type": "MEAN", "normalize": true}')
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise TuiliError(f"pooler_config key(s) {unknown} are not supported: expected pooling_type and normalize")
        kind = value.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise TuiliError(f"pooler_config pooling_type={kind!r} is not supported: expected one of "
                             f"{', '.join(POOLING_TYPES)} (a decoder has no CLS token)")
        normalize = value.get("normalize", True)
        if not isinstance(normalize, bool):
            raise TuiliError(f"pooler_config normalize={normalize!r} is invalid: expected true or false")
        return cls(kind.upper(), normalize)

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's hidden state counts: a prefix-cache hit would skip some."""
        return self.pooling_type == "MEAN"


@dataclass
class PoolingParams:
    """vLLM's per-request pooling parameters. `normalize` None: the engine's pooler_config says;
    `dimensions` (Matryoshka truncation) is only accepted when it equals the model's hidden size:
    tuili's models are not trained to be truncated."""

    normalize: bool | None = None
    dimensions: int | None = None

    def resolve(self, config: PoolerConfig, hidden_size: int, pooling_type: str | None = None) -> PoolerConfig:
        """The pooling one request gets: `config` with this request's overrides."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError(f"normalize={self.normalize!r} is invalid: expected true or false")
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims != hidden_size):
            raise RequestError(
                f"dimensions={dims!r} is not supported: this model's embeddings have {hidden_size} dimensions "
                "and cannot be shortened; leave dimensions out or give exactly that"
            )
        if pooling_type is not None:
            if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
                raise RequestError(f"pooling={pooling_type!r} is not supported: expected one of "
                                   f"{', '.join(t.lower() for t in POOLING_TYPES)} (a decoder has no CLS token)")
            config = PoolerConfig(pooling_type.upper(), config.normalize)
        if self.normalize is not None:
            config = PoolerConfig(config.pooling_type, self.normalize)
        return config
