"""tuili vs transformers, offline, in one run on this machine; prints ratios.

(a) decode tokens/s at batch 1 (16-token prompt, greedy) on SmolLM2-135M-Instruct (the
    embedded Q4_1 GGUF dequantized to bf16) and on a random checkpoint with Qwen3-0.6B's shape
    in bf16, plus tuili's MBU: weight bytes read per step / step time / measured bandwidth;
(b) total output tokens/s for 64 requests (random prompts of 128-512 tokens, 128 output
    tokens each, ignore_eos) against transformers' best batched generate (batch 16/32,
    prompts sorted by length to spare it padding).

    python benchmarks/offline.py            # everything (several minutes on 2 cores)
    python benchmarks/offline.py --quick    # fewer tokens, a smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, qwen3_06b_checkpoint, read_bandwidth, smollm2_bf16_checkpoint  # noqa: E402

from tuili import LLM, SamplingParams  # noqa: E402

PROMPT = list(range(1000, 1016))


def tuili_decode_rate(llm: LLM, tokens: int) -> float:
    """Decode tokens/s at batch 1: time(1 + tokens) - time(1 token) isolates the decode steps."""
    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": PROMPT}], params)
        return time.perf_counter() - start

    run(2)  # warm up
    return tokens / (run(tokens + 1) - run(1))


def hf_decode_rate(model, tokens: int) -> float:
    ids = torch.tensor([PROMPT])

    def run(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(2)
    return tokens / (run(tokens + 1) - run(1))


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads: every parameter once (embeddings: one row, negligible,
    unless tied to the lm_head, which reads them all)."""
    model = llm.engine.model
    total = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total += emb.numel() * emb.element_size()
    return total


def part_a(tokens: int, bandwidth: float) -> None:
    print(f"\n(a) batch-1 decode, {tokens} tokens after a {len(PROMPT)}-token prompt")
    print(f"{'model':28} {'transformers bf16':>18} {'tuili fp32':>11} {'tuili bf16':>11} {'best ratio':>10} {'MBU(fp32)':>9}")
    for name, path in (("SmolLM2-135M (bf16 weights)", smollm2_bf16_checkpoint()), ("Qwen3-0.6B shape (bf16)", qwen3_06b_checkpoint())):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        hf_rate = hf_decode_rate(hf, tokens)
        del hf
        rates, mbu = {}, 0.0
        for dtype in ("float32", "bfloat16"):
            llm = LLM(model=str(path), dtype=dtype, device="cpu", max_model_len=1024)
            rates[dtype] = tuili_decode_rate(llm, tokens)
            if dtype == "float32":
                mbu = weight_bytes(llm) * rates[dtype] / bandwidth
            del llm
        best = max(rates.values())
        print(f"{name:28} {hf_rate:15.1f} t/s {rates['float32']:7.1f} t/s {rates['bfloat16']:7.1f} t/s "
              f"{best / hf_rate:9.2f}x {mbu:8.0%}")


def random_requests(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(128, 512))] for _ in range(count)]


def hf_batched_rate(model, prompts: list[list[int]], out_len: int, batch: int) -> float:
    ordered = sorted(prompts, key=len)
    start = time.perf_counter()
    for i in range(0, len(ordered), batch):
        chunk = ordered[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
    return len(prompts) * out_len / (time.perf_counter() - start)


def part_b(num_requests: int, out_len: int) -> None:
    path = qwen3_06b_checkpoint()
    prompts = random_requests(num_requests, 151936)
    print(f"\n(b) {num_requests} requests, prompts 128-512 tokens, {out_len} output tokens each (Qwen3-0.6B shape)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_rates = {b: hf_batched_rate(hf, prompts, out_len, b) for b in (16, 32)}
    del hf
    best_b = max(hf_rates, key=hf_rates.get)
    for b, r in hf_rates.items():
        print(f"  transformers bf16 generate, batch {b:2d}: {r:7.1f} output tok/s")
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for dtype in ("bfloat16", "float32"):
        llm = LLM(model=str(path), dtype=dtype, device="cpu", max_model_len=1024, max_num_seqs=64)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        rate = num_requests * out_len / (time.perf_counter() - start)
        del llm
        print(f"  tuili {dtype:8} LLM.generate (all {num_requests} at once): {rate:7.1f} output tok/s "
              f"= {rate / hf_rates[best_b]:.2f}x transformers' best (batch {best_b})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-batched", action="store_true")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    bandwidth = read_bandwidth()
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    part_a(8 if args.quick else 32, bandwidth)
    if not args.skip_batched:
        part_b(16 if args.quick else 64, 16 if args.quick else 128)


if __name__ == "__main__":
    main()
