"""Hardware specs: datasheet presets with their sources, user spec files, and probed machines.

Units are SI throughout: FLOP/s, bytes/s, bytes. FLOP/s figures are **dense** peaks (NVIDIA's
datasheets print the 2:4-sparse figure for Ampere and later; the dense one is half of it) for
matrix multiplies on tensor cores, except "fp32", which is the plain (non-tensor) FP32 rate.
GeForce cards are listed at their FP32-accumulate rate, the mode inference kernels use (the
FP16-accumulate rate printed first on their spec pages is twice that). Memory capacities are
binary, as DRAM is built: an "80 GB" card holds 80 x 2^30 bytes (nvidia-smi reports 81920 MiB
on an A100 80GB). Bandwidths are decimal (3.35 TB/s = 3.35e12 bytes/s).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tuili.errors import TuiliError
from tuili.perf.overhead import HOST_KEYS, PACKED_FORMATS

GiB = 2**30
T = 1e12
G = 1e9

# The packed linears' measured times per weight value, by format (HardwareSpec, below), and the
# one-figure fields of specs saved before the formats were told apart (the "int4+zeros" kernel's).
PACKED_FIELDS = ("packed_kernel_seconds_per_value", "packed_dequant_seconds_per_value", "packed_rows_seconds_per_value")
_INT4_FIELDS = {f"int4_{name.removeprefix('packed_')}": name for name in PACKED_FIELDS}
# Dtypes a peak_flops table may list ("tf32": fp32 inputs on tensor cores; "fp32": plain FP32).
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4", "int4")


@dataclass(frozen=True)
class LinkSpec:
    """A link between devices or machines. ``bandwidth`` is bytes/s in each direction (a ring
    all-reduce and a point-to-point copy both run at the one-direction rate). ``latency`` is the
    typical small-message time per hop: an order of magnitude from published measurements, not a
    datasheet figure, so plans that hinge on it say so."""

    name: str
    bandwidth: float
    latency: float
    source: str


ENGINE_PREFILL_ROWS = 512  # the product size of HardwareSpec.linear_prefill_flops
ENGINE_LINEAR_ROWS = (64, 128, 256, 512)  # the product sizes of HardwareSpec.linear_flops_by_rows
ENGINE_ATTENTION_TOKENS = (64, 256, 1024)  # the prompt lengths of HardwareSpec.attention_flops_by_tokens
# The rows of one packed-kernel call at which the probe times it (HardwareSpec.packed_call_seconds_by_rows):
# decode batches, and the blocks of up to kernels.LINEAR_INT4_MAX_ROWS rows a prompt runs in
PACKED_CALL_ROWS = (1, 4, 16, 64, 256)
# The elementwise work of a decoder layer that HardwareSpec.elementwise_seconds_per_value times per
# dtype: the RMSNorm (with its residual add), the rotary embedding of q and k without and with
# Qwen3's per-head norms, and SiLU(gate) * up (tuili/layers, csrc/elementwise.c)
ELEMENTWISE_KINDS = ("norm", "rope", "qk_rope", "silu")
# HardwareSpec's seconds per value two keys deep: per format and call rows, per dtype and kind
SECONDS_TABLES = ("packed_call_seconds_by_rows", "elementwise_seconds_per_value")
# HardwareSpec's measured curves: a FLOP/s per dtype at each size (rows of a product, tokens of a prompt)
CURVES = ("linear_flops_by_rows", "attention_flops_by_tokens")
# ... and its measured rates, one per dtype
PER_DTYPE = ("linear_stream_bandwidth", "linear_prefill_flops", "deltanet_prefill_flops", "decode_attention_bandwidth")


@dataclass(frozen=True)
class HardwareSpec:
    """One device: its peaks by dtype, memory bandwidth and size, and where the figures came from.

    ``origin`` is "preset" (a datasheet), "file" (a user's spec), "probe" (measured on this
    machine by `tuili probe`) or "estimate" (a quick built-in guess, made when nothing better is
    known; every report that uses one says so).

    ``host_overhead_seconds``: the fixed host cost of tuili's engine per step and per decoder
    layer (tuili/perf/overhead.py HOST_KEYS), as `tuili probe` measured it here. Presets have
    none: a datasheet states no such figure, so their step times are the roofline floor, which an
    engine replaying CUDA graphs approaches and an eager one does not.
    ``packed_kernel_seconds_per_value`` and ``packed_dequant_seconds_per_value``, per packed
    format (tuili/perf/overhead.py PACKED_FORMATS: "int4", "int4+zeros", "int8", ...): the time
    tuili's packed linears (a CPU's) take per weight value in their weight-only kernel (per row)
    and to dequantize it for a many-row matmul, beyond a call's fixed cost (which the host
    overhead counts); absent where not measured.
    ``packed_rows_seconds_per_value``, per format: where a many-row step runs that kernel rather
    than dequantizing (the batch-invariant mode wherever tuili's native kernels run: it takes up to
    256 rows per call, its cost grows with them), its time per weight value and row at many rows;
    that format's dequantization is then absent. A spec saved before the formats were told apart
    gives one figure each (``int4_kernel_seconds_per_value``, ...): the "int4+zeros" kernel's,
    which it had timed.
    ``packed_call_seconds_by_rows``, per format: the time per weight value of one call of that
    kernel on each number of rows of PACKED_CALL_ROWS it takes (beyond a call's fixed cost), the
    curve a step's calls are charged on (interpolated in rows): a call reads and unpacks the codes
    once for all its rows, so 16 rows cost a few times one row's time, not 16 times, and a
    256-row block less per row than 33 rows. Where a format has it, it stands for the two figures
    above; specs saved before 2026-12-08 have none and are charged rows x those.
    ``linear_stream_bandwidth`` and ``linear_prefill_flops``, per dtype: the bytes/s at which
    tuili's own dense linear layers (tuili/layers/linear.py, with whatever native kernels run
    here) stream a weight matrix from memory at one row, and their FLOP/s at a 512-row product
    from memory, as `tuili probe` measured them. The planner's step times do not fall below what
    these allow (the engine's floor above the hardware's roofline); presets have none.
    ``linear_flops_by_rows``, per dtype: the same FLOP/s at each product size of
    ENGINE_LINEAR_ROWS, since it depends on the rows: the native AMX kernel takes up to 128 and
    oneDNN's per-call weight reorder weighs more on fewer rows (docs/ruler.md §4.2).
    ``attention_flops_by_tokens``, per dtype: the FLOP/s of tuili's causal prompt attention
    (tuili/layers/attention.py) at each prompt length of ENGINE_ATTENTION_TOKENS, its FLOPs
    counted as the cost model counts them (the causal half only). It runs several times below the
    linears' rate, so a prompt's attention is charged at its own rate.
    ``decode_attention_bandwidth``, per cache dtype: the bytes/s of keys and values tuili's decode
    attention (the paged kernel) reads from memory at batch 1, one layer's cache after another,
    beyond a call's fixed cost; a decode step charges its cache reads at it (on an AVX2 Zen 3 it
    runs at a third of the memory's rate). Measured only where the native CPU kernels run.
    ``deltanet_prefill_flops``, per dtype: the FLOP/s of tuili's Gated DeltaNet prompt kernel
    (csrc/deltanet.c, token by token) on a prompt, its FLOPs counted as the cost model counts the
    rule's (7 per state value and token); a hybrid's prompt charges its rule at this rate.
    Measured only where the native CPU kernels run.
    ``elementwise_seconds_per_value``, per dtype: the seconds per value of the elementwise work
    of a decoder layer as the engine runs it (ELEMENTWISE_KINDS: per value of a normed row, of the
    rotated q and k heads, of the SiLU's output), on a 512-token prompt of a small model's widths;
    a step charges its tokens' values at them (docs/ruler.md §4.3).
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    interconnect: str | None = None
    source: str = ""
    origin: str = "preset"
    measurements: dict[str, float] = field(default_factory=dict)
    host_overhead_seconds: dict[str, float] = field(default_factory=dict)
    packed_kernel_seconds_per_value: dict[str, float] = field(default_factory=dict)
    packed_dequant_seconds_per_value: dict[str, float] = field(default_factory=dict)
    packed_rows_seconds_per_value: dict[str, float] = field(default_factory=dict)
    packed_call_seconds_by_rows: dict[str, dict[int, float]] = field(default_factory=dict)
    linear_stream_bandwidth: dict[str, float] = field(default_factory=dict)
    linear_prefill_flops: dict[str, float] = field(default_factory=dict)
    linear_flops_by_rows: dict[str, dict[int, float]] = field(default_factory=dict)
    attention_flops_by_tokens: dict[str, dict[int, float]] = field(default_factory=dict)
    deltanet_prefill_flops: dict[str, float] = field(default_factory=dict)
    decode_attention_bandwidth: dict[str, float] = field(default_factory=dict)
    elementwise_seconds_per_value: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise TuiliError(f"hardware {self.name!r} gives no peak_flops: expected e.g. {{\"bf16\": 989.4e12}}")
        for dtype, value in self.peak_flops.items():
            if dtype not in PEAK_DTYPES:
                raise TuiliError(
                    f"hardware {self.name!r} lists peak_flops for {dtype!r}: expected dtypes among {', '.join(PEAK_DTYPES)}"
                )
            _positive(f"peak_flops[{dtype!r}] of {self.name!r}", value)
        _positive(f"memory_bandwidth of {self.name!r}", self.memory_bandwidth)
        _positive(f"memory_bytes of {self.name!r}", self.memory_bytes)
        for key, seconds in self.host_overhead_seconds.items():
            if key not in HOST_KEYS:
                raise TuiliError(
                    f"hardware {self.name!r} lists host_overhead_seconds for {key!r}: expected keys among "
                    f"{', '.join(HOST_KEYS)}"
                )
            if not 0 <= seconds < 1:
                raise TuiliError(
                    f"host_overhead_seconds[{key!r}] of {self.name!r}={seconds!r} is invalid: expected "
                    f"seconds, >= 0 and well under 1"
                )
        for name in PACKED_FIELDS:
            for fmt, seconds in getattr(self, name).items():
                self._check_key(name, fmt, PACKED_FORMATS, "packed formats")
                self._check_seconds(f"{name}[{fmt!r}]", seconds, "seconds per weight value")
        for fmt, curve in self.packed_call_seconds_by_rows.items():
            self._check_key("packed_call_seconds_by_rows", fmt, PACKED_FORMATS, "packed formats")
            for rows, seconds in curve.items():
                if not isinstance(rows, int) or rows < 1:
                    raise TuiliError(f"packed_call_seconds_by_rows[{fmt!r}] of {self.name!r} has the rows {rows!r}: "
                                     f"expected integers >= 1")
                self._check_seconds(f"packed_call_seconds_by_rows[{fmt!r}][{rows}]", seconds, "seconds per weight value")
        for dtype, kinds in self.elementwise_seconds_per_value.items():
            self._check_key("elementwise_seconds_per_value", dtype, PEAK_DTYPES, "dtypes")
            for kind, seconds in kinds.items():
                self._check_key(f"elementwise_seconds_per_value[{dtype!r}]", kind, ELEMENTWISE_KINDS, "kinds")
                self._check_seconds(f"elementwise_seconds_per_value[{dtype!r}][{kind!r}]", seconds, "seconds per value")
        for name in PER_DTYPE:
            for dtype, value in getattr(self, name).items():
                if dtype not in PEAK_DTYPES:
                    raise TuiliError(
                        f"hardware {self.name!r} lists {name} for {dtype!r}: expected dtypes among {', '.join(PEAK_DTYPES)}"
                    )
                _positive(f"{name}[{dtype!r}] of {self.name!r}", value)
        for name in CURVES:
            for dtype, curve in getattr(self, name).items():
                if dtype not in PEAK_DTYPES:
                    raise TuiliError(
                        f"hardware {self.name!r} lists {name} for {dtype!r}: expected dtypes among "
                        f"{', '.join(PEAK_DTYPES)}"
                    )
                for size, value in curve.items():
                    if not isinstance(size, int) or size < 1:
                        raise TuiliError(
                            f"{name}[{dtype!r}] of {self.name!r} has the size {size!r}: expected integers >= 1"
                        )
                    _positive(f"{name}[{dtype!r}][{size}] of {self.name!r}", value)
        if self.interconnect is not None and self.interconnect not in LINKS:
            raise TuiliError(
                f"hardware {self.name!r} names interconnect {self.interconnect!r}: expected one of {', '.join(LINKS)}"
            )

    def _check_key(self, field: str, key: str, allowed: tuple[str, ...], what: str) -> None:
        if key not in allowed:
            raise TuiliError(f"hardware {self.name!r} lists {field} for {key!r}: expected {what} among "
                             f"{', '.join(allowed)}")

    def _check_seconds(self, where: str, seconds: float, what: str) -> None:
        if not 0 < seconds < 1e-3:
            raise TuiliError(f"{where} of {self.name!r}={seconds!r} is invalid: expected {what}, > 0 and well under "
                             f"a millisecond")

    def linear_flops(self, dtype: str, rows: int) -> float | None:
        """FLOP/s of tuili's linears in ``dtype`` at a product of ``rows`` rows: interpolated
        between the measured sizes (linear_flops_by_rows), the nearest one outside them, else the
        512-row figure; None where nothing was measured."""
        curve = self.linear_flops_by_rows.get(dtype)
        return _interpolate(curve, rows) if curve else self.linear_prefill_flops.get(dtype)

    def attention_flops(self, dtype: str, tokens: int) -> float | None:
        """FLOP/s of tuili's causal attention over a ``tokens``-token prompt in ``dtype``
        (attention_flops_by_tokens, interpolated); None where nothing was measured."""
        curve = self.attention_flops_by_tokens.get(dtype)
        return _interpolate(curve, tokens) if curve else None

    def deltanet_flops(self, dtype: str) -> float | None:
        """FLOP/s of tuili's DeltaNet prompt kernel in ``dtype``; None where not measured."""
        return self.deltanet_prefill_flops.get(dtype)

    def flops(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (the rate of ``dtype_used(dtype)``)."""
        return self.peak_flops[self.dtype_used(dtype)]

    def dtype_used(self, dtype: str) -> str:
        """The dtype whose peak ``flops(dtype)`` returns: ``dtype``'s; for a dtype the device lacks
        the 16-bit one's (it would run there after dequantizing), then fp32's. Never a rate below
        fp32's: a narrower matmul can run in fp32 after widening, and tuili's CPU kernels do so
        where the CPU has no bf16 arithmetic (on an AVX2 CPU PyTorch's bf16 matmul runs at ~1% of
        its fp32 rate: 0.7 against 77 GFLOP/s on two Zen 3 cores)."""
        for candidate in (dtype, "bf16", "fp16", "fp32"):
            if candidate in self.peak_flops:
                faster = "fp32" in self.peak_flops and self.peak_flops["fp32"] > self.peak_flops[candidate]
                return "fp32" if faster else candidate
        return max(self.peak_flops, key=self.peak_flops.__getitem__)

    @property
    def estimated(self) -> bool:
        return self.origin == "estimate"

    def packed_call_seconds(self, fmt: str, rows: int) -> float | None:
        """Seconds per weight value of one packed-kernel call of ``rows`` rows in format ``fmt``
        (packed_call_seconds_by_rows, interpolated); None where the format's curve was not measured."""
        curve = self.packed_call_seconds_by_rows.get(fmt)
        return _interpolate(curve, rows) if curve else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "hardware spec") -> HardwareSpec:
        if not isinstance(data, dict):
            raise TuiliError(f"{where}: expected a JSON/YAML object, got {type(data).__name__}")
        required = ("name", "peak_flops", "memory_bandwidth", "memory_bytes")
        missing = [k for k in required if k not in data]
        if missing:
            raise TuiliError(
                f"{where} lacks {', '.join(missing)}: a spec needs name, peak_flops (FLOP/s by dtype), "
                f"memory_bandwidth (bytes/s) and memory_bytes"
            )
        known = {f for f in cls.__dataclass_fields__} | set(_INT4_FIELDS)
        unknown = sorted(set(data) - known)
        if unknown:
            raise TuiliError(f"{where} has unknown field(s) {', '.join(unknown)}: expected {', '.join(sorted(known))}")
        if not isinstance(data["peak_flops"], dict):
            raise TuiliError(f"{where}: peak_flops must map dtype names to FLOP/s, got {data['peak_flops']!r}")
        data = {**data}
        for old, name in _INT4_FIELDS.items():
            seconds = _number(f"{where} {old}", data.pop(old, 0.0))
            if not 0 <= seconds < 1e-3:
                raise TuiliError(f"{where}: {old}={seconds!r} is invalid: expected seconds per weight value, >= 0 "
                                 f"and well under a millisecond")
            if seconds and not data.get(name):  # 0 meant "not measured"
                data[name] = {"int4+zeros": seconds}
        return cls(
            name=str(data["name"]),
            peak_flops={str(k).lower(): _number(f"{where} peak_flops[{k!r}]", v) for k, v in data["peak_flops"].items()},
            memory_bandwidth=_number(f"{where} memory_bandwidth", data["memory_bandwidth"]),
            memory_bytes=int(_number(f"{where} memory_bytes", data["memory_bytes"])),
            interconnect=data.get("interconnect"),
            source=str(data.get("source", where)),
            origin=str(data.get("origin", "file")),
            measurements={str(k): float(v) for k, v in (data.get("measurements") or {}).items()},
            # absent from specs saved before overheads were measured: those predict the roofline
            host_overhead_seconds={
                str(k): _number(f"{where} host_overhead_seconds[{k!r}]", v)
                for k, v in _mapping(where, "host_overhead_seconds", data.get("host_overhead_seconds")).items()
            },
            **{name: {str(k).lower(): _number(f"{where} {name}[{k!r}]", v)
                      for k, v in _mapping(where, name, data.get(name)).items()}
               for name in (*PER_DTYPE, *PACKED_FIELDS)},
            **{name: _table(where, name, data, _size) for name in CURVES},
            packed_call_seconds_by_rows=_table(where, "packed_call_seconds_by_rows", data, _size),
            elementwise_seconds_per_value=_table(where, "elementwise_seconds_per_value", data, lambda _, kind: str(kind)),
        )


def _interpolate(curve: dict[int, float], size: int) -> float:
    """The rate at ``size``: linear between the measured sizes, the nearest one outside them."""
    points = sorted(curve.items())
    if size <= points[0][0]:
        return points[0][1]
    for (low, low_rate), (high, high_rate) in itertools.pairwise(points):
        if size <= high:
            return low_rate + (high_rate - low_rate) * (size - low) / (high - low)
    return points[-1][1]


def _table(where: str, name: str, data: dict, inner_key: Callable[[str, object], object]) -> dict:
    """Field ``name`` of ``data``: numbers by an outer key (a dtype, a format) and an inner one
    (``inner_key`` of the written key: a curve's size, a kind)."""
    return {
        str(outer).lower(): {
            inner_key(f"{where} {name}[{outer!r}]", key): _number(f"{where} {name}[{outer!r}][{key!r}]", seconds)
            for key, seconds in _mapping(where, f"{name}[{outer!r}]", table).items()
        }
        for outer, table in _mapping(where, name, data.get(name)).items()
    }


def _size(where: str, value: object) -> int:
    """A curve's size (rows, tokens), written as a JSON object key (a string) or a number."""
    try:
        return int(str(value))
    except ValueError:
        raise TuiliError(f"{where}: {value!r} is not a whole number") from None


def _mapping(where: str, name: str, value: object) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TuiliError(f"{where}: {name} must map names to numbers, got {value!r}")
    return value


def _number(where: str, value: object) -> float:
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads "5.0e13" as a string; accept any numeric spelling
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TuiliError(f"{where}={value!r} is invalid: expected a number (SI units)")
    return float(value)


def _positive(where: str, value: float) -> None:
    if not value > 0:
        raise TuiliError(f"{where}={value!r} is invalid: expected a positive number")


# ---- links ------------------------------------------------------------------------------------

_PCIE = "PCI-SIG base specs: 8/16/32 GT/s per lane, 128b/130b encoding, x16, per direction"
_NVLINK = "NVIDIA NVLink product page and GPU datasheets (total bidirectional figure / 2)"
_ETH = "IEEE 802.3 line rate / 8"
_IB = "InfiniBand Trade Association data rates (4x link) / 8"
_LAT = "latency: typical small-message figure (NCCL tests, perftest), order of magnitude only"

LINKS: dict[str, LinkSpec] = {
    "pcie3": LinkSpec("pcie3", 8e9 * 16 * 128 / 130 / 8, 5e-6, f"{_PCIE}; {_LAT}"),
    "pcie4": LinkSpec("pcie4", 16e9 * 16 * 128 / 130 / 8, 5e-6, f"{_PCIE}; {_LAT}"),
    "pcie5": LinkSpec("pcie5", 32e9 * 16 * 128 / 130 / 8, 5e-6, f"{_PCIE}; {_LAT}"),
    "nvlink2": LinkSpec("nvlink2", 150 * G, 3e-6, f"V100 SXM2: 300 GB/s total; {_NVLINK}; {_LAT}"),
    "nvlink3": LinkSpec("nvlink3", 300 * G, 3e-6, f"A100 SXM: 600 GB/s total; {_NVLINK}; {_LAT}"),
    "nvlink4": LinkSpec("nvlink4", 450 * G, 3e-6, f"H100/H200/H20 SXM: 900 GB/s total; {_NVLINK}; {_LAT}"),
    "nvlink-h800": LinkSpec("nvlink-h800", 200 * G, 3e-6, f"H800 SXM: 400 GB/s total; {_NVLINK}; {_LAT}"),
    "nvlink5": LinkSpec("nvlink5", 900 * G, 3e-6, f"B200: 1.8 TB/s total; {_NVLINK}; {_LAT}"),
    "100gbe": LinkSpec("100gbe", 100e9 / 8, 10e-6, f"{_ETH}; {_LAT} (RoCE; TCP is slower)"),
    "200gbe": LinkSpec("200gbe", 200e9 / 8, 10e-6, f"{_ETH}; {_LAT} (RoCE; TCP is slower)"),
    "400gbe": LinkSpec("400gbe", 400e9 / 8, 10e-6, f"{_ETH}; {_LAT} (RoCE; TCP is slower)"),
    "ib-edr": LinkSpec("ib-edr", 100e9 / 8, 2e-6, f"EDR 100 Gb/s; {_IB}; {_LAT}"),
    "ib-hdr": LinkSpec("ib-hdr", 200e9 / 8, 2e-6, f"HDR 200 Gb/s; {_IB}; {_LAT}"),
    "ib-ndr": LinkSpec("ib-ndr", 400e9 / 8, 2e-6, f"NDR 400 Gb/s; {_IB}; {_LAT}"),
    "ib-xdr": LinkSpec("ib-xdr", 800e9 / 8, 2e-6, f"XDR 800 Gb/s; {_IB}; {_LAT}"),
    # Ranks of one CPU machine all-reduce through shared memory (tuili/parallel/shm.py).
    "cpu-shm": LinkSpec("cpu-shm", 4.5e9, 4.4e-6, "tuili's shared-memory all-reduce between two processes, measured "
                        "by benchmarks/tensor_parallel.py on an AMD EPYC Zen 5 (2 cores), 2026-12-02"),
}
_LINK_ALIASES = {
    "pcie3-x16": "pcie3", "pcie4-x16": "pcie4", "pcie5-x16": "pcie5",
    "100gbe-ethernet": "100gbe", "ib-100g": "ib-edr", "ib-200g": "ib-hdr", "ib-400g": "ib-ndr", "ib-800g": "ib-xdr",
    "infiniband-ndr": "ib-ndr", "400g-ib": "ib-ndr",
}


def link(name: str) -> LinkSpec:
    key = _LINK_ALIASES.get(name.lower(), name.lower())
    if key not in LINKS:
        raise TuiliError(f"unknown link {name!r}: expected one of {', '.join(LINKS)}")
    return LINKS[key]


# ---- presets ----------------------------------------------------------------------------------

_V100 = "NVIDIA Tesla V100 datasheet (volta-v100-datasheet-update-us-1165301-r5)"
_T4 = "NVIDIA T4 datasheet (t4-tensor-core-datasheet-951643)"
_A10 = "NVIDIA A10 datasheet (a10-datasheet-nvidia-us-2144296); sparse figures halved"
_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4); sparse figures halved"
_L40S = "NVIDIA L40S datasheet (l40s-datasheet-2648316); sparse figures halved"
_H100 = "NVIDIA H100 datasheet (h100-datasheet-2430615); sparse figures halved"
_H800 = "NVIDIA H800 SXM5 product brief: H100 SXM compute, 3.35 TB/s, NVLink 400 GB/s; sparse figures halved"
_H20 = "NVIDIA H20 published specs (148 TFLOPS BF16, 296 TFLOPS FP8/INT8 dense, 96 GB HBM3, 4.0 TB/s)"
_H200 = "NVIDIA H200 datasheet (h200-datasheet-3002446); sparse figures halved"
_B200 = "NVIDIA HGX B200 datasheet, individual GPU at 1,000 W; sparse figures halved"
_GA102 = "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (FP32 accumulate)"
_AD102 = "NVIDIA Ada GPU architecture whitepaper, appendix A (FP32 accumulate)"
_GB202 = "NVIDIA RTX Blackwell GPU architecture whitepaper, appendix (FP32 accumulate)"


