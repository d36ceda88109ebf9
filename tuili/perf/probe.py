"""Measure this machine: memory bandwidth (read and copy) and matmul throughput per dtype, at large
shapes (what prefill runs) and at skinny decode-like shapes (a few rows times a weight matrix);
tuili's engine's fixed host cost per step and per decoder layer, and on a CPU its packed
linears' time per weight value, per format (tuili/perf/overhead.py).

The spec a probe returns takes the best large-matmul rate per dtype as that dtype's peak and the
read bandwidth as the memory bandwidth: what this machine demonstrably reaches, through the same
torch kernels the engine calls. MFU/MBU against a probed spec therefore read as "share of what
this machine can do", which is the only meaningful ceiling for a CPU (no datasheet states one).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from tuili.config import resolve_device
from tuili.errors import TuiliError
from tuili.perf.hardware import (
    CURVES,
    ENGINE_ATTENTION_TOKENS,
    ENGINE_LINEAR_ROWS,
    ENGINE_PREFILL_ROWS,
    PACKED_CALL_ROWS,
    PACKED_FIELDS,
    PER_DTYPE,
    SECONDS_TABLES,
    HardwareSpec,
)
from tuili.perf.harness import build_engine
from tuili.perf.overhead import PACKED_OP_MAX_ROWS
from tuili.platform import Platform
from tuili.sampling import SamplingParams

CPU_LINK = "cpu-shm"  # how tensor-parallel ranks on one CPU machine all-reduce (tuili/parallel/shm.py)

_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_GEMV_K = 512  # a small model's projection: its time is mostly the per-matmul overhead


@dataclass(frozen=True)
class Measurement:
    """One figure a probe measured: ``value`` in ``unit`` (bytes/s or FLOP/s), best of its runs."""

    name: str
    value: float
    unit: str
    seconds: float  # time of the best single run


@dataclass(frozen=True)
class _Sizes:
    buffer_bytes: int  # streamed memory: at least twice the last-level cache, so DRAM is what is timed
    matmul_n: int  # large square matmuls
    skinny_k: int  # decode-like matmuls: a few rows times k x k weight matrices, cycled through
    skinny_rows: tuple[int, ...]
    skinny_dtypes: tuple[str, ...]
    seconds_per_item: float


def _sizes(dev: torch.device, quick: bool) -> _Sizes:
    # --quick: one decode shape in the dtype the engine runs there (fp32 on a CPU, bf16 on a GPU)
    if dev.type == "cuda":
        return _Sizes(256 << 20 if quick else 1 << 30, 4096 if quick else 8192, 8192, (1,) if quick else (1, 16),
                      ("bf16",) if quick else ("fp32", "bf16", "fp16"), 0.05 if quick else 0.3)
    # --quick streams 128 MiB, which a large last-level cache may partly hold; a full probe
    # streams at least twice that cache
    buffer = 128 << 20 if quick else min(max(256 << 20, 2 * _last_level_cache_bytes()), _memory_bytes(dev) // 16)
    return _Sizes(buffer, 512 if quick else 1536, 2048 if quick else 4096, (1,) if quick else (1, 16),
                  ("fp32",) if quick else ("fp32", "bf16"), 0.05 if quick else 0.3)


def probe(device: str = "cpu", quick: bool = False) -> tuple[HardwareSpec, list[Measurement]]:
    """Measure ``device`` ("cpu", "cuda", "cuda:N"); ``quick`` takes a few seconds."""
    dev = resolve_device(device)
    sizes = _sizes(dev, quick)
    results = [*_bandwidth(dev, sizes), *_matmuls(dev, sizes)]
    peaks = {}
    for m in results:
        if m.name.startswith("matmul ") and " large" in m.name:
            dtype = m.name.split()[1]
            peaks[dtype] = max(peaks.get(dtype, 0.0), m.value)
    results += _packed_kernels(dev, peaks, sizes)
    linears = _engine_linears(dev, sizes)
    attention = _engine_attention(dev, sizes)
    decodes = _engine_decode_attention(dev, sizes)
    deltanet = _engine_deltanet(dev, sizes)
    elementwise = _engine_elementwise(dev, sizes)
    results += linears + attention + decodes + deltanet + elementwise
    read = next(m.value for m in results if m.name == "memory read")
    spec = HardwareSpec(
        name=f"{_device_name(dev)} (probed)",
        peak_flops=peaks,
        memory_bandwidth=read,
        memory_bytes=_memory_bytes(dev),
        source=f"tuili probe{' --quick' if quick else ''} on {platform.node()}, torch {torch.__version__}",
        origin="probe",
        interconnect=CPU_LINK if dev.type == "cpu" else None,
        **_packed_fields(results),
        **_linear_fields(linears),
        **_attention_fields(attention),
        **_decode_attention_fields(decodes),
        **_deltanet_fields(deltanet),
        **_elementwise_fields(elementwise),
    )
    host = _host_overheads(dev, quick)
    results += host
    spec = replace(spec, measurements={m.name: m.value for m in results},
                   host_overhead_seconds={m.name.removeprefix(HOST_PREFIX): m.value for m in host})
    return spec, results


def refresh_rates(spec: HardwareSpec, device: str = "cpu", packed_formats: Collection[str] | None = None) -> HardwareSpec:
    """``spec`` (this machine's probe) with the rates that move with the host's load measured
    again now, as a full probe measures them: memory read bandwidth, large matmuls per dtype,
    tuili's own linears, attention and packed kernels. Host overheads and memory size stay. A shared
    or throttled machine's rates drift by up to 2x within an hour (docs/ruler.md), so `plan
    --measure` takes them in the same minutes as the engine runs it compares with; ~10 s.
    ``packed_formats``: the packed formats to time again (a model's), the others' figures kept;
    None for all of them (each takes a few seconds for its call curve)."""
    dev = resolve_device(device)
    sizes = _sizes(dev, quick=False)
    read = _bandwidth(dev, sizes)[0].value
    # Only the peaks a prediction can use: a dtype whose saved peak is below fp32's is never one
    # (HardwareSpec.dtype_used: tuili computes it in fp32 there), and it is the slow one to time:
    # PyTorch's bf16 matmul on a CPU without bf16 arithmetic took ~10 s a call at this size, 39 of
    # a `plan --measure`'s 41 s of refreshing on an AVX2 Zen 3. Its saved peak stays.
    fp32 = spec.peak_flops.get("fp32", 0.0)
    used = tuple(d for d in _matmul_dtypes(dev) if d in spec.peak_flops and (d == "fp32" or spec.peak_flops[d] >= fp32))
    peaks = {**spec.peak_flops, **{m.name.split()[1]: m.value for m in _matmuls(dev, sizes, used, skinny=False)}}
    # (the saved peaks with those measured over them: `used` holds only dtypes the spec has)
    fresh = _packed_kernels(dev, peaks, sizes, packed_formats) if spec.packed_kernel_seconds_per_value else []
    linears = _engine_linears(dev, sizes) if spec.linear_stream_bandwidth else []
    attention = _engine_attention(dev, sizes) if spec.attention_flops_by_tokens else []
    decodes = _engine_decode_attention(dev, sizes) if spec.decode_attention_bandwidth else []
    deltanet = _engine_deltanet(dev, sizes) if spec.deltanet_prefill_flops else []
    elementwise = _engine_elementwise(dev, sizes) if spec.elementwise_seconds_per_value else []
    return replace(
        spec,
        memory_bandwidth=read,
        peak_flops=peaks,
        **{name: {**getattr(spec, name), **timed} for name, timed in _packed_fields(fresh).items()},
        **(_linear_fields(linears) if linears else {}),
        **(_attention_fields(attention) if attention else {}),
        **(_decode_attention_fields(decodes) if decodes else {}),
        **(_deltanet_fields(deltanet) if deltanet else {}),
        **(_elementwise_fields(elementwise) if elementwise else {}),
    )


@dataclass(frozen=True)
class Reading:
    """What a Gauge read at one moment."""

    read_bandwidth: float  # B/s
    matmul_flops: float  # FLOP/s of the Gauge's matmul (Gauge.dtype)


class Gauge:
    """The two rates a roofline is drawn against, memory read bandwidth and the peak of a bf16
    model's matmuls, measured as `probe` measures them (the same buffer and matmul sizes) but in
    about 3 x ``budget_s`` with the buffers allocated once, so that a benchmark can read the
    machine right before and after each sample. On a host whose speed switches between states
    within seconds (docs/benchmarks.md), a sample is compared with the rates of its own moment.

    The matmul is bf16, or fp32 where fp32 is the faster here (``dtype``; HardwareSpec.dtype_used:
    CPUs without bf16 arithmetic, whose bf16 matmul takes ~10 s at this size)."""

    def __init__(self, device: str = "cpu", budget_s: float = 0.1) -> None:
        self.dev = resolve_device(device)
        sizes = _sizes(self.dev, quick=False)
        self.buffer = _read_buffer(self.dev, sizes)
        self.dtype = _faster_matmul_dtype(self.dev)
        n, dtype = sizes.matmul_n, _TORCH_DTYPES[self.dtype]
        self.a = torch.randn(n, n, device=self.dev).to(dtype)
        self.b = torch.randn(n, n, device=self.dev).to(dtype)
        self.budget_s = budget_s

    def __call__(self) -> Reading:
        t_read = _read_seconds(self.buffer, self.dev, self.budget_s)
        t_mm = _time(lambda: self.a @ self.b, self.dev, self.budget_s)
        return Reading(self.buffer.numel() * 4 / t_read, 2 * self.a.shape[0] ** 3 / t_mm)


def _faster_matmul_dtype(dev: torch.device, n: int = 256) -> str:
    """"bf16", or on a CPU "fp32" where an n x n x n matmul runs faster in fp32 than in bf16 (GPUs
    have bf16 tensor cores; at this size their timings would be launch latency). A CPU with bf16
    arithmetic takes bf16 untimed: one timing of each, on a host that changes speed within
    seconds, picked fp32 there now and then."""
    if dev.type != "cpu" or Platform.detect(dev).bf16_arithmetic:
        return "bf16"
    seconds = {dtype: _matmul_runner(dtype, dev)(n, n, n, 0.0) for dtype in ("bf16", "fp32")}
    return "fp32" if seconds["fp32"] < seconds["bf16"] else "bf16"


def mean_rates(a: HardwareSpec, b: HardwareSpec) -> HardwareSpec:
    """``a`` with each rate that refresh_rates measures replaced by the mean of ``a``'s and ``b``'s."""

    def mean(x: dict, y: dict) -> dict:
        return {k: (v + y[k]) / 2 if k in y else v for k, v in x.items()}

    return replace(
        a,
        memory_bandwidth=(a.memory_bandwidth + b.memory_bandwidth) / 2,
        peak_flops=mean(a.peak_flops, b.peak_flops),
        **{name: mean(getattr(a, name), getattr(b, name)) for name in PER_DTYPE},
        **{name: {dtype: mean(curve, getattr(b, name).get(dtype, {})) for dtype, curve in getattr(a, name).items()}
           for name in CURVES},
        **{name: mean(getattr(a, name), getattr(b, name)) for name in PACKED_FIELDS},
        **{name: {key: mean(inner, getattr(b, name).get(key, {})) for key, inner in getattr(a, name).items()}
           for name in SECONDS_TABLES},
    )


def estimate(device: str = "cpu") -> HardwareSpec:
    """A quick built-in estimate for a machine never probed: a fraction of a second of measuring
    (small buffers, one matmul size), marked origin="estimate" so every report can say so. It
    measures no host overhead (that runs the engine: `tuili probe` does)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        sizes = _Sizes(32 << 20, 384, 1024, (1,), (), 0.02)
    else:
        sizes = _Sizes(128 << 20, 2048, 4096, (1,), (), 0.02)
    read = _bandwidth(dev, sizes)[0]
    peaks = {m.name.split()[1]: m.value for m in _matmuls(dev, sizes, dtypes=("fp32", "bf16"), skinny=False)}
    return HardwareSpec(
        name=_device_name(dev),
        peak_flops=peaks,
        memory_bandwidth=read.value,
        memory_bytes=_memory_bytes(dev),
        source="quick built-in estimate (tiny buffers; `tuili probe` measures properly)",
        origin="estimate",
        interconnect=CPU_LINK if dev.type == "cpu" else None,
    )


def _time(fn: Callable[[], object], dev: torch.device, budget: float) -> float:
    """Best wall time of ``fn`` over repeated runs within about ``budget`` seconds (one warm-up)."""
    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    start = time.perf_counter()
    fn()
    sync()
    # A call slower than the whole budget is timed once more, not three times: PyTorch's bf16
    # matmul on an AVX2 CPU takes ~10 s at the probe's size, where the spread of one run is small.
    least = 1 if time.perf_counter() - start > budget else 3
    best = float("inf")
    deadline = time.perf_counter() + budget
    runs = 0
    while runs < least or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
        runs += 1
        if runs >= 200:
            break
    return best


def _read_buffer(dev: torch.device, sizes: _Sizes) -> torch.Tensor:
    """The float32 buffer the read bandwidth is measured over: whole rows of _read_seconds's view."""
    return torch.ones(sizes.buffer_bytes // 4 // 1024 * 1024, dtype=torch.float32, device=dev)


def _read_seconds(src: torch.Tensor, dev: torch.device, budget: float) -> float:
    """Best time to read every byte of ``src`` once. A sum reads every byte once and does almost
    no arithmetic: the read rate decode depends on. A matrix-vector product reads the same bytes
    the way a decode step does and is faster on some CPUs than the reduction; the better of the
    two is what the memory can deliver."""
    matrix, vector = src.view(-1, 1024), torch.ones(1024, dtype=torch.float32, device=dev)
    return min(_time(lambda: src.sum(), dev, budget), _time(lambda: torch.mv(matrix, vector), dev, budget))


def _bandwidth(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    src = _read_buffer(dev, sizes)
    dst = torch.empty_like(src)
    t_read = _read_seconds(src, dev, sizes.seconds_per_item)
    t_copy = _time(lambda: dst.copy_(src), dev, sizes.seconds_per_item)
    nbytes = src.numel() * 4
    return [
        Measurement("memory read", nbytes / t_read, "B/s", t_read),
        Measurement("memory copy", 2 * nbytes / t_copy, "B/s", t_copy),  # read + write
    ]


def _matmul_dtypes(dev: torch.device) -> tuple[str, ...]:
    """The dtypes whose matmul peaks a probe measures on ``dev``."""
    return ("fp32", "bf16") if dev.type == "cpu" else ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")


def _matmuls(
    dev: torch.device, sizes: _Sizes, dtypes: tuple[str, ...] | None = None, skinny: bool = True,
) -> list[Measurement]:
    if dtypes is None:
        dtypes = _matmul_dtypes(dev)
    out = []
    n = sizes.matmul_n
    for dtype in dtypes:
        run = _matmul_runner(dtype, dev)
        if run is None:
            continue
        t = run(n, n, n, sizes.seconds_per_item)
        out.append(Measurement(f"matmul {dtype} large {n}x{n}x{n}", 2 * n**3 / t, "FLOP/s", t))
        if skinny and dtype in sizes.skinny_dtypes:
            out += _skinny(dtype, dev, sizes)
    return out


def _cycled_matmuls(
    dtype: str, dev: torch.device, sizes: _Sizes, k: int, rows: tuple[int, ...],
    matmul: Callable[[torch.Tensor, Any], object], prepare: Callable[[torch.Tensor], Any] | None = None,
) -> list[tuple[int, float, int]]:
    """(rows, best seconds, matrices) of `matmul(x, w)` over one k x k weight matrix after another,
    as a model's layers follow each other, the matrices together larger than the caches; each w
    the matrix as `prepare` turns it into (a module holding it in a kernel's layout), if given."""
    elem = torch.finfo(_TORCH_DTYPES[dtype]).bits // 8
    count = max(1, -(-sizes.buffer_bytes // (k * k * elem)))
    # Random values, as a model's: AMX tiles multiply a constant or zero matrix faster than random
    # bf16 (docs/kernels.md, Measured crossovers). Copies of one matrix fill fast.
    base = torch.randn(k, k, device=dev).to(_TORCH_DTYPES[dtype])
    weights = [base.clone() if prepare is None else prepare(base) for _ in range(count)]
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev).to(_TORCH_DTYPES[dtype])

        def layers(x: torch.Tensor = x) -> None:
            for w in weights:
                matmul(x, w)

        out.append((m, _time(layers, dev, sizes.seconds_per_item), count))
    return out


def _skinny(dtype: str, dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """Decode's matmuls through torch (F.linear): a few rows of activations times weight matrices
    cycled through. One row at a small and at a large matrix size give the two terms of a decode
    matmul's time (see fit_gemv)."""
    out = []
    elem = torch.finfo(_TORCH_DTYPES[dtype]).bits // 8
    for k, rows in ((SMALL_GEMV_K, (1,)), (sizes.skinny_k, sizes.skinny_rows)):
        for m, t, count in _cycled_matmuls(dtype, dev, sizes, k, rows, torch.nn.functional.linear):
            name = f"matmul {dtype} skinny {m}x{k}x{k}"
            out.append(Measurement(name, 2 * m * k * k * count / t, "FLOP/s", t))
            # the weight bytes such matmuls stream per second: the bandwidth decode can reach
            out.append(Measurement(f"{name} weight read", k * k * elem * count / t, "B/s", t))
            if m == 1:
                out.append(Measurement(f"matmul {dtype} skinny 1x{k}x{k} seconds per matmul", t / count, "s", t))
    return out


def fit_gemv(measurements: dict[str, float], dtype: str) -> tuple[float, float] | None:
    """(overhead seconds per matmul, streaming bytes/s) of one-row matmuls in ``dtype``, from a
    probe's small and large ones: time = overhead + weight bytes / bandwidth. None if the probe
    did not time both or they do not fit the line (noise)."""
    prefix = f"matmul {dtype} skinny 1x"
    times = {}
    for name, value in measurements.items():
        if name.startswith(prefix) and name.endswith("seconds per matmul"):
            k = int(name.removeprefix(prefix).split("x")[0])
            times[k * k * (torch.finfo(_TORCH_DTYPES[dtype]).bits // 8)] = value
    if len(times) < 2:
        return None
    (b_small, t_small), (b_large, t_large) = min(times.items()), max(times.items())
    if t_large <= t_small:
        return None
    bandwidth = (b_large - b_small) / (t_large - t_small)
    overhead = max(0.0, t_small - b_small / bandwidth)
    return overhead, bandwidth


PACKED_PREFIX = "packed "
# What the probe records per format: "packed int8 kernel seconds per value", ...
PACKED_MEASURES = {"kernel": "packed_kernel_seconds_per_value", "dequantization": "packed_dequant_seconds_per_value",
                   "rows": "packed_rows_seconds_per_value"}


def _packed_weights(n: int, k: int) -> list:
    """A random weight [n, k] in each form the loaders give packed linears: int4 codes with (scale,
    zero) pairs (`--quantization int4`, GGUF Q4_1/Q4_K), with scales alone (Q4_0), int8 codes
    (Q8_0), 6-bit ones with scales alone (Q6_K: groups of 16) and with zeros (Q5_K)."""
    from tuili.layers.quant import Int4Weight, Int8GroupWeight, quantize_int4

    def scales(group: int) -> torch.Tensor:
        return (torch.rand(n, k // group) / 64).to(torch.bfloat16)

    def codes(low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, (n, k), dtype=torch.int16).to(torch.int8)

    return [
        quantize_int4(torch.randn(n, k), 32, torch.bfloat16),
        Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8), scales(32), torch.zeros(n, k // 32), 32),
        Int8GroupWeight(codes(-128, 128), scales(32), 32),
        Int8GroupWeight(codes(-32, 32), scales(16), 16),
        Int8GroupWeight(codes(-32, 32), scales(32), 32, scales(32)),
    ]


_NOISE_TRIES = 3
_T = TypeVar("_T")


def _retimed(measure: Callable[[], _T], positive: Callable[[_T], float]) -> _T:
    """``measure()`` again, up to _NOISE_TRIES times, while ``positive`` of its result is at or below
    zero; the last result otherwise. For the measurements that are differences (a kernel's time
    less a small call's, a slope over layers): on a loaded host one can come out at or below zero,
    and a rate left out is one the plan cannot charge (the quick probe beside another busy test
    process lost the int6 and the decode attention rates so, in CI runs on machine A)."""
    for _ in range(_NOISE_TRIES):
        result = measure()
        if positive(result) > 0:
            break
    return result


def _packed_kernels(dev: torch.device, peaks: dict[str, float], sizes: _Sizes,
                    formats: Collection[str] | None = None) -> list[Measurement]:
    """Where tuili packs linears (a CPU), for each packed format its modules hold here
    (PACKED_FORMATS; 6-bit codes only where the kernels read them): the time per weight value of
    one call of their weight-only kernel at each number of rows of PACKED_CALL_ROWS it takes (its
    call curve: up to PACKED_OP_MAX_ROWS, and up to its 256-row blocks where the module runs many
    rows through it, the batch-invariant mode with native kernels), and else the time of
    dequantizing a weight when a matmul has more rows than that kernel takes.

    Timed through the engine's module (tuili/layers/quant/) on 4096 x 1024 weights, less the
    time of the same call on a 64 x 64 weight: what a call costs whatever its size (the Python
    around it, starting the threads) is the host overhead's, which the probe measures on toy
    layers of that width (a decode step replays its kernel calls without the Python); counted
    twice, it charged the packed kernel ~20% more per value than it takes, on an AVX2 Zen 3 whose
    module call costs ~50 us. Copies of the module are cycled through, together larger than the
    caches, as a model's layers follow each other: one weight alone stays in cache, and ran twice
    as fast as a model's decode step reads its packed weights at one row, and ~30% faster than a
    model's packed linears at 33 and 256 rows (the Q4_0 model on an AVX2 Zen 3, 2026-12-07). The
    many-row product's time at the measured peak is taken off the dequantization's (a few
    percent): the better of the bf16 and float32 peaks, as without bf16 arithmetic the engine's
    kernels widen bf16 to float32 (torch's own bf16 matmul ran at 1.2 GFLOP/s on an AVX2-only Zen
    3, float32 at 67)."""
    if dev.type != "cpu" or "bf16" not in peaks:
        return []
    from tuili.layers.quant import make_linear

    k, n, small = 1024, 4096, 64
    platform = Platform.detect(dev)

    def module(weight: object) -> torch.nn.Module | None:
        try:
            return make_linear(weight, None, torch.bfloat16, platform=platform)
        except ValueError:  # codes with zeros where no kernel reads 6-bit codes
            return None

    out: list[Measurement] = []
    timed: set[str] = set()  # kernel formats already timed (several weights may share one)
    for weight, tiny_weight in zip(_packed_weights(n, k), _packed_weights(small, small), strict=True):
        big, tiny = module(weight), module(tiny_weight)
        if big is None or tiny is None or big.kernel_format in timed or (formats is not None and
                                                                           big.kernel_format not in formats):
            continue
        timed.add(big.kernel_format)
        module_bytes = sum(b.numel() * b.element_size() for b in big.buffers())
        streamed = [big] + [copy.deepcopy(big) for _ in range(-(-sizes.buffer_bytes // module_bytes) - 1)]
        # the kernel's calls of a decode's rows and of a prompt's blocks, where it takes them; a
        # module that dequantizes many rows instead is timed on those once, at PACKED_OP_MAX_ROWS + 1
        calls = [rows for rows in PACKED_CALL_ROWS if rows <= PACKED_OP_MAX_ROWS or big.kernel_for(rows, dev) == "gemv"]
        tiled = [] if big.kernel_for(PACKED_OP_MAX_ROWS + 1, dev) == "gemv" else [PACKED_OP_MAX_ROWS + 1]
        for rows in calls + tiled:
            x = torch.randn(rows, k, dtype=torch.bfloat16)

            def layers(x: torch.Tensor = x, modules: list[torch.nn.Module] = streamed) -> None:
                for m in modules:
                    m(x)

            def per_value_once(rows: int = rows, layers: Callable[[], None] = layers, tiny: torch.nn.Module = tiny,
                               copies: int = len(streamed), call: bool = rows in calls) -> tuple[float, float]:
                fixed = _time(functools.partial(tiny, torch.randn(rows, small, dtype=torch.bfloat16)), dev,
                              sizes.seconds_per_item)
                seconds = _time(layers, dev, sizes.seconds_per_item) / copies
                if call:  # the kernel's time per value for the call
                    return (seconds - fixed) / (k * n), seconds
                product = 2 * rows * k * n / max(peaks["bf16"], peaks.get("fp32", 0.0))
                return (seconds - fixed - product) / (k * n), seconds

            per_value, seconds = _retimed(per_value_once, lambda result: result[0])
            if per_value <= 0:  # lost in the host's noise
                continue
            if rows in calls:
                out.append(Measurement(f"{PACKED_PREFIX}{big.kernel_format} call {rows} seconds per value", per_value,
                                       "s", seconds))
            else:
                out.append(Measurement(f"{PACKED_PREFIX}{big.kernel_format} dequantization seconds per value",
                                       per_value, "s", seconds))
        del streamed
    return out


ENGINE_LINEAR = "engine linear"


def _engine_linears(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """tuili's own dense linear as the engine's decoder layers run it (tuili/layers/linear.py: an
    PanelLinear where the weight plan lays bf16 weights out in panels, else `linear`: native GEMV or
    AMX kernels where they run, else F.linear): one row, and prompt chunks of ENGINE_LINEAR_ROWS,
    times weight matrices cycled through from memory."""
    from tuili.layers.linear import PanelLinear, linear, panel_holds

    kernels_here = Platform.detect(dev)

    k, out = sizes.skinny_k, []
    for dtype in sizes.skinny_dtypes:
        elem = torch.finfo(_TORCH_DTYPES[dtype]).bits // 8
        sample = torch.empty(k, k, dtype=_TORCH_DTYPES[dtype], device=dev)
        if panel_holds(sample, None, kernels_here):
            matmul, prepare = (lambda x, module: module(x)), (lambda w: PanelLinear(w, None))
        else:
            matmul, prepare = functools.partial(linear, platform=kernels_here), None
        for rows, t, count in _cycled_matmuls(dtype, dev, sizes, k, (1, *ENGINE_LINEAR_ROWS), matmul, prepare):
            name = f"{ENGINE_LINEAR} {dtype} {rows}x{k}x{k}"
            if rows == 1:
                out.append(Measurement(f"{name} weight read", k * k * elem * count / t, "B/s", t))
            else:
                out.append(Measurement(name, 2 * rows * k * k * count / t, "FLOP/s", t))
    return out


def _linear_fields(linears: list[Measurement]) -> dict[str, dict]:
    stream: dict[str, float] = {}
    by_rows: dict[str, dict[int, float]] = {}
    for m in linears:
        dtype, shape = m.name.removeprefix(ENGINE_LINEAR).split()[:2]
        if m.name.endswith("weight read"):
            stream[dtype] = m.value
        else:
            by_rows.setdefault(dtype, {})[int(shape.split("x")[0])] = m.value
    prefill = {dtype: curve[ENGINE_PREFILL_ROWS] for dtype, curve in by_rows.items() if ENGINE_PREFILL_ROWS in curve}
    return {"linear_stream_bandwidth": stream, "linear_prefill_flops": prefill, "linear_flops_by_rows": by_rows}


ENGINE_ATTENTION = "engine attention"
ATTENTION_HEADS = (16, 8, 128)  # query heads, KV heads, head dim: a small model's (Qwen3-0.6B's)


def _engine_attention(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """tuili's causal attention of a fresh prompt over itself, as a prefill runs it in every layer
    (`_prompt_attention`), at the prompt lengths of ENGINE_ATTENTION_TOKENS; FLOPs counted as the
    cost model counts them, 4 x heads x head dim per key a query attends."""
    from tuili.layers.attention import attention_backend

    heads, kv_heads, head_dim = ATTENTION_HEADS
    out = []
    for dtype in sizes.skinny_dtypes:
        backend = attention_backend(Platform.detect(dev), _TORCH_DTYPES[dtype])
        for tokens in ENGINE_ATTENTION_TOKENS:
            q, k, v = (torch.randn(tokens, h, head_dim, device=dev).to(_TORCH_DTYPES[dtype])
                       for h in (heads, kv_heads, kv_heads))
            t = _time(_prompt_attention(backend, q, k, v), dev, sizes.seconds_per_item)
            flops = 4 * heads * head_dim * tokens * (tokens + 1) // 2
            out.append(Measurement(f"{ENGINE_ATTENTION} {dtype} {tokens} tokens", flops / t, "FLOP/s", t))
    return out


def _prompt_attention(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One fresh prompt's attention (q [L, Hq, D], k and v [L, Hkv, D]) as the engine's runner
    hands it to ``backend``: read back from the paged cache by the decodes' kernel where the
    backend asks for prompts that way (`reads_paged_prompts`: the default, batch-invariant mode),
    else causal over k and v as computed. On machine A the AMX prompt kernel ran 3-8x faster than
    the paged one, and `plan --measure` had put TTFT 77% short for timing it where the engine
    does not run it. The keys are stored once, outside the timed call."""
    from tuili.layers.attention import KVCache, PagedBatch

    tokens, scale, block = q.shape[0], q.shape[-1] ** -0.5, 16
    if not backend.reads_paged_prompts:
        return lambda: backend.causal(q, k, v, scale)
    blocks = -(-tokens // block)
    cache = KVCache.allocate((blocks, block, *k.shape[1:]), k.dtype, k.device)
    backend.store(cache, k, v, torch.arange(tokens, device=k.device))
    paged = PagedBatch(torch.arange(blocks, dtype=torch.int32, device=k.device)[None],
                       torch.tensor([[0, tokens, 0]], dtype=torch.int32, device=k.device))
    result = torch.empty_like(q)
    return lambda: backend.attend_paged(q, cache, paged, scale, result)


ENGINE_ELEMENTWISE = "engine elementwise"
ELEMENTWISE_TOKENS = 512  # the prompt whose elementwise work the probe times
ELEMENTWISE_WIDTHS = (1024, 3072)  # hidden and intermediate size: a small model's (Qwen3-0.6B's)


def _engine_elementwise(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """The elementwise work of a decoder layer as the engine runs it (tuili/layers: the native
    fused kernels where they run, else torch), per value, on a prompt of ELEMENTWISE_TOKENS tokens
    of a small model's widths (ATTENTION_HEADS, ELEMENTWISE_WIDTHS): RMSNorm with its residual add
    (per value of the row), the rotation of q and k without and with Qwen3's per-head norms (per
    value of the q and k heads), SiLU(gate) * up (per output value). Between a prompt's matmuls
    they run on their own: on machine A they took ~10% of a 512-token bf16 prompt, which the
    plan had left out (docs/ruler.md §4.3)."""
    from tuili.layers.activation import silu_and_mul
    from tuili.layers.norm import RMSNorm
    from tuili.layers.rotary import RotaryEmbedding, norm_and_rotate

    heads, kv_heads, head_dim = ATTENTION_HEADS
    hidden, inter = ELEMENTWISE_WIDTHS
    tokens, platform = ELEMENTWISE_TOKENS, Platform.detect(dev)
    tables = RotaryEmbedding(head_dim, tokens, 1e6, None).tables(torch.arange(tokens, device=dev))
    out = []
    for dtype in sizes.skinny_dtypes:
        torch_dtype = _TORCH_DTYPES[dtype]

        def rows(width: int, dtype: torch.dtype = torch_dtype) -> torch.Tensor:
            return torch.randn(tokens, width, device=dev).to(dtype)

        norm = RMSNorm(hidden, 1e-6, platform).to(dev, torch_dtype)
        qk_norms = tuple(RMSNorm(head_dim, 1e-6, platform).to(dev, torch_dtype) for _ in range(2))
        x, residual, gate_up = rows(hidden), rows(hidden), rows(2 * inter)
        qkv = rows((heads + 2 * kv_heads) * head_dim).view(tokens, heads + 2 * kv_heads, head_dim)
        work = {  # kind: (the engine's call, values)
            "norm": (lambda x=x, r=residual, n=norm: n(x, r), tokens * hidden),
            "rope": (lambda q=qkv: norm_and_rotate(q, heads, kv_heads, None, tables, platform),
                     tokens * (heads + kv_heads) * head_dim),
            "qk_rope": (lambda q=qkv, n=qk_norms: norm_and_rotate(q, heads, kv_heads, n, tables, platform),
                        tokens * (heads + kv_heads) * head_dim),
            "silu": (lambda g=gate_up: silu_and_mul(g, platform), tokens * inter),
        }
        for kind, (call, values) in work.items():
            t = _time(call, dev, sizes.seconds_per_item)
            out.append(Measurement(f"{ENGINE_ELEMENTWISE} {dtype} {kind} seconds per value", t / values, "s", t))
    return out


def _elementwise_fields(results: list[Measurement]) -> dict[str, dict]:
    per_value: dict[str, dict[str, float]] = {}
    for m in results:
        dtype, kind = m.name.removeprefix(ENGINE_ELEMENTWISE).split()[:2]
        per_value.setdefault(dtype, {})[kind] = m.value
    return {"elementwise_seconds_per_value": per_value}


ENGINE_DELTANET = "engine deltanet"
DELTANET_HEADS = (16, 16, 128, 128)  # key heads, value heads, key and value head dims (Qwen3.5's)
DELTANET_TOKENS = 256


def _engine_deltanet(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """tuili's Gated DeltaNet prompt kernel (kernels.deltanet_chunks) over a DELTANET_TOKENS-token
    prompt of one layer of DELTANET_HEADS, FLOPs counted as the cost model counts the rule's
    (DELTANET_FLOPS_PER_STATE_VALUE per state value and token; the conv, gates and norm it also
    runs are in its time). Only where the native CPU kernels run: elsewhere the torch code
    runs the chunked rule's matmuls, which the linears' rate stands for."""
    from tuili.kernels import deltanet_chunks
    from tuili.perf.cost import DELTANET_FLOPS_PER_STATE_VALUE

    if not Platform.detect(dev).native_kernels:
        return []
    k_heads, v_heads, dk, dv = DELTANET_HEADS
    channels, tokens = 2 * k_heads * dk + v_heads * dv, DELTANET_TOKENS
    out = []
    for dtype in sizes.skinny_dtypes:
        torch_dtype = _TORCH_DTYPES[dtype]
        mixed, z = torch.randn(tokens, channels).to(torch_dtype), torch.randn(tokens, v_heads * dv).to(torch_dtype)
        b, a = (torch.randn(tokens, v_heads).to(torch_dtype) for _ in range(2))
        weight, conv = torch.randn(channels, 4).to(torch_dtype), torch.zeros(1, channels, 3, dtype=torch_dtype)
        state = torch.zeros(1, v_heads, dk, dv)
        a_log, dt_bias = torch.zeros(v_heads, dtype=torch_dtype), torch.zeros(v_heads, dtype=torch_dtype)
        norm, result = torch.ones(dv, dtype=torch_dtype), torch.empty(tokens, v_heads * dv, dtype=torch_dtype)
        run = functools.partial(deltanet_chunks, mixed, z, b, a, weight, conv, state, [(0, tokens, 0)], [[]],
                                a_log, dt_bias, norm, k_heads, 1e-6, result)  # fmt: skip
        t = _time(run, dev, sizes.seconds_per_item)
        flops = DELTANET_FLOPS_PER_STATE_VALUE * v_heads * dk * dv * tokens
        out.append(Measurement(f"{ENGINE_DELTANET} {dtype} {tokens} tokens", flops / t, "FLOP/s", t))
    return out


def _decode_attention_fields(decodes: list[Measurement]) -> dict[str, dict]:
    return {"decode_attention_bandwidth": {m.name.removeprefix(ENGINE_DECODE_ATTENTION).split()[0]: m.value
                                           for m in decodes}}


def _deltanet_fields(deltanet: list[Measurement]) -> dict[str, dict]:
    return {"deltanet_prefill_flops": {m.name.removeprefix(ENGINE_DELTANET).split()[0]: m.value for m in deltanet}}


ENGINE_DECODE_ATTENTION = "engine decode attention"
DECODE_ATTENTION_KEYS = 1024  # the context a probed decode attends over


def _engine_decode_attention(dev: torch.device, sizes: _Sizes) -> list[Measurement]:
    """tuili's decode attention where the native kernel reads the paged cache in place: one
    query token over DECODE_ATTENTION_KEYS keys of ATTENTION_HEADS, one layer's cache after
    another, together larger than the caches, as a decode step reads every layer's from memory.
    The bytes of keys and values read per second, less a call's fixed cost (a 16-key call's
    time, the host overhead's, as for the packed kernels). Elsewhere torch gathers the cache,
    which the memory's rate stands for."""
    from tuili.layers.attention import KVCache, PagedBatch, attention_backend

    heads, kv_heads, head_dim = ATTENTION_HEADS
    block, out = 16, []
    for dtype in sizes.skinny_dtypes:
        torch_dtype = _TORCH_DTYPES[dtype]
        backend = attention_backend(Platform.detect(dev), torch_dtype)
        if not backend.reads_paged_decodes:
            continue
        q = torch.randn(1, heads, head_dim, device=dev).to(torch_dtype)

        def layers(keys: int, count: int, backend: Any = backend, q: torch.Tensor = q) -> Callable[[], object]:
            shape = (keys // block, block, kv_heads, head_dim)
            caches = [KVCache(*(torch.randn(shape, device=dev).to(q.dtype) for _ in range(2))) for _ in range(count)]
            paged = PagedBatch(torch.arange(keys // block, dtype=torch.int32, device=dev)[None],
                               torch.tensor([[0, 1, keys - 1]], dtype=torch.int32, device=dev))
            result = torch.empty_like(q)
            return lambda: [backend.attend_paged(q, cache, paged, head_dim**-0.5, result) for cache in caches]

        keys = DECODE_ATTENTION_KEYS
        layer_bytes = 2 * keys * kv_heads * head_dim * torch_dtype.itemsize
        count = -(-sizes.buffer_bytes // layer_bytes)
        small, large = layers(block, 1), layers(keys, count)
        def timed(small: Callable[[], object] = small, large: Callable[[], object] = large,
                  count: int = count) -> tuple[float, float]:
            return _time(small, dev, sizes.seconds_per_item), _time(large, dev, sizes.seconds_per_item) / count

        fixed, t = _retimed(timed, lambda times: times[1] - times[0])
        if t > fixed:
            out.append(Measurement(f"{ENGINE_DECODE_ATTENTION} {dtype} {keys} keys read", layer_bytes / (t - fixed),
                                   "B/s", t))
    return out


def _attention_fields(attention: list[Measurement]) -> dict[str, dict]:
    curves: dict[str, dict[int, float]] = {}
    for m in attention:
        dtype, tokens = m.name.removeprefix(ENGINE_ATTENTION).split()[:2]
        curves.setdefault(dtype, {})[int(tokens)] = m.value
    return {"attention_flops_by_tokens": curves}


def _packed_fields(results: list[Measurement]) -> dict[str, dict]:
    """The spec's packed fields: each format's call curve, and from it the one-figure rates of the
    specs saved before the curves (one row; per row at the most rows, where many-row steps run the
    kernel), with the dequantization where they do not."""
    fields: dict[str, dict] = {name: {} for name in (*PACKED_MEASURES.values(), "packed_call_seconds_by_rows")}
    curves = fields["packed_call_seconds_by_rows"]
    for m in results:
        if m.name.startswith(PACKED_PREFIX):
            fmt, measure, *rest = m.name.removeprefix(PACKED_PREFIX).split()
            if measure == "call":
                curves.setdefault(fmt, {})[int(rest[0])] = m.value
            else:
                fields[PACKED_MEASURES[measure]][fmt] = m.value
    for fmt, curve in curves.items():
        if 1 in curve:
            fields["packed_kernel_seconds_per_value"][fmt] = curve[1]
        if max(curve) > PACKED_OP_MAX_ROWS:
            fields["packed_rows_seconds_per_value"][fmt] = curve[max(curve)] / max(curve)
    return fields


HOST_PREFIX = "host overhead "
# (HOST_KEYS prefix, toy family, quantization): float Llama layers, packed int4 ones, Qwen3's
_HOST_VARIANTS = (("", "llama", None), ("packed_", "llama", "int4"), ("qk_norm", "qwen3", None))
_TOY_LAYERS = (1, 4)
_TOY_PROMPT = 64  # tokens: a fresh prompt chunk past the packed kernel's rows, as real prompts are
_TOY_REQUESTS = 8  # timed rounds of one request per toy engine (one more warms them up)


def _host_overheads(dev: torch.device, quick: bool) -> list[Measurement]:
    """The engine's fixed host cost per step and per decoder layer (tuili/perf/overhead.py).

    tuili's own engine runs toy models of 1 and 4 layers, 64 wide with a 256-token vocabulary,
    where the work is nil and a step's time is its fixed cost: Python, module calls, torch's
    dispatcher, kernel launches, scheduling, input tensors, sampling. Per model and request, the
    best decode step and the prefill of a 64-token prompt; the slope over layers (the median of
    the requests' paired differences) is a layer's cost, the intercept under the best steps the
    step's. Variants: float Llama layers, packed int4 ones (where
    the engine packs: a CPU) and Qwen3's q/k norms (its layer's extra over Llama's). --quick: the
    float Llama layers only.
    """
    variants = _HOST_VARIANTS[:1] if quick else _HOST_VARIANTS
    if dev.type != "cpu":
        variants = tuple(v for v in variants if v[2] is None)
    lo, hi = _TOY_LAYERS
    fits: dict[tuple[str, str], tuple[float, float]] = {}  # (variant, step kind) -> (step, layer)
    with tempfile.TemporaryDirectory(prefix="tuili-probe-") as tmp:
        for prefix, family, quantization in variants:
            engines = [_toy_engine(_toy_checkpoint(Path(tmp) / f"{prefix}{family}-{layers}", family, layers),
                                   dev, quantization) for layers in _TOY_LAYERS]
            # The two engines take turns, one request each: a shared VM's speed drifts by 1.5x over
            # seconds, and engines timed one after the other then gave a 4-layer step faster than a
            # 1-layer one (a layer's cost came out zero; 1 CI run in ~30). A round's pair of best
            # steps sees the same host, and the median over rounds of their difference is the slope.
            def timed(engines: list = engines) -> list[list[tuple[float, float]]]:
                return [[_toy_request_seconds(engine, request) for engine in engines]
                        for request in range(_TOY_REQUESTS + 1)][1:]  # the first warms up

            def slope(rounds: list[list[tuple[float, float]]], i: int) -> float:
                return statistics.median((b[i] - a[i]) / (hi - lo) for a, b in rounds)

            rounds = _retimed(timed, lambda rounds: min(slope(rounds, 0), slope(rounds, 1)))
            for i, kind in enumerate(("decode", "prefill")):
                layer = max(0.0, slope(rounds, i))
                fits[prefix, kind] = max(0.0, min(a[i] for a, _ in rounds) - lo * layer), layer
    host = {}
    for kind in ("decode", "prefill"):
        host[f"{kind}_step"], host[f"{kind}_layer"] = fits["", kind]
    for kind in ("decode", "prefill"):
        if ("packed_", kind) in fits:
            host[f"packed_{kind}_layer"] = fits["packed_", kind][1]
    if ("qk_norm", "decode") in fits:  # the Qwen3 layer's extra over the Llama layer, at decode
        host["qk_norm_layer"] = max(0.0, fits["qk_norm", "decode"][1] - host["decode_layer"])
    return [Measurement(f"{HOST_PREFIX}{key}", value, "s", value) for key, value in host.items()]


def _toy_engine(path: Path, dev: torch.device, quantization: str | None):
    engine, _ = build_engine(str(path), device=str(dev), max_model_len=2 * _TOY_PROMPT, max_num_seqs=1,
                             kv_cache_memory=16 << 20, quantization=quantization)
    return engine


def _toy_request_seconds(engine, request: int) -> tuple[float, float]:
    """(best decode step, prefill step) of one 16-token request of a toy engine, alone in it."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    engine.add_request({"prompt_token_ids": [1 + (request + i) % 250 for i in range(_TOY_PROMPT)]}, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return min(steps[1:]), steps[0]


def _toy_checkpoint(path: Path, family: str, layers: int) -> Path:
    """A random Llama or Qwen3 checkpoint in the Hugging Face layout, 64 wide (4 heads of 16, 2 KV
    heads), a 128-wide MLP and a 256-token vocabulary with tied embeddings."""
    from safetensors.torch import save_file

    hidden, inter, heads, kv_heads, head_dim, vocab = 64, 128, 4, 2, 16, 256
    config = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"], "model_type": family,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": 4 * _TOY_PROMPT, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": (inter, hidden), layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
        }
        if family == "qwen3":
            shapes |= {layer + "self_attn.q_norm.weight": (head_dim,), layer + "self_attn.k_norm.weight": (head_dim,)}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in shapes.items()}
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _matmul_runner(dtype: str, dev: torch.device) -> Callable[[int, int, int, float], float] | None:
    """A function timing an (m x k) @ (k x n) matmul in ``dtype``, or None where it cannot run here."""
    if dtype in _TORCH_DTYPES:
        def run(m: int, k: int, n: int, budget: float) -> float:
            a = torch.randn(m, k, device=dev).to(_TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=dev).to(_TORCH_DTYPES[dtype])
            if dev.type != "cuda":
                return _time(lambda: a @ b, dev, budget)
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            try:
                return _time(lambda: a @ b, dev, budget)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
        return run
    if dev.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(dev)
    if dtype == "fp8" and capability >= (8, 9) and hasattr(torch, "_scaled_mm"):
        def run_fp8(m: int, k: int, n: int, budget: float) -> float:
            a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
            one = torch.ones((), device=dev)
            return _time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), dev, budget)
        return run_fp8
    if dtype == "int8" and capability >= (7, 5) and hasattr(torch, "_int_mm"):
        def run_int8(m: int, k: int, n: int, budget: float) -> float:
            a = torch.randint(-8, 8, (m, k), dtype=torch.int8, device=dev)
            b = torch.randint(-8, 8, (k, n), dtype=torch.int8, device=dev)
            return _time(lambda: torch._int_mm(a, b), dev, budget)
        return run_int8
    return None


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def _last_level_cache_bytes() -> int:
    """Largest CPU cache the kernel reports (0 if it reports none)."""
    largest = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            largest = max(largest, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return largest


def _memory_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise TuiliError("cannot read this machine's memory size; give a spec file with --hardware") from None
