"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
    # Logit controls (vLLM's fields; tuili/layers/sampler.py step 0). Token ids are checked
    # against the model's vocabulary when the request enters the engine.
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated as a whole (vLLM's rule: bad_words_token_ids)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len

    # Normalised in __post_init__: always a list, possibly empty.
    stop_strings: list[str] = field(init=False, repr=False)
    # Each bad word as token ids, set by `tokenize_bad_words` when the engine takes the request.
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)
    # The sampler's tensors of logit_bias and allowed_token_ids, built at the request's first
    # step (vocabulary size -> tensors; tuili/layers/sampler.py): a long list costs its
    # conversion once, not at every step.
    logit_control_cache: dict[int, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def controls_logits(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words edit this request's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it: its last k tokens (vLLM's left
        truncation), k = max_model_len for -1; the prompt unchanged when it is None."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == -1:
            k = max_model_len
        elif k > max_model_len:
            raise RequestError(
                f"truncate_prompt_tokens={k} is invalid: expected at most max_model_len={max_model_len}, or -1"
            )
        return prompt_token_ids[-k:]

    def tokenize_bad_words(self, encode: Callable[[str], list[int]], vocab_size: int) -> None:
        """Fill `bad_words_token_ids` as vLLM does: each word as written (leading spaces
        stripped) and, where the tokenizer spells it differently after a space, also as
        " word", which is how it appears mid-text; a version the tokenizer gives a different
        number of tokens is not added (vLLM's rule)."""
        self.bad_words_token_ids = []
        for word in self.bad_words or []:
            plain = encode(word.lstrip())
            if not plain:
                raise RequestError(f"bad_words entry {word!r} is invalid: it encodes to no tokens")
            self.bad_words_token_ids.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)
        self.check_token_ids(vocab_size)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise RequestError naming the first token id of logit_bias or allowed_token_ids (or
        a bad word's) outside [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words", [t for word in self.bad_words_token_ids for t in word])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"{name} token id {bad} is out of range: expected token ids in [0, {vocab_size})"
                )

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
        self._validate_logit_controls(bad)
        if self.seed is not None and (not isinstance(self.seed, int) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise bad("seed", self.seed, "a 64-bit signed integer")

    def _validate_logit_controls(self, bad: Callable[[str, object, str], RequestError]) -> None:
        def is_id(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not is_id(token):
                    raise RequestError(f"logit_bias key {token!r} is invalid: expected a non-negative integer token id")
                if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                        or not -100 <= bias <= 100):
                    raise bad(f"logit_bias[{token}]", bias, "a number in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
            wrong = next((t for t in self.allowed_token_ids if not is_id(t)), None)
            if wrong is not None:
                raise RequestError(f"allowed_token_ids entry {wrong!r} is invalid: expected a non-negative integer token id")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list):
                raise bad("bad_words", self.bad_words, "a list of words")
            wrong = next((w for w in self.bad_words if not isinstance(w, str) or not w.strip()), None)
            if wrong is not None:
                raise RequestError(f"bad_words entry {wrong!r} is invalid: expected a word (a string, not empty or blank)")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", k, "an integer >= 1, or -1 for the model's max_model_len")
