"""Shared pieces of the benchmarks: model checkpoints made here, timing, bandwidth."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("TUILI_BENCH_CACHE", Path.home() / ".cache" / "tuili-bench"))

# Qwen3-0.6B's published config.json (shape only; the weights here are random).
QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645,
)


def qwen3_06b_checkpoint() -> Path:
    """A random bf16 checkpoint with Qwen3-0.6B's shape, written once by transformers."""
    import transformers

    path = CACHE / "qwen3-0.6b-shape-bf16"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.Qwen3Config(**QWEN3_06B)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path)
    return path


def smollm2_bf16_checkpoint() -> Path:
    """The embedded SmolLM2 GGUF dequantized to a bf16 safetensors directory (config.json from
    the GGUF header, the tokenizer saved beside it), so transformers and tuili run the very same
    weights. (transformers refuses to save a model it loaded from GGUF.)"""
    import json

    from safetensors.torch import save_file

    from tuili.models.default_model import default_model_path
    from tuili.models.gguf import open_gguf

    path = CACHE / "smollm2-135m-instruct-bf16"
    if not (path / "config.json").exists():
        ckpt = open_gguf(default_model_path())
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: ckpt.load_tensor(name, torch.bfloat16).contiguous() for name in ckpt.tensor_names()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        ckpt.load_tokenizer().save_pretrained(path)
        (path / "config.json").write_text(json.dumps({**ckpt.config, "torch_dtype": "bfloat16"}, indent=1))
    return path


def timed(fn, repeat: int = 1) -> float:
    """Best wall time of `repeat` calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    """Bytes/s this machine's memory delivers to a reader, as `tuili probe` measures it."""
    from tuili.perf.probe import probe

    spec, _ = probe("cpu", quick=True)
    return spec.memory_bandwidth


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


_READY = re.compile(r"at (http://\S+)/v1")


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str, Path]:
    """Start `tuili serve --port 0 FLAGS`; wait for its URL in the log (model loading takes
    seconds to minutes). Returns the process, the base URL and the log file."""
    log = Path(tempfile.mkstemp(prefix="tuili-bench-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "tuili.cli", "serve", "--port", "0", *flags]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while (match := _READY.search(log.read_text())) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"tuili serve did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return process, match.group(1), log
