"""Workloads: the conversations a benchmark sends, built without any tokenizer download.

A workload yields `Session`s. A session is a fixed context (a system prompt, a recorded history)
followed by user turns; every turn is one request carrying the whole history so far, the server's
own earlier replies included. Single-prompt workloads are sessions of one turn.

Synthetic text is random common English words. Each prompt is checked with a token counter (the
server's /tokenize, else a local tokenizer) and its word count adjusted until it has the asked
number of tokens; with no counter, one token per word is assumed and the real count comes from
the server's usage.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from tuili.bench.tokens import LocalTokenizer, TokenCounter
from tuili.errors import TuiliError

# Frequent words that common BPE and SentencePiece vocabularies hold as single tokens after a space.
WORDS: tuple[str, ...] = tuple("""
the of and to in is was for that with as on by at from his her they this are had not but be
have one all were which she there their an or been has who will more would when if no out so
said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place around
however home small found thought went say part once general high upon school every does got
united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end
why called eyes find going look asked later knew point next program city business give group
toward young days let room president side social present given several order national second
possible rather per face among form important often things looked early white case john become
large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members mind country area others done turned although
open problem god service certain kind began different door thus help sense means whole matter
perhaps itself york times law human line above name example action company hands local show
five history whether gave either today act feet across taken past quite anything seen having
death experience body word half really week field car words already themselves information tell
together college shall money period held keep sure free real probably seems political cannot
""".split())


# Prompts built (and checked with the counter) concurrently at a time.
BATCH = 32


@dataclass
class Turn:
    user: str
    max_tokens: int
    # Tokens in `user` as the builder's counter saw them (None when there was no counter).
    expected_tokens: int | None = None


@dataclass
class Session:
    turns: list[Turn]
    # Messages sent before the turns, fixed: a system prompt or a recorded conversation.
    context: list[dict] = field(default_factory=list)


def sample_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform over the integers in [mean*(1-r), mean*(1+r)], never below 1 (vLLM's definition)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


class PromptBuilder:
    """Texts of random words with a target token count, checked by a counter when there is one."""

    max_counts_per_text = 6

    def __init__(self, counter: TokenCounter | None) -> None:
        self.counter = counter
        self.tokens_per_word = 1.0

    async def calibrate(self, rng: random.Random) -> None:
        """Measure the counter's tokens per word on a long sample, to start each search near its end."""
        if self.counter is not None:
            sample = rng.choices(WORDS, k=1000)
            self.tokens_per_word = await self.counter.count(" ".join(sample)) / len(sample)

    async def text(self, seed: int, n_tokens: int) -> tuple[str, int | None]:
        """A text of about `n_tokens` tokens and its counted length (None without a counter).

        The token count of the first k words never decreases with k, so a secant search over k
        lands on the target or on the closest count either side within a few counter calls.
        """
        rng = random.Random(seed)
        words = rng.choices(WORDS, k=math.ceil(n_tokens / self.tokens_per_word * 1.5) + 8)
        k = max(1, round(n_tokens / self.tokens_per_word))
        if self.counter is None:
            return " ".join(words[:k]), None
        best: tuple[int, int] | None = None  # (k, count) closest to the target so far
        for _ in range(self.max_counts_per_text):
            while k > len(words):
                words += rng.choices(WORDS, k=len(words))
            counted = await self.counter.count(" ".join(words[:k]))
            if best is None or abs(counted - n_tokens) < abs(best[1] - n_tokens):
                best = (k, counted)
            if counted == n_tokens:
                break
            step = round((n_tokens - counted) * k / max(counted, 1))
            k = max(1, k + (step or (1 if counted < n_tokens else -1)))
        return " ".join(words[:best[0]]), best[1]

    async def texts(self, rng: random.Random, lengths: list[int]) -> list[tuple[str, int | None]]:
        """Texts of the given token counts, checked concurrently; `rng` advances the same either way."""
        seeds = [rng.getrandbits(64) for _ in lengths]
        return await asyncio.gather(*(self.text(seed, n) for seed, n in zip(seeds, lengths, strict=True)))


class RandomWorkload:
    """Independent single prompts with input and output lengths drawn uniformly around their means."""

    default_requests: int | None = None

    def __init__(self, builder: PromptBuilder, input_len: int, output_len: int, range_ratio: float,
                 seed: int) -> None:
        self.builder, self.input_len, self.output_len = builder, input_len, output_len
        self.range_ratio, self.seed = range_ratio, seed

    async def sessions(self) -> AsyncIterator[Session]:
        rng = random.Random(self.seed)
        while True:
            inputs = [sample_length(rng, self.input_len, self.range_ratio) for _ in range(BATCH)]
            outputs = [sample_length(rng, self.output_len, self.range_ratio) for _ in range(BATCH)]
            for (text, counted), max_tokens in zip(await self.builder.texts(rng, inputs), outputs, strict=True):
                yield Session([Turn(text, max_tokens, counted)])


class SharedPrefixWorkload:
    """K system prompts of P tokens, each followed by N unique questions, in shuffled order.

    After all K x N requests a fresh round of N new questions per prefix follows, so a run bounded
    by --duration keeps the same prefixes and never repeats a question.
    """

    def __init__(self, builder: PromptBuilder, groups: int, prefix_len: int, questions: int,
                 input_len: int, output_len: int, range_ratio: float, seed: int) -> None:
        self.builder, self.groups, self.prefix_len, self.questions = builder, groups, prefix_len, questions
        self.input_len, self.output_len, self.range_ratio, self.seed = input_len, output_len, range_ratio, seed
        self.default_requests = groups * questions

    async def sessions(self) -> AsyncIterator[Session]:
        rng = random.Random(self.seed)
        prefixes = [text for text, _ in await self.builder.texts(rng, [self.prefix_len] * self.groups)]
        while True:
            order = [g for g in range(self.groups) for _ in range(self.questions)]
            rng.shuffle(order)
            for start in range(0, len(order), BATCH):
                groups = order[start:start + BATCH]
                inputs = [sample_length(rng, self.input_len, self.range_ratio) for _ in groups]
                outputs = [sample_length(rng, self.output_len, self.range_ratio) for _ in groups]
                questions = await self.builder.texts(rng, inputs)
                for group, (text, counted), max_tokens in zip(groups, questions, outputs, strict=True):
                    yield Session([Turn(text, max_tokens, counted)], [{"role": "system", "content": prefixes[group]}])