def _gpu(name: str, flops_t: dict[str, float], bw: float, mem_gib: float, link_name: str, source: str) -> HardwareSpec:
    return HardwareSpec(
        name=name, peak_flops={k: v * T for k, v in flops_t.items()}, memory_bandwidth=bw,
        memory_bytes=int(mem_gib * GiB), interconnect=link_name, source=source, origin="preset",
    )


_V100_SXM2 = {"fp16": 125, "fp32": 15.7}
_V100_PCIE = {"fp16": 112, "fp32": 14}
_AMPERE_A100 = {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "int8": 624}
_HOPPER_SXM = {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}

PRESETS: dict[str, HardwareSpec] = {p.name: p for p in [
    _gpu("v100-sxm2-16gb", _V100_SXM2, 900 * G, 16, "nvlink2", _V100),
    _gpu("v100-sxm2-32gb", _V100_SXM2, 900 * G, 32, "nvlink2", _V100),
    _gpu("v100-pcie-16gb", _V100_PCIE, 900 * G, 16, "pcie3", _V100),
    _gpu("v100-pcie-32gb", _V100_PCIE, 900 * G, 32, "pcie3", _V100),
    _gpu("v100s", {"fp16": 130, "fp32": 16.4}, 1134 * G, 32, "pcie3", "NVIDIA V100S PCIe datasheet"),
    _gpu("t4", {"fp16": 65, "int8": 130, "fp32": 8.1}, 320 * G, 16, "pcie3", _T4),
    _gpu("a10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125, "int8": 250}, 600 * G, 24, "pcie4", _A10),
    _gpu("a100-sxm-40gb", _AMPERE_A100, 1555 * G, 40, "nvlink3", _A100),
    _gpu("a100-sxm-80gb", _AMPERE_A100, 2039 * G, 80, "nvlink3", _A100),
    _gpu("a100-pcie-40gb", _AMPERE_A100, 1555 * G, 40, "pcie4", _A100),
    _gpu("a100-pcie-80gb", _AMPERE_A100, 1935 * G, 80, "pcie4", _A100),
    _gpu("l40s", {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733, "int8": 733},
         864 * G, 48, "pcie4", _L40S),
    _gpu("h100-sxm", _HOPPER_SXM, 3350 * G, 80, "nvlink4", _H100),
    _gpu("h100-pcie", {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513},
         2000 * G, 80, "pcie5", _H100),
    _gpu("h800", _HOPPER_SXM, 3350 * G, 80, "nvlink-h800", _H800),
    _gpu("h20", {"fp32": 44, "tf32": 74, "bf16": 148, "fp16": 148, "fp8": 296, "int8": 296},
         4000 * G, 96, "nvlink4", _H20),
    _gpu("h200", _HOPPER_SXM, 4800 * G, 141, "nvlink4", _H200),
    _gpu("b200", {"fp32": 75, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500, "int8": 4500, "fp4": 9000},
         7700 * G, 180, "nvlink5", _B200),
    _gpu("rtx3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71, "int8": 284}, 936 * G, 24, "pcie4", _GA102),
    _gpu("rtx4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6},
         1008 * G, 24, "pcie4", _AD102),
    _gpu("rtx5090", {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419, "int8": 838, "fp4": 1676},
         1792 * G, 32, "pcie5", _GB202),
]}

_PRESET_ALIASES = {
    "v100": "v100-sxm2-32gb", "v100-sxm2": "v100-sxm2-32gb", "v100-pcie": "v100-pcie-32gb",
    "v100s-pcie": "v100s", "a100": "a100-sxm-80gb", "a100-40gb": "a100-sxm-40gb", "a100-80gb": "a100-sxm-80gb",
    "a100-sxm": "a100-sxm-80gb", "a100-pcie": "a100-pcie-80gb", "h100": "h100-sxm", "h800-sxm": "h800",
    "h200-sxm": "h200", "rtx-3090": "rtx3090", "rtx-4090": "rtx4090", "rtx-5090": "rtx5090",
    "3090": "rtx3090", "4090": "rtx4090", "5090": "rtx5090",
}

# nvidia-smi / torch.cuda device names -> preset, tried in order.
_DEVICE_NAME_PATTERNS: list[tuple[str, str | None]] = [
    # A MIG slice or a card whose variant has other figures gets no preset (it is estimated).
    (r"\bMIG\b", None), (r"H100 NVL", None), (r"H200 NVL", None),
    (r"V100S", "v100s"),
    (r"V100.*SXM2.*16", "v100-sxm2-16gb"), (r"V100.*SXM2", "v100-sxm2-32gb"),
    (r"V100.*PCIE.*16", "v100-pcie-16gb"), (r"V100", "v100-pcie-32gb"),
    (r"\bT4\b", "t4"), (r"\bA10\b", "a10"),
    (r"A100.*SXM.*40", "a100-sxm-40gb"), (r"A100.*SXM", "a100-sxm-80gb"),
    (r"A100.*PCIE.*40", "a100-pcie-40gb"), (r"A100.*(PCIE|80GB PCIe)", "a100-pcie-80gb"), (r"A100", "a100-sxm-80gb"),
    (r"L40S", "l40s"), (r"H100.*PCIE", "h100-pcie"), (r"H100", "h100-sxm"), (r"H800", "h800"),
    (r"H20\b", "h20"), (r"H200", "h200"), (r"B200", "b200"),
    (r"RTX 3090", "rtx3090"), (r"RTX 4090", "rtx4090"), (r"RTX 5090", "rtx5090"),
]


def preset(name: str) -> HardwareSpec:
    """A preset by name (case-insensitive, a few common aliases accepted)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise TuiliError(f"unknown hardware {name!r}: expected a spec file or one of {', '.join(PRESETS)}")
    return PRESETS[key]


def preset_for_device_name(device_name: str) -> HardwareSpec | None:
    """The preset whose card a driver-reported device name ("NVIDIA H100 80GB HBM3") denotes."""
    for pattern, key in _DEVICE_NAME_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return PRESETS[key] if key else None
    return None


# ---- spec files and probe results -------------------------------------------------------------

def load_spec_file(path: str | os.PathLike) -> HardwareSpec:
    """A user's spec (JSON, or YAML when PyYAML is installed) in the fields of HardwareSpec."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TuiliError(f"cannot read hardware spec {str(p)!r}: {e.strerror}") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise TuiliError(f"{p} is YAML but PyYAML is not installed: pip install pyyaml, or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TuiliError(f"{p} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TuiliError(f"{p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return HardwareSpec.from_dict(data, where=str(p))


def cache_dir() -> Path:
    """Where tuili keeps probe results: $TUILI_CACHE_DIR, else $XDG_CACHE_HOME/tuili, else ~/.cache/tuili."""
    if os.environ.get("TUILI_CACHE_DIR"):
        return Path(os.environ["TUILI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuili"


def machine_key(device: str) -> str:
    """Names this machine and device for the probe cache: hostname plus the device ("myhost-cuda0")."""
    dev = device.lower().replace(":", "")
    if dev == "cuda":
        dev = "cuda0"
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"
    return f"{host}-{dev}"


def probe_path(device: str) -> Path:
    return cache_dir() / "hardware" / f"{machine_key(device)}.json"


def save_probe(spec: HardwareSpec, device: str) -> Path:
    path = probe_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: the engine may read it while a probe writes
    return path
