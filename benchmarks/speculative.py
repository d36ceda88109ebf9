"""Speculative decoding on vs off, side by side in one run, on the embedded SmolLM2 (dequantized
to bf16, benchmarks/common.py); prints decode tokens/s and the ratios.

(a) batch 1, prompt lookup ("ngram", k=4 adaptive, and k=3 fixed) on a copy-heavy request: the
    model is asked to repeat a paragraph of tests/data/english_eval.txt (chat template, greedy);
(b) batch 1, the target quantized to int4 as its own draft ({"model": "self", "quantization":
    "int4"}, k=3), on the same request and on a chat question;
(c) batch 32 chat questions (tests/data/chat_prompts.json, cycled), greedy, ngram with adaptive k
    and the int4 self-draft against no speculation: total output tokens/s, the ratio of the best
    rounds and the median of the ratios within each round.

Decode tokens/s at batch 1 is (N - 1) / (time(N tokens) - time(1 token)), so the prefill is not
counted; each configuration runs `--repeat` times interleaved with the others and keeps its best.
Whether the greedy texts are identical with and without speculation is printed too (in bf16 they
may differ where the kernels are not row-count invariant: docs/engine.md).

    python benchmarks/speculative.py            # ~10 minutes on 2 cores
    python benchmarks/speculative.py --quick    # fewer tokens, a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, smollm2_bf16_checkpoint  # noqa: E402

from tuili import LLM, SamplingParams  # noqa: E402

DATA = Path(__file__).parent.parent / "tests" / "data"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
NGRAM_K3_FIXED = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
INT4_SELF = {"model": "self", "quantization": "int4", "num_speculative_tokens": 3}


def chat_prompt(llm: LLM, text: str) -> dict:
    messages = [{"role": "user", "content": text}]
    ids = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return {"prompt_token_ids": ids}


def copy_request(llm: LLM) -> dict:
    paragraph = (DATA / "english_eval.txt").read_text().split("\n\n")[0].strip()
    return chat_prompt(llm, f"Repeat the following text exactly, word for word:\n\n{paragraph}")


def decode_rate(llm: LLM, prompt: dict, tokens: int) -> tuple[float, list[int]]:
    def run(n: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([prompt], params)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    t_full, ids = run(tokens)
    t_one, _ = run(1)
    return (tokens - 1) / (t_full - t_one), ids


def batch_rate(llm: LLM, prompts: list[dict], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, [o.outputs[0].token_ids for o in outs]


def spec_line(llm: LLM) -> str:
    spec = llm.engine.stats().spec
    if spec is None:
        return ""
    return (f"  acceptance {spec.acceptance_rate:.0%}, {spec.tokens_per_verification:.2f} tokens/verifying step, "
            f"{spec.num_verifications} verifications")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--parts", default="abc", help="which of (a) (b) (c) to run")
    args = parser.parse_args()
    tokens = 48 if args.quick else 128
    model = str(smollm2_bf16_checkpoint())
    print(f"machine: {machine()}")
    print(f"model: SmolLM2-135M-Instruct bf16 ({model})")

    def engine(spec: dict | None, **options) -> LLM:
        return LLM(model, dtype="bfloat16", speculative_config=spec, **options)

    results: dict[str, dict] = {}
    if "a" in args.parts or "b" in args.parts:
        configs = {"off": engine(None)}
        if "a" in args.parts:
            configs["ngram"] = engine(NGRAM)
            configs["ngram-k3-fixed"] = engine(NGRAM_K3_FIXED)
        if "b" in args.parts:
            configs["int4-self"] = engine(INT4_SELF)
        requests = {"copy": copy_request(configs["off"])}
        if "b" in args.parts:
            requests["chat"] = chat_prompt(configs["off"], json.loads((DATA / "chat_prompts.json").read_text())[2])
        for request_name, prompt in requests.items():
            best: dict[str, float] = {}
            texts: dict[str, list[int]] = {}
            for _ in range(args.repeat):
                for name, llm in configs.items():
                    if request_name == "chat" and name.startswith("ngram"):
                        continue
                    rate, ids = decode_rate(llm, prompt, tokens)
                    best[name] = max(best.get(name, 0.0), rate)
                    texts[name] = ids
            for name, rate in best.items():
                same = "" if name == "off" else f", greedy text {'identical' if texts[name] == texts['off'] else 'differs'}"
                ratio = "" if name == "off" else f", {rate / best['off']:.2f}x off"
                print(f"(batch 1, {request_name}) {name}: {rate:.1f} decode tok/s{ratio}{same}")
            results[request_name] = best
        for name, llm in configs.items():
            if name != "off":
                print(f"  {name}:{spec_line(llm)}")
    if "c" in args.parts:
        questions = json.loads((DATA / "chat_prompts.json").read_text())
        configs = {"off": engine(None), "ngram": engine(NGRAM), "int4-self": engine(INT4_SELF)}
        prompts = [chat_prompt(configs["off"], questions[i % len(questions)]) for i in range(32)]
        rounds: list[dict[str, float]] = []
        texts = {}
        names = list(configs)
        for round_index in range(args.repeat):
            rates = {}
            for name in names[round_index % len(names):] + names[:round_index % len(names)]:  # each first in turn
                rates[name], texts[name] = batch_rate(configs[name], prompts, tokens)
            rounds.append(rates)
        best = {name: max(r[name] for r in rounds) for name in configs}
        for name, rate in best.items():
            extra = ""
            if name != "off":
                # The host's speed drifts between rounds more than these configurations differ:
                # the ratio within each round (the three run back to back, each first in turn) is
                # steadier than the ratio of the best rounds; both are printed.
                within = sorted(r[name] / r["off"] for r in rounds)
                extra = (f", {rate / best['off']:.2f}x off (best rounds); within a round median "
                         f"{float(np.median(within)):.2f}x, {within[0]:.2f}-{within[-1]:.2f}x; greedy texts "
                         f"{'identical' if texts[name] == texts['off'] else 'differ'}")
            print(f"(batch 32) {name}: {rate:.1f} output tok/s{extra}")
        for name, llm in configs.items():
            if name != "off":
                print(f"  {name}:{spec_line(llm)}")


if __name__ == "__main__":
    main()
