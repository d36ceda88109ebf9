"""tuili against transformers on a CUDA GPU, on the Qwen3.5 hybrid of ~0.8B parameters (random
bf16 weights, benchmarks/common.py's QWEN35_08B: 24 layers, three Gated DeltaNet layers to each
full-attention one), both engines on the same checkpoint in one run.

Rows: prefill of one 512-token prompt (tokens/s of prompt), and greedy decode at batch 1 and 16
(generated tokens/s, the prefill's time taken off: a run of 1 + N tokens less a run of 1).
tuili's Gated DeltaNet runs flash-linear-attention's Triton kernels when fla-core is installed
(`pip install tuili[cuda]`); `TUILI_FLA=0` runs its torch forms instead. transformers picks
fla's kernels by itself when the package is there.

    python benchmarks/hybrid_cuda.py                 # both engines
    TUILI_FLA=0 python benchmarks/hybrid_cuda.py --only tuili
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import QWEN35_08B, qwen35_08b_checkpoint  # noqa: E402

PROMPT, DECODE, REPEATS = 512, 128, 3


def best_of(run: Callable[[], None]) -> float:
    """The median wall time of REPEATS runs after one warm-up, the GPU drained around each."""
    run()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts(batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(100, QWEN35_08B["vocab_size"] - 100, (batch, length), generator=gen).tolist()


def tuili_rates(path: Path) -> dict[str, float]:
    from tuili import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", enable_prefix_caching=False, max_num_seqs=16,
              kv_cache_memory=8 << 30)
    print(f"tuili: fla kernels {llm.engine.platform.fla}", flush=True)

    def generate(batch: int, length: int, tokens: int) -> Callable[[], None]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts(batch, length)]
        return lambda: llm.generate(inputs, params, use_tqdm=False)

    rates = {"prefill 512": PROMPT / best_of(generate(1, PROMPT, 1))}
    for batch in (1, 16):
        decode = best_of(generate(batch, 32, 1 + DECODE)) - best_of(generate(batch, 32, 1))
        rates[f"decode b{batch}"] = batch * DECODE / decode
    return rates


def transformers_rates(path: Path) -> dict[str, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    def generate(batch: int, length: int, tokens: int) -> Callable[[], None]:
        ids = torch.tensor(prompts(batch, length), device="cuda")

        def run() -> None:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

        return run

    rates = {"prefill 512": PROMPT / best_of(generate(1, PROMPT, 1))}
    for batch in (1, 16):
        decode = best_of(generate(batch, 32, 1 + DECODE)) - best_of(generate(batch, 32, 1))
        rates[f"decode b{batch}"] = batch * DECODE / decode
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("tuili", "transformers"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("hybrid_cuda.py needs a CUDA GPU")
    path = qwen35_08b_checkpoint()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, checkpoint {path}", flush=True)
    results = {}
    for name, rates in (("tuili", tuili_rates), ("transformers", transformers_rates)):
        if args.only in (None, name):
            results[name] = rates(path)
            print(name, {row: round(rate, 1) for row, rate in results[name].items()}, flush=True)
    print(f"{'row':<14}" + "".join(f"{name:>16}" for name in results) + ("     tuili/transformers" if len(results) == 2 else ""))
    for row in next(iter(results.values())):
        line = f"{row:<14}" + "".join(f"{r[row]:>12.1f} t/s" for r in results.values())
        if len(results) == 2:
            line += f"{results['tuili'][row] / results['transformers'][row]:>22.2f}x"
        print(line)


if __name__ == "__main__":
    main()
