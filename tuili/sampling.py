"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tuili.errors import RequestError

_GREEDY_TEMPERATURE = 1e-5
_SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class SamplingParams:
    """How one request picks its next tokens; mirrors vLLM's and the OpenAI API's fields.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1``
    and ``min_p == 0`` disable those filters. Penalties follow the OpenAI definitions
    (presence / frequency over generated tokens) and the CTRL/HF definition for
    ``repetition_penalty`` (over prompt and generated tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    # Normalised in __post_init__: always a list, possibly empty.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        """Arg-max decoding: temperature 0 (or so close to it that dividing by it would
        overflow, vLLM's rule), or top_k == 1."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise RequestError (a ValueError) naming the first bad field and what was expected."""

        def bad(name: str, value: object, expected: str) -> RequestError:
            return RequestError(f"{name}={value!r} is invalid: expected {expected}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a number > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", self.stop, "non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise bad("seed", self.seed, "a 64-bit signed integer")
