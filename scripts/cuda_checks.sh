#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the GPU variants of the hybrid-model tests (the
# Gated DeltaNet mixer on CUDA in torch and through fla-core's kernels; Qwen3.5 greedy decoding and
# hybrid prefix-cache hits on CUDA, all against transformers on the CPU), then
# benchmarks/hybrid_cuda.py with fla and with TUILI_FLA=0. Logs go to $1 (default: a temp dir).
# Install fla-core first (`pip install -e .[cuda]`) for its kernels to be checked.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-$(mktemp -d)}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
# The CPU variants run in the main suite; here only the CUDA ones (no native CPU build needed).
TUILI_NATIVE_KERNELS=0 timeout 270 python3 -m pytest -q -p no:cacheprovider -k cuda -rs \
  tests/layers/test_deltanet.py tests/models/test_qwen35_vs_transformers.py tests/models/test_hybrid_prefix_cache.py \
  2>&1 | tee "$logs/tests.log" | tail -40
timeout 200 python3 benchmarks/hybrid_cuda.py 2>&1 | tee "$logs/bench.log"
TUILI_FLA=0 timeout 110 python3 benchmarks/hybrid_cuda.py --only tuili 2>&1 | tee "$logs/bench_torch.log"
