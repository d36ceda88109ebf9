"""Prefix caching on and off, in one run, on the embedded SmolLM2 model; prints ratios.

1. A shared system prompt of ~2,000 tokens followed by 64 short questions, sent one after
   another: median TTFT with caching vs without (goal: <= 1/5).
2. A 10-turn conversation, each turn resending the whole history: prompt tokens computed
   vs new tokens (goal: <= 1.2x).
3. A workload with 0% hits (distinct random prompts, all at once): throughput with caching
   on vs off (goal: within 3%).
4. A hybrid model (a small random Qwen3-Next checkpoint: Gated DeltaNet + attention, whose
   linear-attention state is restored from checkpoints at block boundaries): the shared
   2,000-token system prompt's median TTFT with caching vs without (goal: <= 1/5; also the
   process CPU seconds of each request, a steadier figure on a shared machine), cold requests'
   TTFT with caching (the cost of saving state checkpoints) vs without, and that a 200-token
   shared prompt hits at all. The two engines stay loaded and take turns, request by request.

    python benchmarks/prefix_cache.py [--questions 64] [--only-hybrid]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from tuili import LLM, SamplingParams  # noqa: E402

WORDS = ("system policy careful answer user model cache token memory block request server latency "
         "throughput batch prefill decode kernel tensor layer attention rotary norm sample").split()


def system_prompt(tokenizer, target_tokens: int) -> str:
    rng = random.Random(0)
    text = "You are a helpful assistant. Follow these rules.\n"
    while len(tokenizer.encode(text)) < target_tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(40)) + ".\n"
    return text


def ttft_of_questions(llm: LLM, system: str, questions: list[str]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ttfts = []
    for q in questions:
        out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": q}], params)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return ttfts


def shared_prefix(questions: int) -> None:
    results = {}
    for caching in (True, False):
        llm = LLM(enable_prefix_caching=caching, max_model_len=4096)
        system = system_prompt(llm.get_tokenizer(), 2000)
        qs = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(questions)]
        results[caching] = statistics.median(ttft_of_questions(llm, system, qs))
        del llm
    ratio = results[True] / results[False]
    print(f"1. shared 2,000-token system prompt, {questions} questions: median TTFT {results[True] * 1e3:.0f} ms "
          f"with caching, {results[False] * 1e3:.0f} ms without: ratio {ratio:.3f} (goal <= 0.2) "
          f"{'PASS' if ratio <= 0.2 else 'MISS'}")


def multi_turn(turns: int = 10) -> None:
    llm = LLM(max_model_len=4096)
    tokenizer = llm.get_tokenizer()
    history: list[dict] = []
    new_tokens = 0
    before = llm.engine.stats().prompt_tokens_computed
    previous_len = 0
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}: tell me one short fact about the number {turn}."})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
        new_tokens += len(ids) - previous_len
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=48))[0]
        history.append({"role": "assistant", "content": out.outputs[0].text})
        previous_len = len(ids)
    computed = llm.engine.stats().prompt_tokens_computed - before
    ratio = computed / new_tokens
    print(f"2. {turns}-turn conversation: {computed} prompt tokens computed for {new_tokens} new ones: "
          f"{ratio:.2f}x (goal <= 1.2) {'PASS' if ratio <= 1.2 else 'MISS'}")


def zero_hit_overhead(requests: int = 32, repeats: int = 5) -> None:
    rng = random.Random(1)
    best = {True: 0.0, False: 0.0}
    llms = {c: LLM(enable_prefix_caching=c, max_model_len=1024) for c in (True, False)}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for _ in range(repeats):
        for caching, llm in llms.items():  # interleaved, best of `repeats`: less noise
            prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(256)]} for _ in range(requests)]
            start = time.perf_counter()
            llm.generate(prompts, params)
            best[caching] = max(best[caching], requests * 32 / (time.perf_counter() - start))
    assert llms[True].engine.stats().prefix_cache.hit_tokens == 0
    ratio = best[True] / best[False]
    print(f"3. 0% hits, {requests} x 256-token prompts: {best[True]:.1f} vs {best[False]:.1f} output tok/s "
          f"with / without caching: {ratio:.3f} (goal >= 0.97) {'PASS' if ratio >= 0.97 else 'MISS'}")


HYBRID = dict(  # Qwen3-Next's proportions, small: 8 layers in the 3:1 pattern, MoE with a shared expert
    vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
)  # fmt: skip


def write_hybrid_checkpoint(path: str) -> int:
    """A random Qwen3-Next checkpoint written by transformers; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**HYBRID))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _first_token(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, float, int]:
    """TTFT (s), the process's CPU seconds and the cached tokens of one request."""
    started = time.process_time()
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    return (out.metrics.first_token_time - out.metrics.arrival_time, time.process_time() - started,
            out.metrics.num_cached_tokens)


