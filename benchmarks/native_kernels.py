"""Microbenchmark of the native CPU kernels (tuili/kernels) against the torch code they replace.

* Decode attention over the paged cache, one layer: tuili.layers.attention.paged_attention
  (gathers each sequence's context through its block table, then one masked SDPA) against
  tuili.kernels.paged_attention (reads the cache in place), for batches of decodes on
  SmolLM2-135M's shape (Hq 9, Hkv 3, D 64) and Qwen3-0.6B's (Hq 16, Hkv 8, D 128), block size 16,
  blocks scattered at random; bf16, fp32 and fp8 caches.
* Prompt chunks, one sequence: a fresh 512-token prompt (torch: the causal SDPA on the new keys
  and values) and chunks of 256 and 32 tokens continuing at positions 768 and 992 (torch:
  gather + masked SDPA).
* Dequantizing int4 tiles (the inner step of Int4Linear._tiled / Int8GroupLinear._tiled, about
  1 MiB of bf16 weights) against the same torch ops: ns per weight per core.
* Whether the kernels' OpenMP threads slow the torch matmul that follows them: the matmul is
  timed right after the kernel and right after a torch op reading the same bytes (the control:
  same cache state, torch's own threads).
* The small-row linear (decode's projections at batch 1..8): tuili.kernels.linear_small against
  F.linear, bf16 and fp32, at 1 and 2 threads, on Qwen3-0.6B's and SmolLM2-135M's projections and
  lm_heads; µs per call and GB/s of weight bytes. Each call reads the next of several copies of
  the weight, together larger than the last-level cache, so the weight comes from memory as in
  a decode step.

Times are the best of repeated calls (the least disturbed by other processes).

    python benchmarks/native_kernels.py --threads 2
    python benchmarks/native_kernels.py --only gemv --gemv-threads 1 2
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from tuili import kernels
from tuili.layers.attention import AttentionGroup, AttentionMetadata, CausalSpan, KVCache, TorchAttention
from tuili.layers.quant import Int8GroupWeight, make_linear, quantize_int4
from tuili.platform import Platform

sys.path.insert(0, str(Path(__file__).parent))
from common import best_time  # noqa: E402

MODELS = {"SmolLM2-135M": (9, 3, 64), "Qwen3-0.6B": (16, 8, 128)}  # Hq, Hkv, D
BLOCK_SIZE = 16
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}




class Case:
    """One attention call for both paths: sequences given as (new tokens n, first position p0),
    contexts p0 + n in blocks scattered at random through the pool; q in the working dtype
    (fp32 for an fp8 cache, as tuili runs on CPUs)."""

    def __init__(self, seqs: list[tuple[int, int]], heads: tuple[int, int, int], cache: str) -> None:
        num_heads, kv_heads, head_dim = heads
        dtype = CACHE_DTYPES[cache]
        work_dtype = torch.float32 if cache == "fp8" else dtype
        counts = [math.ceil((n + p0) / BLOCK_SIZE) for n, p0 in seqs]
        num_blocks = sum(counts) + 1
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.cache = KVCache.allocate(shape, dtype, torch.device("cpu"))
        slots = torch.arange(num_blocks * BLOCK_SIZE)  # fp8: the scales are calibrated on these values
        self.cache.store(torch.randn(len(slots), *shape[2:]), torch.randn(len(slots), *shape[2:]), slots)
        order = torch.randperm(num_blocks)
        tables, used = [], 0
        for count in counts:
            tables.append(order[used : used + count].tolist())
            used += count
        width = max(counts)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        tokens = sum(n for n, _ in seqs)
        self.q = torch.randn(tokens, num_heads, head_dim).to(work_dtype)
        self.k = torch.randn(tokens, kv_heads, head_dim).to(work_dtype)
        self.v = torch.randn(tokens, kv_heads, head_dim).to(work_dtype)
        firsts = [sum(n for n, _ in seqs[:b]) for b in range(len(seqs))]
        self.seq_info = torch.tensor(
            [[f, n, p0] for f, (n, p0) in zip(firsts, seqs, strict=True)], dtype=torch.int32
        )
        self.meta = self._torch_metadata(seqs, firsts)
        self.scale = head_dim**-0.5
        self.out = torch.empty_like(self.q)

    def _torch_metadata(self, seqs: list[tuple[int, int]], firsts: list[int]) -> AttentionMetadata:
        """As tuili/engine/runner.py builds it: decodes in one group, a fresh prompt as a span,
        a continuing chunk in a group of its own."""
        slots = torch.zeros(self.q.shape[0], dtype=torch.long)
        if len(seqs) == 1 and seqs[0][1] == 0:
            return AttentionMetadata(slots, [], [CausalSpan(0, seqs[0][0])])
        max_q = max(n for n, _ in seqs)
        max_ctx = max(n + p0 for n, p0 in seqs)
        offsets = torch.arange(max_q)
        qlen = torch.tensor([n for n, _ in seqs])
        start = torch.tensor([p0 for _, p0 in seqs])
        valid = offsets[None, :] < qlen[:, None]
        index = torch.where(valid, torch.tensor(firsts)[:, None] + offsets[None, :], 0)
        keys = torch.arange(max_ctx)
        mask = keys[None, None, :] <= (start[:, None] + offsets[None, :])[:, :, None]
        mask = torch.where(valid[:, :, None], mask, keys[None, None, :] == 0)
        group = AttentionGroup(self.tables.long(), index, valid, mask.unsqueeze(1))
        return AttentionMetadata(slots, [group], [])

    def torch_path(self) -> torch.Tensor:
        return TorchAttention().forward(self.q, self.k, self.v, self.cache, self.meta, self.scale)

    def kernel(self) -> torch.Tensor:
        c = self.cache
        return kernels.paged_attention(
            self.q,
            c.key,
            c.value,
            self.tables,
            self.seq_info,
            self.scale,
            self.out,
            c.key_scale,
            c.value_scale,
        )


def compare(label: str, case: Case, budget: float) -> None:
    t_torch, t_kernel = best_time(case.torch_path, budget), best_time(case.kernel, budget)
    print(f"{label} {t_torch:>9.0f} {t_kernel:>9.0f} {t_torch / t_kernel:>7.1f}x", flush=True)


def bench_decode(args: argparse.Namespace) -> None:
    print("\ndecode attention, one layer (µs)")
    print(f"{'model':>13} {'cache':>5} {'batch':>5} {'ctx':>5} {'torch':>9} {'kernel':>9} {'speedup':>8}")
    for model, heads in MODELS.items():
        for cache in args.caches:
            for batch in args.batches:
                for context in args.contexts:
                    case = Case([(1, context - 1)] * batch, heads, cache)
                    compare(f"{model:>13} {cache:>5} {batch:>5} {context:>5}", case, args.budget)


def bench_prefill(args: argparse.Namespace) -> None:
    print("\nprompt chunks, one sequence, one layer (µs)")
    print(f"{'model':>13} {'cache':>5} {'chunk':>16} {'torch':>9} {'kernel':>9} {'speedup':>8}")
    for model, heads in MODELS.items():
        for cache in ("bf16", "fp32"):
            for n, p0 in ((512, 0), (256, 768), (32, 992)):
                compare(
                    f"{model:>13} {cache:>5} {f'{n} at {p0}':>16}", Case([(n, p0)], heads, cache), args.budget
                )


def bench_dequant(args: argparse.Namespace) -> None:
    print("\ndequantizing one tile of W^T (the _tiled kernels' inner step), bf16 out")
    print(
        f"{'format':>6} {'K':>5} {'columns':>7} {'torch µs':>9} {'kernel µs':>9} {'ns/weight/core':>15} {'speedup':>8}"
    )
    threads = torch.get_num_threads()
    for k in (1024, 3072):
        w = torch.randn(3072, k) * 0.02
        q8_0 = Int8GroupWeight(
            torch.randint(-128, 128, (3072, k), dtype=torch.int8), torch.rand(3072, k // 32) / 1e3, 32
        )
        for name, module, function in (
            ("int4", make_linear(quantize_int4(w, 32), platform=Platform.detect()), kernels.dequantize_int4_tiles),
            ("q8_0", make_linear(q8_0, platform=Platform.detect()), kernels.dequantize_int8_group_tiles),
        ):
            tiles = max(1, (1 << 19) // k // 64)  # as Int4Linear._tiled: ~1 MiB of bf16
            out = torch.empty(k, tiles * 64, dtype=torch.bfloat16)
            t_kernel = best_time(partial(function, module.packed, module.kernel_scales, 0, out), args.budget)
            t_torch = best_time(partial(torch_tile, module, tiles, name == "q8_0"), args.budget)
            per_weight = t_kernel * 1e3 * threads / out.numel()
            print(
                f"{name:>6} {k:>5} {tiles * 64:>7} {t_torch:>9.0f} {t_kernel:>9.0f} {per_weight:>15.3f} "
                f"{t_torch / t_kernel:>7.1f}x",
                flush=True,
            )


def torch_tile(module: torch.nn.Module, tiles: int, q8_0: bool) -> torch.Tensor:
    """The torch ops of Int4Linear._tiled / Int8GroupLinear._tiled for their first tiles, without
    the matmul (copied from tuili/layers/quant.py so that both sides do the same work)."""
    group_size, cols = module.group_size, slice(0, tiles * 64)
    packed = module.packed[:tiles].transpose(0, 1)
    if q8_0:
        k = module.in_features
        groups = k // group_size
        high, low = packed[:k], packed[k:]
        u = torch.stack([((high & 0x0F) << 4) | (low & 0x0F), (high & 0xF0) | (low >> 4)], dim=2)
        q = (u ^ 0x80).view(torch.int8)
        scale = module.scale[:, cols].contiguous()[:, None]
        return (q.view(groups, group_size, -1).to(torch.bfloat16) * scale).view(k, -1)
    k = module.packed.shape[1]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(torch.int8).sub_(8)
    codes = codes.view(k // group_size, group_size, -1).to(torch.bfloat16)
    scale, zero = (t.contiguous()[:, None] for t in module.scale_zero[:, cols].unbind(-1))
    return torch.addcmul(zero, codes, scale).view(k, -1)


def bench_interference(args: argparse.Namespace) -> None:
    print("\nthe torch op right after the attention kernel vs right after torch read the same cache (µs)")
    case = Case([(1, 511)] * 16, MODELS["Qwen3-0.6B"], "bf16")
    touch = partial(torch.sum, torch.cat([case.cache.key.flatten(), case.cache.value.flatten()]))
    x, w = torch.randn(64, 1024).bfloat16(), torch.randn(1024, 3072).bfloat16()
    x1, w1 = torch.randn(1, 1024), torch.randn(3072, 1024)
    for name, op in (
        ("bf16 matmul [64x1024]@[1024x3072]", partial(torch.matmul, x, w)),
        ("fp32 linear [1x1024]->3072", partial(torch.nn.functional.linear, x1, w1)),
    ):
        times: dict[str, list[float]] = {"after torch": [], "after kernel": []}
        end = time.perf_counter() + 4 * args.budget
        while time.perf_counter() < end:
            for label, before in (("after torch", touch), ("after kernel", case.kernel)):
                before()
                start = time.perf_counter()
                op()
                times[label].append(time.perf_counter() - start)
        summary = ", ".join(f"{label} {min(t) * 1e6:.0f}" for label, t in times.items())
        print(f"{name}: {summary} (best of {len(times['after torch'])})", flush=True)


# N x K of the projections decode multiplies by (nn.Linear's weight layout).
GEMV_SHAPES = {
    "Qwen3-0.6B": {
        "qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
        "lm_head": (151936, 1024),
    },
    "SmolLM2-135M": {
        "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576),
    },
}  # fmt: skip
GEMV_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def weight_pool(n: int, k: int, dtype: torch.dtype, pool_bytes: int) -> list[torch.Tensor]:
    """Copies of one random weight, together at least pool_bytes."""
    weight = (torch.randn(n, k) * k**-0.5).to(dtype)
    copies = max(1, math.ceil(pool_bytes / (weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def per_call_time(fn: Callable[[torch.Tensor], object], pool: list[torch.Tensor], budget_s: float) -> float:
    """Microseconds per call of the best round of calls over the whole pool (one warm-up round)."""
    best = float("inf")
    end = time.perf_counter() + budget_s
    for round_number in range(1000):
        start = time.perf_counter()
        for weight in pool:
            fn(weight)
        if round_number > 0:
            best = min(best, (time.perf_counter() - start) / len(pool))
        if round_number > 2 and time.perf_counter() > end:
            break
    return best * 1e6


def read_bandwidth(pool_bytes: int, budget_s: float) -> float:
    """GB/s of the faster of torch.sum and an fp32 matrix-vector product over pool_bytes (as
    tuili.perf.probe measures the memory): the rate the memory demonstrably delivers."""
    data = torch.ones(pool_bytes // 4 // 1024, 1024)
    vector = torch.ones(1024)
    best = min(best_time(data.sum, budget_s), best_time(partial(torch.mv, data, vector), budget_s))
    return data.numel() * 4 / best / 1e3


def bench_gemv(args: argparse.Namespace) -> None:
    pool_bytes = args.pool_mib << 20
    print(
        f"\nsmall-row linear: F.linear vs kernels.linear_small, weights cycled through {args.pool_mib} MiB of copies"
    )
    for threads in args.gemv_threads:
        torch.set_num_threads(threads)
        print(
            f"memory read, {threads} thread(s): {read_bandwidth(pool_bytes, args.budget):.1f} GB/s",
            flush=True,
        )
    print(
        f"{'model':>13} {'layer':>8} {'N x K':>12} {'dtype':>5} {'thr':>3} {'M':>2} {'torch µs':>9} "
        f"{'GB/s':>5} {'kernel µs':>9} {'GB/s':>5} {'speedup':>7}"
    )
    for model, layers in GEMV_SHAPES.items():
        for layer, (n, k) in layers.items():
            for name, dtype in GEMV_DTYPES.items():
                pool = weight_pool(n, k, dtype, pool_bytes)
                weight_bytes = n * k * pool[0].element_size()
                for threads in args.gemv_threads:
                    torch.set_num_threads(threads)
                    for m in args.rows:
                        x = torch.randn(m, k).to(dtype)
                        out = torch.empty(m, n, dtype=dtype)
                        t_torch = per_call_time(partial(torch.nn.functional.linear, x), pool, args.budget)
                        t_kernel = per_call_time(
                            lambda w, x=x, out=out: kernels.linear_small(x, w, None, out), pool, args.budget
                        )
                        print(
                            f"{model:>13} {layer:>8} {f'{n}x{k}':>12} {name:>5} {threads:>3} {m:>2} "
                            f"{t_torch:>9.1f} {weight_bytes / t_torch / 1e3:>5.1f} {t_kernel:>9.1f} "
                            f"{weight_bytes / t_kernel / 1e3:>5.1f} {t_torch / t_kernel:>6.2f}x",
                            flush=True,
                        )
                del pool
    torch.set_num_threads(args.threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--caches", nargs="+", default=["bf16", "fp32"], choices=list(CACHE_DTYPES))
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--only", choices=["decode", "prefill", "dequant", "interference", "gemv"])
    parser.add_argument("--gemv-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="M of the small-row linear")
    parser.add_argument(
        "--pool-mib", type=int, default=640, help="weight copies cycled through (>= 2x the last-level cache)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not kernels.available():
        raise SystemExit(f"the native kernels are unavailable: {kernels.unavailable_reason()}")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), load average {load} (on {os.cpu_count()} CPUs)"
    )
    for name, bench in (
        ("decode", bench_decode),
        ("prefill", bench_prefill),
        ("dequant", bench_dequant),
        ("interference", bench_interference),
        ("gemv", bench_gemv),
    ):
        if args.only in (None, name):
            bench(args)


if __name__ == "__main__":
    main()
