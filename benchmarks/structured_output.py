"""Masked (structured-output) decode vs plain decode, side by side, on the same engine.

Both runs decode the same number of tokens (ignore_eos, max_tokens) from the same prompts at
batch 1 and 16, greedy; the masked run constrains every sequence with a grammar of letters, spaces and punctuation
that greedy decoding never completes (it ends in a marker the model does not write), so the
mask is real (some thousands of the vocabulary's tokens allowed each step) and each step fills
and applies one per row. Runs alternate and the best of `--repeats` counts (the machine may be shared).

    python benchmarks/structured_output.py [--model PATH] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import time

from tuili import LLM, SamplingParams, StructuredOutputsParams

GRAMMAR = 'root ::= [A-Za-z ,.]+ "§§END§§"'



def tokens_per_second(llm: LLM, batch: int, params: SamplingParams) -> float:
    prompts = [f"Write a story about the number {i}." for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == batch * params.max_tokens
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=512)
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    masked = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(grammar=GRAMMAR))
    tokens_per_second(llm, 2, masked)  # warm up: compile the grammar, read the vocabulary
    print(f"machine: {platform.processor() or platform.machine()}; model {args.model or 'SmolLM2-135M (default)'}; "
          f"{args.tokens} tokens per sequence; masked = {GRAMMAR!r}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'masked tok/s':>13} {'ratio':>6}")
    for batch in (1, 16):
        best_plain = best_masked = 0.0
        for _ in range(args.repeats):
            best_plain = max(best_plain, tokens_per_second(llm, batch, plain))
            best_masked = max(best_masked, tokens_per_second(llm, batch, masked))
        print(f"{batch:>5} {best_plain:>12.1f} {best_masked:>13.1f} {best_masked / best_plain:>6.2f}")


if __name__ == "__main__":
    main()
