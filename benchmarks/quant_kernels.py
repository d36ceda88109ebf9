"""Microbenchmark of the quantized-linear kernels (tuili/layers/quant.py) against float linears.

For each weight shape and row count it times fp32 and bf16 F.linear, and each quantized module
forced onto each of its kernels ("op": PyTorch's CPU weight-only op; "tiled": dequantize a tile,
then matmul). The crossover rows recorded in docs/quantization.md come from this table.

    python benchmarks/quant_kernels.py --threads 2 --rows 1 2 4 8 16 32 64 256
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tuili.layers.quant import (
    Int8GroupWeight,
    QuantizedLinear,
    make_linear,
    quantize_int4,
    quantize_int8,
)

sys.path.insert(0, str(Path(__file__).parent))
from common import best_time  # noqa: E402

from tuili.platform import Platform  # noqa: E402

HERE = Platform.detect()
# PyTorch's ops run only where tuili's kernels do not (tuili's kernels take those rows); modules
# built for such a platform keep the op's operands (Int8GroupLinear's (scale, zero) pairs).
WITHOUT_NATIVE = dataclasses.replace(HERE, native_kernels=False)


def forced(module: QuantizedLinear, kernel: str, x: torch.Tensor) -> Callable[[], object]:
    """A call of one kernel, whatever `kernel_for` would choose for these rows."""
    return partial(module._op if kernel == "op" else module._tiled, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=["1024x3072", "3072x1024"], help="out x in")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    print("microseconds per call (best of repeats); tiled paths and ops in bf16")
    columns = ["fp32", "bf16", "int8 op", "int8 tiled", "int4 op", "int4 tiled", "q8_0 op", "q8_0 tiled"]
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k) * 0.02
        w_bf16 = w.bfloat16()
        q8_0 = Int8GroupWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 1e-3, 32)
        weights = {"int8": quantize_int8(w), "int4": quantize_int4(w, 32), "q8_0": q8_0}
        modules = {
            name: {kernel: make_linear(weight, platform=WITHOUT_NATIVE if kernel == "op" else HERE)
                   for kernel in ("op", "tiled")}
            for name, weight in weights.items()
        }
        print(f"\nweight {n}x{k} (out x in)")
        print(f"{'rows':>5} " + " ".join(f"{c:>11}" for c in columns))
        for m in args.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            times = [
                best_time(partial(F.linear, x, w), args.budget),
                best_time(partial(F.linear, xb, w_bf16), args.budget),
            ]
            for by_kernel in modules.values():
                for kernel, module in by_kernel.items():
                    times.append(best_time(forced(module, kernel, xb), args.budget))
            print(f"{m:>5} " + " ".join(f"{t:>11.0f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
