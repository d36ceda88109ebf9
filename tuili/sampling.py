"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from tuili.errors import RequestError

_GREEDY_TEMPERATURE = 1e-5
_SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class StructuredOutputsParams:
    """What a request's output must match, as vLLM's ``StructuredOutputsParams``: exactly one of
    a JSON schema (``json``, a dict or its JSON text), any JSON object (``json_object``), a
    regular expression, one of a list of strings (``choice``), or an EBNF / GBNF grammar.

    The sampler masks every token the grammar does not allow (tuili/layers/grammar.py), so the
    output matches unless ``max_tokens`` cuts it short (finish_reason "length")."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise RequestError(
                f"structured_outputs gives {given or 'nothing'}: expected exactly one of json, regex, choice, "
                "grammar, json_object"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise RequestError(f"structured_outputs.json={self.json!r} is invalid: expected a JSON schema object")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as error:
                raise RequestError(f"structured_outputs.json is not valid JSON: {error}") from error
        if self.choice is not None and (
            not isinstance(self.choice, list) or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise RequestError(f"structured_outputs.choice={self.choice!r} is invalid: expected non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RequestError(f"structured_outputs.{name}={value!r} is invalid: expected a string")

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the grammar (the compiled-grammar cache's key)."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar or ""


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
    # vLLM's: for every prompt token after the first, its logprob and rank under the model
    # (raw logits: no penalty applies to the prompt) and this many most likely alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

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
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", self.stop, "non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        if self.seed is not None and (not isinstance(self.seed, int) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise bad("seed", self.seed, "a 64-bit signed integer")
