"""xgrammar vs llguidance on CPU: what one structured-output decode step costs each of them.

For a real tokenizer (Qwen3's, 151k tokens, fetched by scripts/fetch_test_tokenizers.sh) and a
JSON schema, it measures per engine: compiling the grammar (cold, then from the engine's cache),
and per decode step the time to fill the token bitmask for a batch of 1 and of 16 sequences,
to apply it to float32 logits, and to advance each matcher by the chosen token. The tokens fed
are those of a valid JSON document, so every step lies on a real path through the grammar.

    python benchmarks/grammar_engines.py [--tokenizer qwen3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "admin"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace wrote the first program", "age": 36, "email": "ada@math.com",
                       "tags": ["admin", "a", "b", "a"], "address": {"city": "London, England", "zip": "W1"}})


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    root = Path(os.environ.get("TUILI_TEST_ASSETS", Path.home() / ".cache" / "tuili-test")) / "tokenizers" / name
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def timed(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.vocab = vocab
        self.threads = threads

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, strict_mode=True)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch = getattr(self, "batch", None) or self.xgr.BatchGrammarMatcher(self.threads)
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = vocab
        self.cache: dict[str, str] = {}

    def compile(self, schema: str):
        # llguidance compiles when a matcher is made (lexer and parser tables, lazily); the
        # token trie is shared through the tokenizer. A first matcher shows the cost.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.llg.torch.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.llg.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask) -> None:
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def measure(engine, tokens: list[int], batch: int, steps: int) -> dict[str, float]:
    compiled = engine.compile(json.dumps(SCHEMA))
    matchers = engine.matchers(compiled, batch)
    bitmask = engine.bitmask(batch)
    logits = torch.randn(batch, engine.vocab)
    fills, applies, accepts = [], [], []
    for token in tokens[:steps]:
        fills.append(timed(lambda: engine.fill(matchers, bitmask)))
        applies.append(timed(lambda: engine.apply(logits, bitmask)))
        start = time.perf_counter()
        for matcher in matchers:
            assert engine.accept(matcher, token), f"{engine.name} refused token {token}"
        accepts.append(time.perf_counter() - start)
    ms = 1e3
    return {"fill_ms_median": statistics.median(fills) * ms, "fill_ms_p90": sorted(fills)[int(0.9 * len(fills))] * ms,
            "apply_ms": statistics.median(applies) * ms, "accept_ms": statistics.median(accepts) * ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default="qwen3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    hf = load_tokenizer(args.tokenizer)
    vocab = len(hf)
    tokens = hf.encode(DOCUMENT, add_special_tokens=False)
    print(f"tokenizer {args.tokenizer}: {vocab} tokens; document {len(tokens)} tokens; {args.threads} threads")
    for cls in (XGrammar, LLGuidance):
        setup = time.perf_counter()
        engine = cls(hf, vocab, args.threads)
        setup = time.perf_counter() - setup
        cold = timed(lambda engine=engine: engine.compile(json.dumps(SCHEMA)))
        warm = timed(lambda engine=engine: engine.compile(json.dumps(SCHEMA)), repeat=5)
        print(f"{engine.name}: tokenizer setup {setup * 1e3:.0f} ms, compile cold {cold * 1e3:.1f} ms, "
              f"again {warm * 1e3:.2f} ms")
        for batch in (1, 16):
            result = measure(engine, tokens, batch, args.steps)
            print(f"  batch {batch:2d}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