class MultiTurnWorkload:
    """Conversations of T user turns; each turn resends the whole history with the server's replies."""

    default_requests: int | None = None

    def __init__(self, builder: PromptBuilder, turns: int, input_len: int, output_len: int,
                 range_ratio: float, seed: int) -> None:
        self.builder, self.turns = builder, turns
        self.input_len, self.output_len, self.range_ratio, self.seed = input_len, output_len, range_ratio, seed

    async def sessions(self) -> AsyncIterator[Session]:
        rng = random.Random(self.seed)
        while True:
            inputs = [sample_length(rng, self.input_len, self.range_ratio) for _ in range(self.turns)]
            outputs = [sample_length(rng, self.output_len, self.range_ratio) for _ in range(self.turns)]
            texts = await self.builder.texts(rng, inputs)
            yield Session([Turn(text, max_tokens, counted)
                           for (text, counted), max_tokens in zip(texts, outputs, strict=True)])


class FileWorkload:
    """Sessions read from a JSONL file (or a JSON array, as ShareGPT ships), one record each.

    A record is one of: {"prompt": text}; {"messages": [OpenAI messages, the last from the user]};
    {"conversations": [{"from": "system"|"human"|"gpt", "value": text}, ...]} (ShareGPT). A record's
    "max_tokens" or "output_len" sets its output length; a ShareGPT reply's length, counted with a
    local tokenizer, sets the next turn's; otherwise --output-len does.
    """

    def __init__(self, path: str | Path, output_len: int, tokenizer: LocalTokenizer | None = None) -> None:
        self.path = Path(path)
        self.output_len = output_len
        self.tokenizer = tokenizer
        self.records = [self._session(record, where) for where, record in self._read()]
        if not self.records:
            raise TuiliError(f"--dataset {str(self.path)!r} holds no records: expected JSON lines with "
                             "'prompt', 'messages' or 'conversations'")
        self.default_requests = sum(len(s.turns) for s in self.records)

    async def sessions(self) -> AsyncIterator[Session]:
        for session in self.records:
            yield session

    def _read(self) -> list[tuple[str, object]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TuiliError(f"--dataset {str(self.path)!r} cannot be read: {exc.strerror}") from None
        try:
            if text.lstrip().startswith("["):
                return [(f"{self.path}[{i}]", r) for i, r in enumerate(json.loads(text))]
            return [(f"{self.path}:{n}", json.loads(line))
                    for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        except json.JSONDecodeError as exc:
            raise TuiliError(f"--dataset {str(self.path)!r} is not valid JSON or JSON lines: {exc}") from None

    def _session(self, record: object, where: str) -> Session:
        def bad(expected: str) -> TuiliError:
            return TuiliError(f"{where}: record {str(record)[:120]!r} is invalid: expected {expected}")

        if not isinstance(record, dict):
            raise bad("a JSON object")
        max_tokens = record.get("max_tokens", record.get("output_len", self.output_len))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad("'max_tokens' / 'output_len' to be an integer >= 1")
        if isinstance(record.get("prompt"), str) and record["prompt"]:
            return Session([Turn(record["prompt"], max_tokens)])
        if isinstance(record.get("messages"), list):
            messages = record["messages"]
            if (not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                        for m in messages) or messages[-1].get("role") != "user"):
                raise bad("'messages' as a list of {role, content} ending with a user message")
            return Session([Turn(messages[-1]["content"], max_tokens)], list(messages[:-1]))
        if isinstance(record.get("conversations"), list):
            explicit = "max_tokens" in record or "output_len" in record
            return self._sharegpt(record["conversations"], max_tokens, explicit, bad)
        raise bad("a 'prompt' string, a 'messages' list or a ShareGPT 'conversations' list")

    def _sharegpt(self, conversation: list, max_tokens: int, explicit: bool, bad) -> Session:
        context, turns = [], []
        for message in conversation:
            if not isinstance(message, dict) or not isinstance(message.get("value"), str):
                raise bad("'conversations' entries as {from, value}")
            role = message.get("from")
            if role == "system" and not turns:
                context.append({"role": "system", "content": message["value"]})
            elif role in ("human", "user"):
                turns.append(Turn(message["value"], max_tokens))
            elif role in ("gpt", "assistant", "chatgpt", "bing", "bard") and turns and not explicit:
                if self.tokenizer is not None and message["value"]:
                    turns[-1].max_tokens = max(1, self.tokenizer.count_sync(message["value"]))
        if not turns:
            raise bad("at least one 'human' message in 'conversations'")
        return Session(turns, context)


async def collect(sessions: AsyncIterator[Session], requests: int) -> list[Session]:
    """The first sessions of a workload holding `requests` turns in all (the last one cut short)."""
    taken, total = [], 0
    try:
        async for session in sessions:
            turns = session.turns[:requests - total]
            taken.append(Session(turns, session.context))
            total += len(turns)
            if total >= requests:
                break
    finally:
        await sessions.aclose()
    return taken

