"""Batch-invariant mode on and off, side by side, on the embedded SmolLM2 (GGUF Q4_1/Q8_0 run
packed) and on its bf16 dequantization (the packed bf16 linears); prints times and ratios.

For each model and mode (EngineConfig.batch_invariant, the default, vs --no-batch-invariant):

1. prefill: 8 prompts of 512 tokens (`--prompt-len`), one output token each (prompt tokens/s);
2. decode at batch 1: a 32-token prompt, 64 tokens (`--tokens`; output tokens/s);
3. decode at batch 8: eight such prompts at once;
4. answers that differ: 8 chat prompts answered alone and then together (greedy, 32 tokens),
   how many answers differ (0 is the point of the mode).

Each timing is the best of `--repeat` runs, the modes interleaved (the machine's other load
moves both alike).

    python benchmarks/batch_invariance.py [--repeat 3] [--model gguf|bf16|both] [--prompt-len 512] [--tokens 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import busy_cores, machine, smollm2_bf16_checkpoint  # noqa: E402

from tuili import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about rain.", "What is 17 times 3?", "Who wrote Hamlet?",
    "Give me a synonym for happy.", "How many legs does a spider have?",
]


def random_prompts(count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(count)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def differing_answers(llm: LLM) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    alone = [llm.chat([c], params)[0].outputs[0].token_ids for c in conversations]
    together = [o.outputs[0].token_ids for o in llm.chat(conversations, params)]
    return sum(a != b for a, b in zip(alone, together, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", choices=["gguf", "bf16", "both"], default="both")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {machine()}; other processes keep {busy_cores():.1f} cores busy")
    models = {"gguf": None, "bf16": str(smollm2_bf16_checkpoint())}
    chosen = list(models) if args.model == "both" else [args.model]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    decode = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prefill_prompts, short = random_prompts(8, args.prompt_len, 0), random_prompts(8, 32, 1)
    workloads = {
        f"prefill 8 x {args.prompt_len} (prompt tok/s)": (
            lambda llm: llm.generate(prefill_prompts, one), 8 * args.prompt_len),
        "decode batch 1 (tok/s)": (lambda llm: llm.generate(short[:1], decode), args.tokens),
        "decode batch 8 (tok/s)": (lambda llm: llm.generate(short, decode), 8 * args.tokens),
    }
    for name in chosen:
        llms = {mode: LLM(model=models[name], device="cpu", max_model_len=1024, batch_invariant=mode,
                          enable_prefix_caching=False) for mode in (True, False)}
        print(f"\n{name} ({'embedded GGUF, packed' if models[name] is None else 'bf16 safetensors'})")
        print(f"{'workload':34} {'invariant':>10} {'fastest':>10} {'ratio':>7}")
        for label, (run, tokens) in workloads.items():
            for llm in llms.values():
                run(llm)  # warm-up: decode graphs, first-touch allocations
            times = {mode: float("inf") for mode in llms}
            for _ in range(args.repeat):
                for mode, llm in llms.items():
                    times[mode] = min(times[mode], best(lambda llm=llm, run=run: run(llm), 1))
            rate = {mode: tokens / t for mode, t in times.items()}
            print(f"{label:34} {rate[True]:10.1f} {rate[False]:10.1f} {rate[True] / rate[False]:7.2f}")
        for mode, llm in llms.items():
            print(f"answers differing alone vs batched, {'invariant' if mode else 'fastest'}: "
                  f"{differing_answers(llm)} of {len(QUESTIONS)}")


if __name__ == "__main__":
    main()
