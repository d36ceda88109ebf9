"""Structured output: grammars compiled once, one matcher per sequence, a token mask per step.

The grammar engine is xgrammar (chosen over llguidance by benchmarks/grammar_engines.py, see
docs/server.md "Structured output"): a request's ``StructuredOutputsParams`` becomes a compiled
grammar (``GrammarCompiler.compile``, cached LRU by what the request asked for, so a schema is
compiled once however many requests use it), each sequence gets a ``GrammarState`` (an
xgrammar matcher) that the sampler asks for the tokens allowed next and advances with each
token it picks.

Invariant: a sequence's matcher has accepted exactly its generated tokens. Preemption keeps
the generated tokens (the recompute only rebuilds their KV), so the matcher stays as it is.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tuili.errors import RequestError
from tuili.sampling import StructuredOutputsParams

# Compiled grammars kept (a JSON schema's compiles to some 10-500 KB of token-mask cache).
GRAMMAR_CACHE_SIZE = 256


def _xgrammar():
    # Imported on first use: a server that never sees a structured request never loads it.
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; thread-safe, LRU-cached.

    ``hf_tokenizer`` is the model's transformers tokenizer, ``vocab_size`` the model's (the
    logits' width, which may exceed the tokenizer's), ``stop_token_ids`` the ids that end a
    sequence (the grammar allows them once the output is complete). The tokenizer's vocabulary
    is read on the first compile (half a second for 150k tokens), not at engine start."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._xgr_compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compilations = 0  # grammars compiled (not served from the cache), for tests and stats

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for `spec`; RequestError naming the part that does not compile."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self.compilations += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def _compiler(self):
        with self._lock:
            if self._xgr_compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # xgrammar's own cache is off: ours is bounded in entries and keyed by the request.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler
        kind = spec.key[0]
        try:
            # JSON as json.dumps writes it (", " and ": ", no other whitespace): a small model
            # let loose on "any whitespace" fills its budget with newlines.
            if spec.json is not None:
                return compiler.compile_json_schema(json.dumps(spec.json), strict_mode=True, any_whitespace=False)
            if spec.json_object:
                # Any JSON object (OpenAI's json_object), not any JSON value.
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            return compiler.compile_grammar(spec.grammar or "")
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse and schema errors
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RequestError(f"structured_outputs.{kind} does not compile: {message}") from error

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(spec)))


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`, which the mask allowed. A token the grammar refuses (possible
        only when a stop token ended a complete output, or when min_tokens overrode the mask)
        leaves the state as it was: the sequence ends there anyway."""
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token_id)

    @property
    def can_end(self) -> bool:
        """Whether the output so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed() or self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            # A stop token completed the output and the sequence goes on (ignore_eos): nothing
            # but stop tokens may follow a complete match.
            bitmask[row] = 0
            for token_id in self._matcher.stop_token_ids:
                bitmask[row, token_id // 32] |= 1 << (token_id % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)


class TokenMasks:
    """The allowed-token bitmask of a batch's rows that follow a grammar, filled on a worker
    thread while the forward pass runs; `apply` waits for it and masks the logits in place."""

    def __init__(self, states: list[GrammarState | None], vocab_size: int, executor: ThreadPoolExecutor) -> None:
        self.rows = [i for i, state in enumerate(states) if state is not None]
        self.vocab_size = vocab_size
        # One bitmask row per batch row (rows without a grammar stay unread), so that a row's
        # index is the same in the logits and in the bitmask.
        self._bitmask = _xgrammar().allocate_token_bitmask(len(states), vocab_size)
        self._done: Future = executor.submit(self._fill, [(i, states[i]) for i in self.rows])

    def _fill(self, work: list[tuple[int, GrammarState]]) -> None:
        # The bitmask was made under the runner's inference mode; this thread must be too to write it.
        with torch.inference_mode():
            for row, state in work:
                state.fill(self._bitmask, row)

    def allowed(self, row: int) -> torch.Tensor:
        """Bool [vocab] of the tokens batch row `row` may take."""
        self._done.result()
        words = self._bitmask[row]
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token a grammar row does not allow to -inf, in place (float32 logits)."""
        self._done.result()
        bitmask = self._bitmask if logits.is_cpu else self._bitmask.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=self.rows
        )
