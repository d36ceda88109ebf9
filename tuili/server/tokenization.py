"""Text to token ids and back on the HTTP side: prompts, chat templates, logprob token strings.

The engine thread owns the engine's tokenizer. The HTTP side has two lanes, each a worker
thread with a tokenizer copy of its own, so a tokenizer object is never shared between
threads, and a long prompt being tokenized stalls neither the event loop nor the engine's
step loop. Small work (texts up to LARGE_CHARS characters, up to LARGE_TOKENS ids) takes one
lane, large work the other: 3 MB of spaces that fit the context (64 per token) take seconds
to tokenize, and would otherwise hold every small request's tokenization behind them. The
Rust tokenizer releases the GIL, so the lanes run at once.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tuili.errors import RequestError
from tuili.tokenizer import Tokenizer

T = TypeVar("T")


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, content_special_tokens: bool = False) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._large_tokenizer = copy.deepcopy(tokenizer)  # the large lane's own copy
        # Whether special-token text in message content is parsed as special tokens (the
        # --special-tokens-in-messages opt-in); by default content is text (issue 20.4).
        self.content_special_tokens = content_special_tokens
        self.vocab_size = vocab_size  # the model's: token ids must lie in [0, vocab_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuili-tokenizer")
        self._large_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuili-tokenizer-large")
        self._token_strings: list[str] | None = None  # immutable once built

    # Work above these sizes takes the large lane.
    LARGE_CHARS = 16384
    LARGE_TOKENS = 4096

    async def _run(self, fn: Callable[[Tokenizer], T], large: bool = False) -> T:
        if self._tokenizer is None:
            raise RequestError(
                "this model has no tokenizer: send prompts as token ids (a list of integers), not text or messages"
            )
        executor, tokenizer = ((self._large_executor, self._large_tokenizer) if large
                               else (self._executor, self._tokenizer))
        return await asyncio.get_running_loop().run_in_executor(executor, fn, tokenizer)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(lambda t: t.encode(text, add_special_tokens=add_special_tokens),
                               large=len(text) > self.LARGE_CHARS)

    # A token spans at most a few characters in practice; a prompt this many times the context in
    # characters is tokenized only as far as it takes to prove it too long.
    PROBE_CHARS_PER_TOKEN = 8

    async def encode_prompt(self, text: str, field: str, max_model_len: int) -> list[int]:
        """`encode(text)`, except that a text far longer than the context is refused after
        tokenizing a prefix: a 1 MB prompt for a 512-token context would otherwise hold the
        tokenizer thread for a second, only to be refused."""
        await self.check_text_length(text, field, max_model_len)
        return await self.encode(text)

    async def check_text_length(self, text: str, field: str, max_model_len: int) -> None:
        """Refuse `text` if it has more than PROBE_CHARS_PER_TOKEN x max_model_len characters
        and a prefix of that many characters alone overflows the context; a shorter text, or
        one whose prefix fits, passes (it is tokenized whole, and checked exactly, later)."""
        probe = self.PROBE_CHARS_PER_TOKEN * max_model_len
        if len(text) > probe:
            head = await self._run(lambda t: t.encode(text[:probe]), large=probe > self.LARGE_CHARS)
            # A cut can split a token in two, and BOS counts once: a small margin.
            if len(head) > max_model_len + 2:
                raise RequestError(
                    f"{field} has {len(text)} characters; its first {probe} alone are {len(head)} tokens, but the "
                    f"context holds {max_model_len}: shorten it"
                )

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat rendered by the model's template and tokenized; `tools` reach the template."""
        size = sum(len(m["content"]) if isinstance(m.get("content"), str) else
                   sum(len(part["text"]) for part in m.get("content") or ()) for m in messages)
        kwargs = {"tools": tools} if tools else {}
        return await self._run(lambda t: t.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, content_special_tokens=self.content_special_tokens,
            **kwargs), large=size > self.LARGE_CHARS)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template text (None without a tokenizer or template)."""
        return None if self._tokenizer is None else self._tokenizer.hf_tokenizer.chat_template

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.check_ids(token_ids, "tokens")
        return await self._run(lambda t: t.decode(list(token_ids), skip_special_tokens),
                               large=len(token_ids) > self.LARGE_TOKENS)

    def check_ids(self, token_ids: Sequence[int], field: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"{field} holds token id {bad}, which is invalid: expected integers in [0, {self.vocab_size})")

    async def token_strings(self) -> list[str]:
        """Each token id's own text (special tokens spelled out), for logprobs; built on first use.

        A token that holds part of a multi-byte character reads as U+FFFD here.
        """
        if self._token_strings is None:
            vocab = self.vocab_size

            def build(t: Tokenizer) -> list[str]:
                return [t.decode([i], skip_special_tokens=False) for i in range(min(vocab, t.vocab_size))]

            strings = await self._run(build, large=True)  # the whole vocabulary
            self._token_strings = strings + [""] * (vocab - len(strings))  # model ids without a token
        return self._token_strings

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large_executor.shutdown(wait=False, cancel_futures=True)
