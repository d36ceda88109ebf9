"""Live MFU and MBU: the meter observes each forward step of an engine and keeps end-to-end totals.

The server and the CLI attach one (`engine.add_observer(UtilizationMeter.for_engine(engine))`);
the engine itself knows no cost model or hardware spec.

Prefill is judged by MFU (useful FLOPs / prefill time / peak FLOP/s), decode by MBU (necessary
bytes / decode time / memory bandwidth). A step that mixes prefill chunks and decodes has one
measured duration; it is split between the two in proportion to each part's roofline time
(prefill FLOPs / peak FLOP/s against decode bytes / bandwidth), i.e. as if both parts ran at the
same efficiency. Pure steps are attributed whole.

A utilization above 100% means the peak it divides by is wrong (a quick estimate measured on a
busy machine, say), never that the engine beat the hardware: the meter then reports the
utilization as unknown (None; absent from /metrics), and says why, rather than print it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tuili.errors import TuiliError
from tuili.perf.cost import ModelCost
from tuili.perf.formats import canonical_dtype
from tuili.perf.hardware import HardwareSpec
from tuili.perf.resolve import current_hardware

if TYPE_CHECKING:
    from tuili.engine.core import LLMEngine
    from tuili.engine.stats import StepRecord


@dataclass(frozen=True)
class UtilizationSummary:
    """Totals since the meter started, in SI units; mfu/mbu are fractions (0.45 = 45%)."""

    prefill_tokens: int
    prefill_flops: float
    prefill_seconds: float
    prefill_mfu: float | None
    decode_tokens: int
    decode_flops: float
    decode_bytes: float
    decode_seconds: float
    decode_mbu: float | None
    peak_flops: float
    memory_bandwidth: float
    hardware: str
    hardware_origin: str
    compute_dtype: str

    @property
    def prefill_peak_exceeded(self) -> bool:
        """The measured prefill rate is above the peak: the peak is an underestimate, MFU unknown."""
        return self.prefill_seconds > 0 and self.prefill_flops / self.prefill_seconds > self.peak_flops

    @property
    def decode_peak_exceeded(self) -> bool:
        return self.decode_seconds > 0 and self.decode_bytes / self.decode_seconds > self.memory_bandwidth

    def prometheus(self) -> dict[str, float]:
        """Samples for the server's /metrics, keyed by metric name. The MFU and MBU gauges are
        left out while unknown (their peak exceeded); 0 until there is work to judge."""
        samples = {}
        if not self.prefill_peak_exceeded:
            samples["tuili:prefill_mfu"] = self.prefill_mfu or 0.0
        if not self.decode_peak_exceeded:
            samples["tuili:decode_mbu"] = self.decode_mbu or 0.0
        return samples | {
            "tuili:prefill_flops_total": self.prefill_flops,
            "tuili:prefill_seconds_total": self.prefill_seconds,
            "tuili:prefill_tokens_total": float(self.prefill_tokens),
            "tuili:decode_flops_total": self.decode_flops,
            "tuili:decode_bytes_total": self.decode_bytes,
            "tuili:decode_seconds_total": self.decode_seconds,
            "tuili:decode_tokens_total": float(self.decode_tokens),
            "tuili:peak_flops": self.peak_flops,
            "tuili:memory_bandwidth": self.memory_bandwidth,
        }

    def format(self) -> str:
        """Two lines for a run summary, naming the hardware figures the percentages are against."""
        def pct(x: float | None, exceeded: bool, rate: str) -> str:
            if exceeded:
                return f"unknown (measured {rate}, above the peak below: that peak is too low)"
            return "n/a" if x is None else f"{100 * x:.1f}%"

        prefill_rate = self.prefill_flops / self.prefill_seconds / 1e12 if self.prefill_seconds > 0 else 0.0
        decode_rate = self.decode_bytes / self.decode_seconds / 1e9 if self.decode_seconds > 0 else 0.0
        mfu = pct(self.prefill_mfu, self.prefill_peak_exceeded, f"{prefill_rate:.2f} TFLOP/s")
        mbu = pct(self.decode_mbu, self.decode_peak_exceeded, f"{decode_rate:.1f} GB/s")

        note = " (an estimate: run `tuili probe` for measured figures)" if self.hardware_origin == "estimate" else ""
        return (
            f"prefill: {self.prefill_tokens} tokens, {self.prefill_flops / 1e12:.3f} TFLOP in "
            f"{self.prefill_seconds:.3f} s, MFU {mfu} of "
            f"{self.peak_flops / 1e12:.2f} TFLOP/s {self.compute_dtype}\n"
            f"decode: {self.decode_tokens} tokens, {self.decode_bytes / 1e9:.3f} GB read in "
            f"{self.decode_seconds:.3f} s, MBU {mbu} of "
            f"{self.memory_bandwidth / 1e9:.1f} GB/s — {self.hardware} [{self.hardware_origin}]{note}"
        )


class UtilizationMeter:
    """Counts each step's useful FLOPs and necessary bytes against ``hardware``.

    ``weight_bytes``: bytes of all weight tensors the engine holds (per step the meter counts the
    share a decode step reads: all of it for a dense model with tied embeddings). ``devices``:
    the number of devices the step ran on (the peaks scale with it). ``decode_weight_bytes``:
    when the engine knows exactly what a decode step reads (quantized modules, a packed output
    matrix beside a float embedding), that figure, used as it is for every batch size.

    As an engine's observer it takes each step's record; it asks for device time, since a
    GPU step's wall time means nothing without it.
    """

    wants_device_time = True

    def __init__(
        self, cost: ModelCost, hardware: HardwareSpec, weight_bytes: int, kv_bytes_per_token: int,
        *, compute_dtype: str = "bf16", state_bytes_per_sequence: int | None = None, devices: int = 1,
        decode_weight_bytes: int | None = None, draft_weight_bytes: int = 0,
    ) -> None:
        if weight_bytes <= 0 or kv_bytes_per_token < 0:
            raise TuiliError(
                f"weight_bytes={weight_bytes} and kv_bytes_per_token={kv_bytes_per_token}: expected "
                f"a positive and a non-negative byte count"
            )
        self.cost = cost
        self.hardware = hardware
        self.weight_bytes = weight_bytes
        self.decode_weight_bytes = decode_weight_bytes
        self.draft_weight_bytes = draft_weight_bytes  # a speculative draft model's, read once per draft forward
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes_per_sequence = (
            cost.state_bytes_per_sequence() if state_bytes_per_sequence is None else state_bytes_per_sequence
        )
        self.compute_dtype = hardware.dtype_used(compute_dtype)
        self.peak_flops = hardware.flops(compute_dtype) * devices
        self.memory_bandwidth = hardware.memory_bandwidth * devices
        self._read_fraction: dict[int, float] = {}
        self._lock = threading.Lock()
        self.prefill_tokens = 0
        self.prefill_flops = 0.0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0
        self.decode_flops = 0.0
        self.decode_bytes = 0.0
        self.decode_seconds = 0.0

    @classmethod
    def for_engine(cls, engine: LLMEngine, hardware: str | None = None) -> UtilizationMeter:
        """A meter of what `engine` holds, against ``hardware`` (a preset or spec file; default
        the engine config's `hardware`, else this machine's last `tuili probe`, else a quick
        estimate, marked as such: tuili/perf/resolve.py). Not attached: pass it to
        `engine.add_observer`."""
        spec = current_hardware(engine.device.type, hardware or engine.config.hardware)
        return cls(
            ModelCost.from_config(engine.model_config.raw), spec, engine.weight_bytes(), engine.pool.kv_bytes_per_token,
            compute_dtype=canonical_dtype(str(engine.dtype)),
            # the state slots as the engine holds them (the conv state in the working dtype)
            state_bytes_per_sequence=engine.pool.state_bytes_per_slot,
            # One sequence's read is every step's for a dense model; a mixture of experts reads more
            # experts as the batch grows, so its share comes from the cost model per batch size.
            decode_weight_bytes=(engine.decode_weight_bytes()
                                 if engine.weights_quantized and engine.model_config.moe is None else None),
            draft_weight_bytes=engine.draft_weight_bytes(),
        )

    def on_step(self, record: StepRecord) -> None:
        self.record_step(record.prefill_chunks, record.decode_context_lens, record.seconds,
                         record.verify_chunks, record.num_accepted, record.draft_forwards)

    def step_decode_bytes(self, decode_context_lens: Sequence[int], rows: int | None = None) -> int:
        """Bytes a decode step over these sequences must read; ``rows``: the tokens it computes
        (default one per sequence; a verification chunk computes several), which set the experts
        and embedding rows it reads."""
        if not decode_context_lens:
            return 0
        weights = self.decode_weight_bytes
        if weights is None:
            batch = len(decode_context_lens) if rows is None else rows
            fraction = self._read_fraction.get(batch)
            if fraction is None:
                fraction = self._read_fraction[batch] = self.cost.weight_read_fraction(batch)
            weights = round(self.weight_bytes * fraction)
        return self.cost.decode_bytes(
            weights, self.kv_bytes_per_token, decode_context_lens,
            self.state_bytes_per_sequence,
        )

    def record_step(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], seconds: float,
        verify_chunks: Sequence[tuple[int, int]] = (), num_accepted: int = 0, draft_forwards: int = 0,
    ) -> None:
        """One forward step: prefill chunks as (tokens already cached, chunk length), decodes as
        context lengths including the new token, and the step's wall time in seconds.

        Speculative decoding: a verification chunk (tokens cached, positions) is decode work: it
        reads the weights with the step's decodes and its context's KV once, and computes every
        position (each with its logits); it yields its kept proposals (`num_accepted` in all)
        plus one token. Each of the step's `draft_forwards` reads the draft model's weights."""
        p_flops = sum(self.cost.prefill_flops(start, length) for start, length in prefill_chunks)
        contexts = [*decode_context_lens, *(start + length for start, length in verify_chunks)]
        rows = len(decode_context_lens) + sum(length for _, length in verify_chunks)
        d_bytes = self.step_decode_bytes(contexts, rows) + draft_forwards * self.draft_weight_bytes
        d_flops = self.cost.decode_flops(decode_context_lens) if decode_context_lens else 0
        for start, length in verify_chunks:
            d_flops += self.cost.decode_flops(range(start + 1, start + length + 1))
        decode_tokens = len(decode_context_lens) + len(verify_chunks) + num_accepted
        if prefill_chunks and contexts:
            t_prefill = p_flops / self.peak_flops
            t_decode = d_bytes / self.memory_bandwidth
            prefill_share = t_prefill / (t_prefill + t_decode)
        else:
            prefill_share = 1.0 if prefill_chunks else 0.0
        with self._lock:
            self.prefill_tokens += sum(length for _, length in prefill_chunks)
            self.prefill_flops += p_flops
            self.prefill_seconds += seconds * prefill_share
            self.decode_tokens += decode_tokens
            self.decode_flops += d_flops
            self.decode_bytes += d_bytes
            self.decode_seconds += seconds * (1.0 - prefill_share)

    @property
    def prefill_mfu(self) -> float | None:
        """Useful FLOPs / prefill time / peak; None with no prefill yet, or above 100% (the peak
        is then evidently too low: an estimate measured on a busy machine, a wrong spec)."""
        return _utilization(self.prefill_flops, self.prefill_seconds, self.peak_flops)

    @property
    def decode_mbu(self) -> float | None:
        """Necessary bytes / decode time / bandwidth; None as for prefill_mfu."""
        return _utilization(self.decode_bytes, self.decode_seconds, self.memory_bandwidth)

    def summary(self) -> UtilizationSummary:
        with self._lock:
            return UtilizationSummary(
                prefill_tokens=self.prefill_tokens, prefill_flops=self.prefill_flops,
                prefill_seconds=self.prefill_seconds, prefill_mfu=self.prefill_mfu,
                decode_tokens=self.decode_tokens, decode_flops=self.decode_flops,
                decode_bytes=self.decode_bytes, decode_seconds=self.decode_seconds,
                decode_mbu=self.decode_mbu, peak_flops=self.peak_flops,
                memory_bandwidth=self.memory_bandwidth, hardware=self.hardware.name,
                hardware_origin=self.hardware.origin, compute_dtype=self.compute_dtype,
            )


def _utilization(work: float, seconds: float, peak: float) -> float | None:
    if seconds <= 0:
        return None
    fraction = work / seconds / peak
    return fraction if fraction <= 1.0 else None
