#!/usr/bin/env bash
# Download llama.cpp's checkpoint converter (convert_hf_to_gguf.py), which the GGUF tests run on
# random checkpoints so that tuili is checked against the files llama.cpp itself writes, once.
#
# It comes from PyPI: the llama-cpp-python sdist vendors llama.cpp whole (MIT). Only the converter
# (convert_hf_to_gguf.py, its conversion/ package, gguf-py/ and the licence) is kept, in
#   ${TUILI_TEST_ASSETS:-$HOME/.cache/tuili-test}/llama.cpp-converter/
# next to a SOURCE file naming the sdist; a directory whose SOURCE matches is left alone, so
# running this again costs nothing. The converter needs torch, numpy, transformers and gguf's own
# dependencies (numpy, pyyaml, tqdm, requests), all of which tuili already installs.
set -euo pipefail

SPEC="llama-cpp-python==0.3.36"  # pinned, so every machine tests the same converter

dest="${TUILI_TEST_ASSETS:-$HOME/.cache/tuili-test}/llama.cpp-converter"
if [[ -f "$dest/SOURCE" && "$(cat "$dest/SOURCE")" == "$SPEC" ]]; then
  echo "llama.cpp converter: present ($SPEC)"
  exit 0
fi
echo "llama.cpp converter: fetching $SPEC (sdist, ~75 MB)"
mkdir -p "$(dirname "$dest")"
work="$(mktemp -d "$(dirname "$dest")/.fetch-converter.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --no-binary :all: "$SPEC" -d "$work"
sdist=("$work"/llama_cpp_python-*.tar.gz)
top="$(basename "${sdist[0]}" .tar.gz)/vendor/llama.cpp"
tar -xzf "${sdist[0]}" -C "$work" \
  "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/LICENSE"
mv "$work/$top" "$work/out"
echo "$SPEC" >"$work/out/SOURCE"
# Replace the directory in one rename so an interrupted run never leaves a half-written one.
rm -rf "$dest"
mv "$work/out" "$dest"
echo "llama.cpp converter is in $dest"