def hybrid_shared_prefix(questions: int, cold_rounds: int = 6) -> None:
    """Both engines (caching on and off) stay loaded and take turns, request by request, so that
    each pair of samples sees the same phase of a host whose speed drifts. Cold requests are
    fresh 2,024-token prompts (caching on pays for saving its checkpoints); the shared prompt's
    questions follow a first use that fills the cache."""
    rng = random.Random(2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(HYBRID["vocab_size"]) for _ in range(n)]

    system, qs = tokens(2000), [tokens(24) for _ in range(questions)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with tempfile.TemporaryDirectory() as path:
        params_count = write_hybrid_checkpoint(path)
        print(f"4. hybrid: random Qwen3-Next, {params_count / 1e6:.0f}M parameters (hidden 256, 8 layers 3:1, "
              f"8 experts top-2), default block size 16, a state checkpoint every 4 blocks")
        llms = {caching: LLM(model=path, enable_prefix_caching=caching, max_model_len=4096) for caching in (True, False)}
        for llm in llms.values():  # one-time costs (kernels' first calls at these shapes) out of the samples
            llm.generate([{"prompt_token_ids": tokens(2024)}], params)
        cold: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
        for _ in range(cold_rounds):
            prompt = tokens(2024)
            for caching, llm in llms.items():
                cold[caching].append(_first_token(llm, prompt, params))
        warm: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
        for llm in llms.values():
            _first_token(llm, system + qs[0], params)  # the system prompt's first use
        for q in qs[1:]:
            for caching, llm in llms.items():
                warm[caching].append(_first_token(llm, system + q, params))
        short = tokens(200)
        hits = [_first_token(llms[True], short + q, params)[2] for q in qs[:2]]
        del llms

    def median_ratio(samples: dict[bool, list], index: int) -> float:
        return statistics.median(a[index] / b[index] for a, b in zip(samples[True], samples[False], strict=True))

    def median(samples: list, index: int) -> float:
        return statistics.median(s[index] for s in samples)

    ratio = median_ratio(warm, 0)
    print(f"   shared 2,000-token system prompt, {len(qs) - 1} questions after its first use, the engines taking "
          f"turns: median TTFT {median(warm[True], 0) * 1e3:.0f} ms with caching ({median(warm[True], 2):.0f} tokens "
          f"cached), {median(warm[False], 0) * 1e3:.0f} ms without: ratio {ratio:.3f} (median of the pairs' ratios; "
          f"goal <= 0.2) {'PASS' if ratio <= 0.2 else 'MISS'}")
    print(f"   process CPU seconds per request (median): {median(warm[True], 1):.2f} with caching, "
          f"{median(warm[False], 1):.2f} without: ratio {median_ratio(warm, 1):.3f}")
    print(f"   cold requests (fresh 2,024-token prompts, {cold_rounds} pairs): {median(cold[True], 0) * 1e3:.0f} ms with "
          f"checkpoints saved, {median(cold[False], 0) * 1e3:.0f} ms without caching: {median_ratio(cold, 0):.3f}x "
          f"(pairs: {', '.join(f'{a[0] / b[0]:.2f}' for a, b in zip(cold[True], cold[False], strict=True))}); "
          f"CPU {median_ratio(cold, 1):.3f}x")
    print(f"   a 200-token shared prompt: {hits[1]} tokens cached on its second use "
          f"{'PASS' if hits[1] > 0 else 'MISS'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--only-hybrid", action="store_true", help="run case 4 only")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if not args.only_hybrid:
        print("1-3: embedded SmolLM2-135M-Instruct (Q4_1 GGUF, float32)")
        shared_prefix(args.questions)
        multi_turn()
        zero_hit_overhead()
    hybrid_shared_prefix(min(args.questions, 16))


if __name__ == "__main__":
    main()
