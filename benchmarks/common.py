"""Shared pieces of the benchmarks: model checkpoints made here, timing, bandwidth."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


# A Qwen3.5 hybrid of ~0.8B parameters (issue 19's benchmark shape: hidden 1024, 24 layers, three
# Gated DeltaNet layers per full-attention layer), as Qwen3.5-0.8B's published config lays it out.
QWEN35_08B = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def qwen35_08b_checkpoint() -> Path:
    """A random bf16 Qwen3.5 checkpoint of QWEN35_08B's shape, written once by transformers
    (`Qwen3_5ForCausalLM`, the text model)."""
    import transformers

    path = CACHE / "qwen3.5-0.8b-shape-bf16"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.Qwen3_5TextConfig(**QWEN35_08B)
        config.architectures = ["Qwen3_5ForCausalLM"]
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


LLAMA_CPP = CACHE / "llama.cpp"  # built by benchmarks/build_peers.sh llama
# The llama.cpp binaries a run uses: the native build, or `llama-avx2`'s (AVX2 only, to compare
# with tuili's kernels built with TUILI_KERNEL_CFLAGS=-march=x86-64-v3) when TUILI_LLAMA_BUILD=build-avx2.
LLAMA_BIN = LLAMA_CPP / os.environ.get("TUILI_LLAMA_BUILD", "build") / "bin"


def qwen3_06b_gguf(ftype: str) -> Path:
    """The Qwen3-0.6B-shape checkpoint as GGUF (see converted_gguf)."""
    return converted_gguf("qwen3-0.6b-shape", qwen3_06b_checkpoint, ftype)


def qwen35_08b_gguf(ftype: str) -> Path:
    """The Qwen3.5-0.8B-shape checkpoint as GGUF (see converted_gguf)."""
    # --no-mtp: the random checkpoint has no MTP block, which the converter otherwise insists on
    return converted_gguf("qwen3.5-0.8b-shape", qwen35_08b_checkpoint, ftype, ("--no-mtp",))


def converted_gguf(name: str, checkpoint: Callable[[], Path], ftype: str, convert_options: tuple[str, ...] = ()) -> Path:
    """`checkpoint()` as GGUF, written once: "bf16" and "f16" by llama.cpp's convert_hf_to_gguf.py,
    "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M" by its llama-quantize from the bf16 file (with llama-quantize's usual choice
    for the tied embedding / output matrix).

    The converter wants a tokenizer and the random checkpoints have none: it is given SmolLM2's
    (from the embedded GGUF), which it pads to the checkpoint's vocabulary with unused tokens.
    The benchmarks feed token ids, so the tokenizer only has to exist."""
    out = CACHE / "gguf" / f"{name}-{ftype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    if ftype in ("bf16", "f16"):
        from tuili.models.default_model import default_model_path
        from tuili.models.gguf import open_gguf

        source = checkpoint()
        stage = CACHE / f"{name}-convert"
        stage.mkdir(exist_ok=True)
        for file in ("config.json", "model.safetensors"):
            if not (stage / file).exists():
                (stage / file).symlink_to(source / file)
        if not (stage / "tokenizer.json").exists():
            open_gguf(default_model_path()).load_tokenizer().save_pretrained(stage)
        command = [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(stage),
                   "--outtype", ftype, "--outfile", str(partial), *convert_options]
    else:
        command = [str(LLAMA_BIN / "llama-quantize"), str(converted_gguf(name, checkpoint, "bf16", convert_options)),
                   str(partial), ftype, str(os.cpu_count() or 1)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"making {out.name} failed ({' '.join(command)}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    partial.replace(out)
    return out


def busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next `seconds` (call it while this process
    is idle), from /proc/stat; 0.0 where that file is missing. On these 2-core machines a
    benchmark sharing its cores with anything is not comparable (llama.cpp's 2-thread decode
    slows down several-fold when one other process runs)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except OSError:
        return 0.0
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def best_time(fn: Callable[[], object], budget_s: float) -> float:
    """Microseconds of the fastest of repeated calls within the budget (least disturbed by
    other processes on a shared machine)."""
    fn()
    best = float("inf")
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6
