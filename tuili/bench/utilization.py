"""Prefill MFU and decode MBU as a client can estimate them, from the ruler's cost model (tuili.perf).

The client sees when each request started, its first text and its end, and its token counts. From
those alone (docs/bench.md gives the derivation):

* prefill MFU = sum over requests of the FLOPs to prefill its uncached prompt tokens
  / the time during which at least one request was waiting for its first token / peak FLOP/s.
  That time also holds queueing, network and the first decode step, so this is a lower bound.
* decode MBU = (decode steps x weight bytes + every sequence's KV bytes read at every step it was
  in) / the time during which at least one request was decoding / memory bandwidth. Decode steps
  are not visible to a client: their number is estimated as that decode time divided by the
  token-weighted mean TPOT, i.e. total decode tokens over the mean number of requests decoding
  together. At concurrency 1 both estimates are exact up to the server's own overheads.

A tuili server measures the same quantities per engine step; server_metrics.server_utilization
reads them from its counters, so the two sit side by side in the report.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuili.bench.metrics import RequestRecord
from tuili.errors import TuiliError
from tuili.perf.checkpoint import read_model
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import HardwareSpec
from tuili.perf.resolve import current_hardware


@dataclass
class CostSetup:
    """The model and hardware a run is judged against."""

    cost: ModelCost
    hardware: HardwareSpec
    weight_bytes: int
    weights: str  # where weight_bytes came from: the checkpoint's headers or a format name
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    compute_dtype: str
    devices: int = 1

    @property
    def peak_flops(self) -> float:
        return self.hardware.flops(self.compute_dtype) * self.devices

    @property
    def memory_bandwidth(self) -> float:
        return self.hardware.memory_bandwidth * self.devices


def load_cost_model(model_path: str, hardware: str, weights: str | None = None, kv_dtype: str = "bf16",
                    devices: int = 1) -> CostSetup:
    """The served model (a config.json, a checkpoint directory or a GGUF file) on `devices` x `hardware`.

    Weight bytes are the checkpoint's real ones when its tensors are there, unless `weights` names
    a storage format (bf16, fp8, int4, q4_1, ...); a bare config.json defaults to bf16.
    """
    if devices < 1:
        raise TuiliError(f"--devices {devices!r} is invalid: expected an integer >= 1")
    source = read_model(model_path)
    cost = ModelCost.from_config(source.config)
    if weights is None and source.weights is not None:
        storage, label, compute = source.weights, source.weights.source, "bf16"
    else:
        fmt = weight_format(weights or "bf16")
        storage, label, compute = fmt, fmt.name, fmt.compute_dtype
    return CostSetup(
        cost=cost, hardware=current_hardware(name_or_path=hardware), weight_bytes=cost.weight_bytes(storage),
        weights=label, kv_bytes_per_token=cost.kv_bytes_per_token(kv_dtype),
        state_bytes_per_sequence=cost.state_bytes_per_sequence(), compute_dtype=compute, devices=devices,
    )


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def estimate(records: list[RequestRecord], setup: CostSetup) -> dict:
    """The run's prefill MFU and decode MBU as the client sees them, with the figures behind them."""
    cost = setup.cost
    done = [r for r in records if r.ok and r.prompt_tokens]
    prefill_flops = 0
    for r in done:
        cached = min(r.cached_tokens or 0, r.prompt_tokens - 1)  # at least one token is always computed
        prefill_flops += cost.prefill_flops(cached, r.prompt_tokens - cached)
    prefill_seconds = union_length([(r.start_s, r.start_s + r.ttft_s) for r in done])

    decoding = [r for r in done if r.output_tokens and r.output_tokens >= 2]
    decode_seconds = union_length([(r.start_s + r.ttft_s, r.start_s + r.e2el_s) for r in decoding])
    decode_tokens = sum(r.output_tokens - 1 for r in decoding)
    busy = sum(r.e2el_s - r.ttft_s for r in decoding)  # request-seconds spent decoding
    mean_batch = busy / decode_seconds if decode_seconds > 0 else None
    steps = decode_tokens / mean_batch if mean_batch else 0.0
    kv_bytes = sum(
        cost.decode_bytes(0, setup.kv_bytes_per_token,
                          range(r.prompt_tokens + 1, r.prompt_tokens + r.output_tokens),
                          setup.state_bytes_per_sequence)
        for r in decoding)
    read_fraction = cost.weight_read_fraction(max(1, round(mean_batch or 1)))
    decode_bytes = steps * setup.weight_bytes * read_fraction + kv_bytes

    return {
        "hardware": f"{setup.devices} x {setup.hardware.name}" if setup.devices > 1 else setup.hardware.name,
        "hardware_origin": setup.hardware.origin,
        "compute_dtype": setup.hardware.dtype_used(setup.compute_dtype),
        "peak_flops": setup.peak_flops,
        "memory_bandwidth": setup.memory_bandwidth,
        "weights": setup.weights,
        "weight_bytes": setup.weight_bytes,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "prefill_flops": prefill_flops,
        "prefill_seconds": prefill_seconds,
        "prefill_mfu": prefill_flops / prefill_seconds / setup.peak_flops if prefill_seconds > 0 else None,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_seconds,
        "mean_decode_batch": mean_batch,
        "decode_steps": steps,
        "decode_bytes": decode_bytes,
        "decode_mbu": decode_bytes / decode_seconds / setup.memory_bandwidth if decode_seconds > 0 else None,
    }

