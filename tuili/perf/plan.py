"""Capacity and latency planning: the cost model against a hardware spec, for one serving shape.

A step's time is the larger of its compute time (FLOPs / peak) and its memory time (bytes /
bandwidth), each a roofline floor divided by an assumed efficiency (``mfu``/``mbu``, 1.0 by default:
the physical limit), plus the engine's fixed host cost for the step (the hardware spec's measured
seconds per step and per decoder layer, times the config's layers, tuili/perf/overhead.py; 0 for
datasheet presets), plus its tensor-parallel communication; these are assumed not to
overlap. Where `tuili probe` timed tuili's own linears (weight streaming at one row, FLOP/s at
prompt size), a step takes at least what those rates allow: the difference to the roofline is
the step's `kernels` term. Packed linears (plan --measure of an engine that holds them) run kernels of their
own: their time is a roofline of its own with their measured unpacking rate (per format) as a third ceiling,
and a many-row step first dequantizes them, or, where the probe found many rows running the same
kernel (the batch-invariant mode with native kernels), unpacks them for every row at its many-row
rate. A speculating engine's decode step is the target's verification of k proposals per
sequence plus the proposer's forwards (tuili/perf/speculation.py). docs/ruler.md states each formula and the reserve assumed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tuili.errors import TuiliError
from tuili.perf.cost import CheckpointBytes, ModelCost, WeightStorage
from tuili.perf.formats import WeightFormat, dtype_bytes
from tuili.perf.hardware import HardwareSpec, LinkSpec, link
from tuili.perf.overhead import (
    HOST_KEYS,
    PACKED_FORMATS,
    PACKED_KINDS,
    PACKED_OP_MAX_ROWS,
    PackedWork,
    Step,
    host_seconds,
    kernel_calls,
    packed_work,
)
from tuili.perf.speculation import Speculation

# Share of each device's memory kept back for activations, the CUDA context, allocator slack and
# other runtime state: vLLM's default gpu_memory_utilization=0.9 leaves 10%, and seed 004 advises
# 10-20% for activations plus a few hundred MB to 1 GB for the framework.
DEFAULT_RESERVE_FRACTION = 0.10
ACTIVATION_DTYPE = "bf16"  # what crosses the link in a tensor-parallel all-reduce
# The fewest tokens the engine puts in one pipeline micro-batch (tuili/parallel/pipeline_runner.py
# MIN_MICRO_BATCH_TOKENS, which a test keeps equal): a decode step of fewer sequences runs whole.
PIPELINE_MICRO_BATCH_TOKENS = 256


@dataclass(frozen=True)
class PlanInputs:
    weights: WeightStorage
    kv_dtype: str = "bf16"
    gpus: int = 1
    tp: int = 1
    pp: int = 1  # pipeline stages (tuili/parallel/pipeline.py), each a TP group of `tp` devices
    context: int = 4096  # tokens a request reaches (prompt + output): what its KV must hold
    prompt: int = 1024
    output: int = 256
    batch: int = 1  # sequences decoding together
    link: LinkSpec | None = None  # None: the hardware's own interconnect
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION
    mfu: float = 1.0  # achievable share of peak FLOP/s assumed for compute time
    mbu: float = 1.0  # achievable share of memory bandwidth assumed for memory time
    compute_dtype: str | None = None  # None: the weight format's (fp8 -> W8A8 fp8)
    # --measure: the layers' linears are tuili's packed modules, their values shared among these
    # formats (PACKED_FORMATS, shares summing to 1); empty: float linears
    packed_formats: dict[str, float] = field(default_factory=dict)
    # --measure: the packed format of the output matrix's copy that decode logits read (a GGUF
    # file's), charged at that kernel's rate; "": a float output matrix
    head_format: str = ""
    # The dtype of the DeltaNet conv state (the working dtype, whatever the KV cache's; the
    # recurrent state is float32 always): bf16 for a plan, the engine's own under --measure.
    conv_state_dtype: str = "bf16"
    # Speculative decoding (tuili/perf/speculation.py): each decode step verifies k proposals.
    speculation: Speculation | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "gpus", "context", "prompt", "output", "batch"):  # --gpus defaults to tp x pp
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TuiliError(f"--{name} {value!r} is invalid: expected an integer >= 1")
        if self.gpus % (self.tp * self.pp):
            raise TuiliError(f"--gpus {self.gpus} is not a multiple of --tp {self.tp} x --pp {self.pp}")
        if not 0 <= self.reserve_fraction < 1:
            raise TuiliError(f"--reserve {self.reserve_fraction!r} is invalid: expected a fraction in [0, 1)")
        for name in ("mfu", "mbu"):
            if not 0 < getattr(self, name) <= 1:
                raise TuiliError(f"--{name} {getattr(self, name)!r} is invalid: expected a fraction in (0, 1]")
        dtype_bytes(self.kv_dtype)
        dtype_bytes(self.conv_state_dtype)
        for fmt, share in self.packed_formats.items():
            if fmt not in PACKED_FORMATS or not 0 < share <= 1:
                raise TuiliError(f"packed format {fmt!r} with share {share!r}: expected formats among "
                                 f"{', '.join(PACKED_FORMATS)}, each a share in (0, 1]")
        if self.head_format and self.head_format not in PACKED_FORMATS:
            raise TuiliError(f"head format {self.head_format!r}: expected one of {', '.join(PACKED_FORMATS)}")
        if self.speculation is not None and (self.tp > 1 or self.pp > 1):
            raise TuiliError(f"--speculative-config with --tp {self.tp} --pp {self.pp} is not modelled: the plan "
                             f"counts speculation on one device per replica (--tp 1 --pp 1)")

    @property
    def packed_linears(self) -> bool:
        return bool(self.packed_formats)


def _format_seconds(by_format: dict[str, float], fmt: str) -> float:
    """The spec's measured seconds per value for packed format ``fmt``; for a format it has no
    figure for, the mean of those it has (a spec saved before the formats were told apart holds
    "int4+zeros" alone); 0 where it has none."""
    if fmt in by_format or not by_format:
        return by_format.get(fmt, 0.0)
    return sum(by_format.values()) / len(by_format)


# A hybrid model's prefix cache (tuili/engine/pool.py, state_checkpoint_count): state checkpoints
# take at most this share of the KV budget, and no more than one per interval of the KV tokens it
# would hold, at the engine's default block size (16) and checkpoint interval (4 blocks).
CHECKPOINT_SHARE = 0.25
CHECKPOINT_INTERVAL_TOKENS = 16 * 4


def state_checkpoint_bytes(budget: float, kv_bytes_per_token: float, state_bytes: float) -> float:
    """Bytes a hybrid model's prefix cache reserves for state checkpoints out of a KV budget of
    `budget` bytes, as the engine's pool plan reserves them; 0 without linear-attention state."""
    if state_bytes <= 0 or budget <= 0:
        return 0
    count = min(int(budget * CHECKPOINT_SHARE) // state_bytes,
                math.ceil(budget / (kv_bytes_per_token * CHECKPOINT_INTERVAL_TOKENS)))  # fmt: skip
    return count * state_bytes


def max_concurrent_requests(
    memory_bytes: float, weight_bytes: float, request_bytes: float, reserve_bytes: float = 0,
) -> int:
    """Requests whose KV and state fit beside the weights: floor((memory - reserve - weights) / request)."""
    free = memory_bytes - reserve_bytes - weight_bytes
    return max(0, math.floor(free / request_bytes)) if request_bytes > 0 else 0


def compute_bound_batch(
    peak_flops: float, bandwidth: float, flops_per_token: float, weight_bytes: float, bytes_per_sequence: float = 0,
) -> float | None:
    """Batch at which a decode step's compute time reaches its memory time:
    B x F / peak = (W + B x s) / bandwidth  =>  B = (W / bandwidth) / (F / peak - s / bandwidth).
    None when per-sequence bytes grow as fast as compute, so decode never becomes compute-bound."""
    slope = flops_per_token / peak_flops - bytes_per_sequence / bandwidth
    return (weight_bytes / bandwidth) / slope if slope > 0 else None


def allreduce_seconds(message_bytes: float, devices: int, over: LinkSpec) -> float:
    """Ring all-reduce: 2 (n-1) steps, each moving message/n bytes one hop."""
    if devices == 1:
        return 0.0
    steps = 2 * (devices - 1)
    return steps * (over.latency + message_bytes / devices / over.bandwidth)


@dataclass(frozen=True)
class StepCost:
    flops: float  # all devices together
    bytes: float  # per device
    seconds: float  # roofline + kernels + dequantization + overhead + communication
    roofline: float = 0.0  # max(compute time, memory time); packed linears' own added
    overhead: float = 0.0  # the engine's fixed host cost for the step
    dequant: float = 0.0  # packed weights converted into tiles for a many-row matmul
    kernels: float = 0.0  # how far the engine's measured linears keep the step above its roofline


@dataclass(frozen=True)
class SpeculativeStepCost:
    """A speculating decode step: the proposer's forwards, then the target's verification of
    every sequence's proposals; it yields ``tokens_per_sequence`` tokens per sequence on average."""

    verify: StepCost
    proposer: tuple[StepCost, ...]  # one per proposer forward (none for prompt lookup)
    tokens_per_sequence: float

    @property
    def seconds(self) -> float:
        return self.verify.seconds + sum(p.seconds for p in self.proposer)

    @property
    def flops(self) -> float:
        return self.verify.flops + sum(p.flops for p in self.proposer)

    @property
    def bytes(self) -> float:
        return self.verify.bytes + sum(p.bytes for p in self.proposer)


class Roofline:
    """Step times of one model on one hardware spec and parallel layout: each step takes the
    larger of its compute time and its memory time, plus the dequantization of packed weights it
    needs, plus the engine's fixed host cost, plus its tensor-parallel communication."""

    def __init__(self, cost: ModelCost, hardware: HardwareSpec, inputs: PlanInputs) -> None:
        self.cost, self.hardware, self.inputs = cost, hardware, inputs
        self.tp = tp = inputs.tp
        storage = inputs.weights
        self.compute_dtype = inputs.compute_dtype or (
            storage.compute_dtype if isinstance(storage, WeightFormat) else ACTIVATION_DTYPE
        )
        self.peak = hardware.flops(self.compute_dtype) * inputs.mfu  # per device
        self.bandwidth = hardware.memory_bandwidth * inputs.mbu
        self.link = inputs.link or (link(hardware.interconnect) if hardware.interconnect else None)
        if tp > 1 and self.link is None:
            raise TuiliError(f"--tp {tp} needs a link between devices: {hardware.name} names none, give --link")
        self.kv_token_device = cost.kv_bytes_per_token(inputs.kv_dtype, tp)
        self.state_device = cost.state_bytes_per_sequence(conv_dtype=inputs.conv_state_dtype, tp=tp)
        self.hidden_bytes = cost.shape.hidden_size * dtype_bytes(ACTIVATION_DTYPE)
        # an all-reduce after attention and after the MLP of every layer, and one for the embedding
        self.allreduces = 2 * cost.shape.num_layers + 1
        # tuili's own linears as probed here (none for presets): their weight streaming rate at
        # one row and their FLOP/s at prompt sizes (linear_flops), each capped by the hardware's figure
        self.stream = min(hardware.linear_stream_bandwidth.get(self.compute_dtype, math.inf), self.bandwidth)
        # ... and a decode's attention reads its cache at its own measured rate (capped the same way)
        self.kv_stream = min(hardware.decode_attention_bandwidth.get(inputs.kv_dtype, math.inf), self.bandwidth)
        self._packed: dict[Step, PackedWork | None] = {}
        self._proposer: Roofline | None = None
        spec = inputs.speculation
        if spec is not None and spec.proposer is not None:
            assert spec.proposer_weights is not None
            # A draft's KV pool is in the working dtype; MTP's sits beside the target's, in its dtype.
            kv_dtype = inputs.kv_dtype if spec.head_shared else inputs.conv_state_dtype
            self._proposer = Roofline(spec.proposer, hardware, replace(
                inputs, weights=spec.proposer_weights, kv_dtype=kv_dtype, speculation=None,
                packed_formats=spec.proposer_formats, head_format=inputs.head_format if spec.head_shared else "",
            ))  # fmt: skip
        if inputs.packed_linears:
            by_kind = cost.weight_bytes_by_kind(inputs.weights)
            self.packed_bytes = sum(by_kind[kind] for kind in PACKED_KINDS) / tp
        if inputs.head_format:
            shape = cost.shape
            self.head_values = shape.vocab_size * shape.hidden_size / tp
            self.head_bytes = cost.weight_bytes_by_kind(inputs.weights)[
                "embedding" if shape.tie_word_embeddings else "lm_head"] / tp

    def overhead(self, step: Step) -> float:
        """The engine's fixed host cost for ``step`` on this hardware (every device of a
        tensor-parallel group runs the whole step's ops for its shard)."""
        step = replace(step, packed=self.inputs.packed_linears)
        return host_seconds(self.cost.shape, step, self.hardware.host_overhead_seconds)

    def elementwise(self, tokens: int) -> float:
        """Seconds per device of the elementwise work of ``tokens`` tokens through every layer, at
        the spec's measured seconds per value (elementwise_seconds_per_value): each layer's two
        RMSNorms (and the final one) over the hidden size, an attention layer's rotation of its q
        and k heads (with Qwen3's per-head norms where the model has them), a dense MLP's SiLU
        over the intermediate size. A MoE layer's experts and a DeltaNet layer's gates run in
        kernels of their own and are not counted. 0 where nothing was measured."""
        rates = self.hardware.elementwise_seconds_per_value.get(self.compute_dtype)
        if not rates:
            return 0.0
        shape = self.cost.shape
        rope = "qk_rope" if shape.traits.qk_norm else "rope"
        per_token = (
            (2 * shape.num_layers + 1) * shape.hidden_size * rates.get("norm", 0.0)
            + shape.attention_layers * (shape.num_heads + shape.num_kv_heads) * shape.head_dim * rates.get(rope, 0.0)
            / self.tp
            + sum(not moe for moe in shape.moe_layers) * shape.intermediate_size * rates.get("silu", 0.0) / self.tp
        )
        return tokens * per_token

    def _packed_work(self, step: Step) -> PackedWork | None:
        step = replace(step, packed=self.inputs.packed_linears)
        if step not in self._packed:  # a plan asks for a few step shapes, many times
            # a probe that found many rows running the weight-only kernel gave its rate there
            hw = self.hardware
            many = bool(hw.packed_rows_seconds_per_value) or any(
                max(curve) > PACKED_OP_MAX_ROWS for curve in hw.packed_call_seconds_by_rows.values())
            self._packed[step] = packed_work(self.cost.shape, step, many)
        return self._packed[step]

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.tp / self.peak, nbytes / self.bandwidth)

    def linear_flops(self, rows: int) -> float:
        """FLOP/s of the engine's linears at products of ``rows`` rows, as probed (capped by the
        peak; the peak where nothing was measured)."""
        measured = self.hardware.linear_flops(self.compute_dtype, rows)
        return self.peak if measured is None else min(measured, self.peak)

    def attention_flops(self, tokens: int) -> float:
        """FLOP/s of the engine's causal attention over a ``tokens``-token prompt, as probed
        (capped by the peak); the linears' rate at that many rows where nothing was measured."""
        measured = self.hardware.attention_flops(self.compute_dtype, tokens)
        return self.linear_flops(tokens) if measured is None else min(measured, self.peak)

    def deltanet_flops(self, rows: int) -> float:
        """FLOP/s of the engine's Gated DeltaNet prompt kernel, as probed (capped by the peak);
        the linears' rate at that many rows where nothing was measured."""
        measured = self.hardware.deltanet_flops(self.compute_dtype)
        return self.linear_flops(rows) if measured is None else min(measured, self.peak)

    def _engine_floor(
        self, flops: float, nbytes: float, weight_bytes: float, rows: int, attention: float, state: float,
    ) -> float:  # fmt: skip
        """The step's time at the measured rates of the engine's own kernels: the weights at their
        linears' streaming rate (the rest of the bytes at the hardware's), the ``attention`` FLOPs
        of a prompt at the attention's rate, the ``state`` FLOPs (a hybrid's DeltaNet rule) at
        its kernel's, and the other FLOPs at the linears' rate for products of the step's
        ``rows``. Equal to the roofline where the probe measured nothing."""
        # The roofline's memory time plus the weights' extra time at the slower rate: exactly the
        # roofline (no rounding left over) where the rates equal the hardware's.
        memory = nbytes / self.bandwidth + weight_bytes * (1 / self.stream - 1 / self.bandwidth)
        linear_rate = self.linear_flops(rows)
        attention_rate = self.attention_flops(rows) if attention else linear_rate
        state_rate = self.deltanet_flops(rows) if state else linear_rate
        if attention_rate == linear_rate == state_rate:
            compute = flops / linear_rate
        else:
            compute = (flops - attention - state) / linear_rate + attention / attention_rate + state / state_rate
        return max(compute / self.tp, memory)

    def _step(
        self, flops: float, nbytes: float, weight_bytes: float, step: Step, comm: float, attention: float = 0.0,
        state: float = 0.0, cache_bytes: float = 0.0,
    ) -> StepCost:  # fmt: skip
        """``cache_bytes``: the KV cache a decode's attention reads, charged at its own measured
        rate (kv_stream); the logits of a packed output head at its kernel's."""
        overhead = self.overhead(step)
        packed = self._packed_work(step)
        # A decode's attention and a packed output head are kernels of their own: their time
        # beyond their bytes at the memory's rate (the cache read at the attention's measured
        # rate, the logits at the head's kernel's) adds to the step's; so does the elementwise
        # work between the matmuls (norms, rotary, SiLU), at its measured rate.
        extra = cache_bytes * (1 / self.kv_stream - 1 / self.bandwidth)
        extra += self._head_extra(1 if step.prefill else step.tokens)
        extra += self.elementwise(step.tokens)
        if packed is None:
            roofline = self._roofline(flops, nbytes)
            floor = self._engine_floor(flops, nbytes, weight_bytes, step.tokens, attention, state)
            kernels = max(0.0, floor - roofline) + extra  # kernels of their own, after the rest
            return StepCost(flops, nbytes, roofline + kernels + overhead + comm, roofline, overhead, kernels=kernels)
        # The packed linears run in kernels of their own, after one another and the rest: the
        # rest's roofline plus theirs, where unpacking the codes is a third ceiling.
        hw = self.hardware
        packed_flops = 2 * step.tokens * packed.values
        kernel = packed.values * sum(self.call_seconds(rows, self.inputs.packed_formats) for rows in packed.calls)
        roofline = self._roofline(flops - packed_flops, nbytes - self.packed_bytes) + max(
            self._roofline(packed_flops, self.packed_bytes), kernel
        )
        dequant = packed.dequantized * self.packed_seconds(hw.packed_dequant_seconds_per_value)
        # Below the peak, at the engine's measured rates: a prompt's attention at its own, and the
        # dequantized tiles of a many-row step through the same matmuls as dense linears (§4.2).
        kernels = extra + self._below_peak(attention, self.attention_flops(step.tokens))
        kernels += self._below_peak(state, self.deltanet_flops(step.tokens))
        if packed.dequantized:
            kernels += self._below_peak(packed_flops, self.linear_flops(step.tokens))
        return StepCost(
            flops, nbytes, roofline + dequant + kernels + overhead + comm, roofline, overhead, dequant, kernels
        )

    def packed_seconds(self, by_format: dict[str, float]) -> float:
        """Seconds per packed value (and row) of the layers' packed formats at the spec's measured
        ``by_format``, weighted by the formats' shares of the values."""
        return sum(share * _format_seconds(by_format, fmt) for fmt, share in self.inputs.packed_formats.items())

    def call_seconds(self, rows: int, shares: dict[str, float]) -> float:
        """Seconds per packed value of one weight-only kernel call of ``rows`` rows, the formats
        weighted by ``shares``: on the spec's measured curve (packed_call_seconds_by_rows), where a
        format without one takes the mean of those measured; without curves (specs saved before
        them), rows x the kernel's time per value and row, at one row or at many."""
        hw = self.hardware
        if hw.packed_call_seconds_by_rows:
            def seconds(fmt: str) -> float:
                measured = hw.packed_call_seconds(fmt, rows)
                if measured is not None:
                    return measured
                curves = [hw.packed_call_seconds(f, rows) or 0.0 for f in hw.packed_call_seconds_by_rows]
                return sum(curves) / len(curves)
        else:
            by_row = hw.packed_rows_seconds_per_value if rows > PACKED_OP_MAX_ROWS else hw.packed_kernel_seconds_per_value

            def seconds(fmt: str) -> float:
                return rows * _format_seconds(by_row, fmt)
        return sum(share * seconds(fmt) for fmt, share in shares.items())

    def _head_extra(self, rows: int) -> float:
        """What the output matrix's packed copy takes beyond its bytes at the memory's rate, for
        ``rows`` rows of logits (a decode step's sequences; a prompt's last token), in the calls
        of up to PACKED_CALL_MAX_ROWS rows the packed module makes."""
        if not self.inputs.head_format:
            return 0.0
        share = {self.inputs.head_format: 1.0}
        kernel = self.head_values * sum(self.call_seconds(calls, share) for calls in kernel_calls(rows))
        return max(0.0, kernel - self.head_bytes / self.bandwidth)

    def _below_peak(self, flops: float, rate: float) -> float:
        """Seconds per device that ``flops`` take at ``rate`` beyond their time at the peak."""
        return max(0.0, flops / rate - flops / self.peak) / self.tp

    def prefill(self, start: int, length: int) -> StepCost:
        """One request's prefill chunk alone (its KV written once, the weights read once). Its ops
        are counted as a chunk from position 0's: a later chunk attends through the cache, which
        differs by a few views per layer."""
        cost, tp = self.cost, self.tp
        flops = cost.prefill_flops(start, length)
        weights = cost.decode_weight_bytes(self.inputs.weights, length, tp)
        nbytes = weights + self.kv_token_device * length
        comm = self.prefill_comm(length)
        attention = cost.prefill_attention_flops(start, length)
        state = cost.prefill_state_flops(length)
        return self._step(flops, nbytes, weights, Step(prefill=True, tokens=length), comm, attention, state)

    def sequence_bytes(self, context: int) -> float:
        """Per device, one decoding sequence's KV reads plus its state read and written back."""
        return self.cache_bytes(context) + self.state_round_trip

    @property
    def state_round_trip(self) -> float:
        """Per device, one decoding sequence's linear-attention state read and written back."""
        return 2 * self.state_device

    def cache_bytes(self, context: int) -> float:
        """Per device, the KV cache one decoding sequence's attention reads."""
        return self.kv_token_device * self.cost.kv_tokens_read(context)

    def decode(self, context_lens: list[int]) -> StepCost:
        """One decode step over sequences at these context lengths (new token included)."""
        batch = len(context_lens)
        flops = self.cost.decode_flops(context_lens)
        weights = self.cost.decode_weight_bytes(self.inputs.weights, batch, self.tp)
        cache = sum(self.cache_bytes(c) for c in context_lens)
        nbytes = weights + cache + batch * self.state_round_trip  # sequence_bytes, the cache summed once
        return self._step(flops, nbytes, weights, Step(prefill=False, tokens=batch), self.comm(batch), cache_bytes=cache)

    def decode_uniform(self, context: int, batch: int) -> StepCost:
        """decode([context] * batch), in constant time."""
        flops = batch * self.cost.flops_per_token(context)
        weights = self.cost.decode_weight_bytes(self.inputs.weights, batch, self.tp)
        nbytes = weights + batch * self.sequence_bytes(context)
        return self._step(flops, nbytes, weights, Step(prefill=False, tokens=batch), self.comm(batch),
                          cache_bytes=batch * self.cache_bytes(context))

    def verify(self, chunks: Sequence[tuple[int, int]]) -> StepCost:
        """One step verifying each sequence's chunk of (tokens cached, positions): its last token
        and its proposals. As the live meter counts it (tuili/perf/meter.py): the weights once for
        the step's rows (a mixture of experts reads the experts its rows were routed to), each
        sequence's KV once at the chunk's end and its state read and written back, and every
        position's FLOPs at its own context, logits included."""
        rows = sum(length for _, length in chunks)
        flops = sum(self.cost.decode_flops(range(start + 1, start + length + 1)) for start, length in chunks)
        weights = self.cost.decode_weight_bytes(self.inputs.weights, rows, self.tp)
        cache = sum(self.cache_bytes(start + length) for start, length in chunks)
        nbytes = weights + cache + len(chunks) * self.state_round_trip  # sequence_bytes, the cache summed once
        return self._step(flops, nbytes, weights, Step(prefill=False, tokens=rows), self.comm(rows), cache_bytes=cache)

    def verify_uniform(self, context: int, batch: int, k: int) -> StepCost:
        """verify([(context - 1, k + 1)] * batch): ``batch`` sequences at ``context`` (their last
        token included) each verifying k proposals, in constant time."""
        rows = batch * (k + 1)
        flops = batch * sum(self.cost.flops_per_token(context + j) for j in range(k + 1))
        weights = self.cost.decode_weight_bytes(self.inputs.weights, rows, self.tp)
        nbytes = weights + batch * self.sequence_bytes(context + k)
        return self._step(flops, nbytes, weights, Step(prefill=False, tokens=rows), self.comm(rows),
                          cache_bytes=batch * self.cache_bytes(context + k))

    def proposer(self) -> Roofline | None:
        """The proposer's own roofline (a draft model, or the MTP block with the shared head),
        on the same hardware; None without one (prompt lookup, or no speculation)."""
        return self._proposer

    def speculative_step(
        self, decode_context_lens: Sequence[int], verify_chunks: Sequence[tuple[int, int]], draft_forwards: int,
    ) -> SpeculativeStepCost:  # fmt: skip
        """A step as a speculating engine scheduled it: its plain decodes (sequences without
        proposals this step) and verification chunks in one forward, after ``draft_forwards``
        proposer forwards over the sequences that drafted, forward j at context start + 1 + j.
        Its tokens_per_sequence is not an expectation: 0 (the record says what was kept)."""
        chunks = [(c - 1, 1) for c in decode_context_lens] + list(verify_chunks)
        proposer = self.proposer()
        forwards = () if proposer is None or not verify_chunks else tuple(
            proposer.decode([start + 1 + j for start, _ in verify_chunks]) for j in range(draft_forwards)
        )  # fmt: skip
        return SpeculativeStepCost(self.verify(chunks), forwards, 0.0)

    def speculative(self, context: int, batch: int) -> SpeculativeStepCost:
        """A decode step of ``batch`` sequences at ``context`` with speculation: k proposer
        forwards at contexts context .. context + k - 1 (none for prompt lookup), then the
        verification of k proposals each."""
        spec = self.inputs.speculation
        assert spec is not None, "speculative() plans a speculating engine"
        proposer = self.proposer()
        forwards = () if proposer is None else tuple(proposer.decode_uniform(context + j, batch) for j in range(spec.k))
        return SpeculativeStepCost(self.verify_uniform(context, batch, spec.k), forwards, spec.tokens_per_step)

    def comm(self, batch: int) -> float:
        """Seconds of tensor-parallel communication in one decode step."""
        if self.tp == 1:
            return 0.0
        assert self.link is not None
        return self.allreduces * allreduce_seconds(batch * self.hidden_bytes, self.tp, self.link) + self.gather(batch)

    def gather(self, rows: int) -> float:
        """Seconds to gather ``rows`` rows of the vocabulary-parallel lm_head's logits on one device."""
        if self.tp == 1:
            return 0.0
        assert self.link is not None
        tp, over = self.tp, self.link
        return (tp - 1) * over.latency + (tp - 1) / tp * self._logits_bytes(rows) / over.bandwidth

    def prefill_comm(self, length: int) -> float:
        """Seconds of tensor-parallel all-reduces in a ``length``-token prefill (its few sampled
        rows' logits gather is not counted: `gather`)."""
        if self.tp == 1:
            return 0.0
        assert self.link is not None
        return self.allreduces * allreduce_seconds(length * self.hidden_bytes, self.tp, self.link)

    def comm_bytes(self, batch: int) -> float:
        """Bytes one device sends in one decode step: 2 (n-1)/n of each all-reduced message
        (a ring), plus its share of the gathered logits."""
        if self.tp == 1:
            return 0.0
        tp = self.tp
        return 2 * (tp - 1) / tp * self.allreduces * batch * self.hidden_bytes + (tp - 1) / tp * self._logits_bytes(batch)

    def stage_transfer_bytes(self, batch: int, tokens: int | None = None) -> float:
        """Bytes a pipeline-parallel step sends between stages: each of the pp - 1 hops carries
        the residual stream (two hidden vectors per token; ``tokens`` defaults to ``batch``, a
        decode step), and the last stage sends the ``batch`` sampled rows' float32 logits back to
        the first (0 without a pipeline)."""
        pp = self.inputs.pp
        if pp == 1:
            return 0.0
        tokens = batch if tokens is None else tokens
        return (pp - 1) * tokens * 2 * self.hidden_bytes + batch * self.cost.shape.vocab_size * 4

    def stage_transfer(self, batch: int, tokens: int | None = None) -> float | None:
        """Seconds of those transfers over the link, one after another: a latency per hop and
        micro-batch, the engine cutting a step of ``tokens`` tokens into micro-batches of at least
        PIPELINE_MICRO_BATCH_TOKENS, at most pp of them (a decode step of fewer than twice that
        many sequences is one); None without a link."""
        pp = self.inputs.pp
        if pp == 1:
            return 0.0
        if self.link is None:
            return None
        tokens = batch if tokens is None else tokens
        micro_batches = max(1, min(pp, tokens // PIPELINE_MICRO_BATCH_TOKENS))
        messages = micro_batches * pp  # pp - 1 hops forward and one back, per micro-batch
        return messages * self.link.latency + self.stage_transfer_bytes(batch, tokens) / self.link.bandwidth

    def _logits_bytes(self, batch: int) -> float:
        return batch * self.cost.shape.vocab_size * dtype_bytes(ACTIVATION_DTYPE)


def _stage_shares(cost: ModelCost, pp: int) -> tuple[list[float], list[float]]:
    """Each pipeline stage's share of the KV (attention layers) and of the linear-attention
    state (linear layers), as the engine splits the layers."""
    if pp == 1:
        return [1.0], [1.0]
    attention, linear = zip(*cost.stage_layer_kinds(pp), strict=True)

    def shares(counts: tuple[int, ...]) -> list[float]:
        total = sum(counts)
        return [c / total if total else 0.0 for c in counts]

    return shares(attention), shares(linear)


def make_plan(cost: ModelCost, hardware: HardwareSpec, inputs: PlanInputs) -> dict[str, object]:
    """One flat dict of SI figures (bytes, seconds, FLOPs, FLOP/s); raise TuiliError if nothing fits."""
    tp, storage, batch = inputs.tp, inputs.weights, inputs.batch
    roof = Roofline(cost, hardware, inputs)

    # ---- memory -----------------------------------------------------------------------------
    # Under pipeline parallelism each stage holds its layers (and their KV and state); the
    # fullest stage bounds the weights per device, the tightest one the requests.
    pp = inputs.pp
    stage_weights = cost.weight_bytes_per_stage(storage, pp, tp) if pp > 1 else [cost.weight_bytes_per_device(storage, tp)]
    kv_shares, state_shares = _stage_shares(cost, pp)
    weights_device = max(stage_weights)
    kv_token = cost.kv_bytes_per_token(inputs.kv_dtype)
    state = cost.state_bytes_per_sequence(conv_dtype=inputs.conv_state_dtype)
    reserve = inputs.reserve_fraction * hardware.memory_bytes
    if weights_device > hardware.memory_bytes - reserve:
        raise TuiliError(
            f"cannot fit: the weights need {weights_device / 1e9:.1f} GB per device but {hardware.name} "
            f"has {hardware.memory_bytes / 1e9:.1f} GB, {reserve / 1e9:.1f} GB of it reserved for "
            f"activations and runtime; use more devices (--tp), fewer bits (--weights), or bigger hardware"
        )
    spec = inputs.speculation
    proposer_weights = spec.proposer_held_bytes() if spec is not None else 0
    if spec is not None and weights_device + proposer_weights > hardware.memory_bytes - reserve:
        raise TuiliError(
            f"cannot fit: the weights and the speculative proposer's need "
            f"{(weights_device + proposer_weights) / 1e9:.1f} GB per device but {hardware.name} has "
            f"{hardware.memory_bytes / 1e9:.1f} GB, {reserve / 1e9:.1f} GB of it reserved; use a smaller draft, "
            f"fewer bits (--weights), or bigger hardware"
        )
    # A hybrid target keeps the state after each proposed position: k more rows per state slot.
    state_rows = 1 + (spec.k if spec is not None and roof.state_device else 0)
    proposer_request = (spec.proposer_bytes_per_request(inputs.context, inputs.kv_dtype, inputs.conv_state_dtype)
                        if spec is not None else 0.0)  # fmt: skip
    per_stage = []  # (requests that fit, request bytes, checkpoint bytes, engine KV budget) of each stage's devices
    for weights, kv_share, state_share in zip(stage_weights, kv_shares, state_shares, strict=True):
        kv_device, state_device = roof.kv_token_device * kv_share, roof.state_device * state_share
        request = kv_device * inputs.context + state_device * state_rows
        budget = hardware.memory_bytes - reserve - weights - proposer_weights
        # The engine's kv_cache_memory is its target pool's (slots, checkpoints, blocks); the
        # proposer's KV and state come beside it, per block and per sequence. The budget is
        # split in proportion to what a request takes on each side.
        target_budget = math.floor(budget * request / (request + proposer_request)) if proposer_request else budget
        checkpoints = state_checkpoint_bytes(target_budget, kv_device, state_device)
        fits = max_concurrent_requests(target_budget, checkpoints, request)
        if proposer_request:
            fits = min(fits, max_concurrent_requests(budget - target_budget, 0, proposer_request))
        per_stage.append((fits, request, checkpoints, target_budget))
    per_replica, request_device, checkpoints_device, target_budget = min(per_stage)
    if per_replica == 0:
        raise TuiliError(
            f"cannot fit one request of {inputs.context} tokens: it needs {request_device / 1e9:.2f} GB "
            f"per device beside {weights_device / 1e9:.1f} GB of weights on {hardware.memory_bytes / 1e9:.1f} GB "
            f"({reserve / 1e9:.1f} GB reserved); shorten --context, use --kv fp8, or more devices"
        )

    # ---- time -------------------------------------------------------------------------------
    prefill = roof.prefill(0, inputs.prompt)
    step = roof.decode_uniform(inputs.context, batch)
    # the prefill yields the first token; each later one is a decode step at a context one longer
    e2e = prefill.seconds + sum(roof.decode_uniform(inputs.prompt + j, batch).seconds for j in range(1, inputs.output))
    # MoE: at the crossover batch every expert is read, so take the weights a large batch reads.
    crossover = compute_bound_batch(
        roof.peak * tp, roof.bandwidth * tp, cost.flops_per_token(inputs.context),
        cost.decode_weight_bytes(storage, max(batch, 4096), tp) * tp, roof.sequence_bytes(inputs.context) * tp,
    )
    kv_transfer_bytes = kv_token * inputs.prompt + state
    over = roof.link
    speculative = _speculative_figures(roof, inputs, per_replica, proposer_weights, proposer_request)

    return {
        "model_type": cost.shape.model_type,
        "params_total": cost.params_total,
        "params_matmul": cost.params_matmul,
        "params_active": cost.params_active,
        "weights_format": storage.source if isinstance(storage, CheckpointBytes) else storage.name,
        "weights_bytes": cost.weight_bytes(storage),
        "weights_bytes_per_device": weights_device,
        "kv_dtype": inputs.kv_dtype,
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_request": kv_token * inputs.context,
        "state_bytes_per_request": state,
        "state_checkpoint_bytes_per_device": checkpoints_device,
        "hardware": hardware.name,
        "hardware_origin": hardware.origin,
        "hardware_source": hardware.source,
        "gpus": inputs.gpus,
        "tp": tp,
        "pp": pp,
        "weights_bytes_per_stage": stage_weights,
        "replicas": inputs.gpus // (tp * pp),
        "memory_bytes_per_device": hardware.memory_bytes,
        "reserve_fraction": inputs.reserve_fraction,
        "reserve_bytes_per_device": reserve,
        "max_concurrent_requests": inputs.gpus // (tp * pp) * per_replica,
        "compute_dtype": hardware.dtype_used(roof.compute_dtype),
        "peak_flops_per_device": hardware.flops(roof.compute_dtype),
        "memory_bandwidth_per_device": hardware.memory_bandwidth,
        "assumed_mfu": inputs.mfu,
        "assumed_mbu": inputs.mbu,
        "prompt_tokens": inputs.prompt,
        "output_tokens": inputs.output,
        "context_tokens": inputs.context,
        "batch": batch,
        "prefill_flops": prefill.flops,
        "prefill_seconds": prefill.seconds,
        "prefill_roofline_seconds": prefill.roofline,
        "prefill_overhead_seconds": prefill.overhead,
        "prefill_dequant_seconds": prefill.dequant,
        "prefill_kernels_seconds": prefill.kernels,
        "decode_step_flops": step.flops,
        "decode_step_bytes": step.bytes,
        "decode_step_seconds": step.seconds,
        "decode_step_roofline_seconds": step.roofline,
        "decode_step_overhead_seconds": step.overhead,
        "decode_step_dequant_seconds": step.dequant,
        "decode_step_kernels_seconds": step.kernels,
        **{f"host_overhead_seconds_{key}": hardware.host_overhead_seconds.get(key, 0.0) for key in HOST_KEYS},
        "compute_bound_batch": crossover,
        "decode_tokens_per_second": batch / step.seconds,
        "ttft_seconds": prefill.seconds,
        "e2e_seconds": e2e,
        "e2e_overhead_seconds": prefill.overhead + (inputs.output - 1) * step.overhead,
        "link": over.name if over else None,
        "allreduce_bytes_per_step": roof.comm_bytes(batch),
        "allreduce_seconds_per_step": roof.comm(batch),
        "stage_transfer_bytes_per_step": roof.stage_transfer_bytes(batch),
        "stage_transfer_seconds_per_step": roof.stage_transfer(batch),
        "kv_transfer_bytes": kv_transfer_bytes,
        "kv_transfer_seconds": kv_transfer_bytes / over.bandwidth + over.latency if over else None,
        "kv_cache_memory_bytes": math.floor(target_budget),
        **speculative,
    }


# Batch sizes the speculative table compares at (those the capacity allows, and --batch).
SPECULATIVE_TABLE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _speculative_figures(
    roof: Roofline, inputs: PlanInputs, capacity: int, proposer_weights: int, proposer_request: float,
) -> dict[str, object]:  # fmt: skip
    """The plan's speculative decoding keys: the step at --batch, and the decode tokens/s with and
    without speculation at each batch size of the table (docs/ruler.md, §4.4)."""
    spec = inputs.speculation
    if spec is None:
        return {"speculative_method": None}
    context, batch = inputs.context, inputs.batch
    step = roof.speculative(context, batch)
    rows = []
    for b in sorted({b for b in SPECULATIVE_TABLE_BATCHES if b <= capacity} | {batch}):
        plain, spec_step = roof.decode_uniform(context, b).seconds, roof.speculative(context, b).seconds
        rows.append({
            "batch": b,
            "step_seconds": plain,
            "speculative_step_seconds": spec_step,
            "tokens_per_second": b / plain,
            "speculative_tokens_per_second": b * spec.tokens_per_step / spec_step,
            "speedup": spec.tokens_per_step * plain / spec_step,
        })  # fmt: skip
    plain = roof.decode_uniform(context, batch).seconds
    # The output after the prefill's first token, in steps of E tokens per sequence on average
    # (the last one partly used), each at the context it has reached.
    tokens, steps = spec.tokens_per_step, (inputs.output - 1) / spec.tokens_per_step
    whole = math.ceil(steps)
    decode = sum(roof.speculative(inputs.prompt + 1 + math.floor(j * tokens), batch).seconds for j in range(whole))
    return {
        "speculative_method": spec.config.method,
        "num_speculative_tokens": spec.k,
        "spec_acceptance": spec.acceptance,
        "spec_tokens_per_step": spec.tokens_per_step,
        "proposer_weights_bytes": proposer_weights,
        "proposer_bytes_per_request": proposer_request,
        "proposer_kv_bytes_per_device": proposer_request * capacity,
        "spec_verify_step_flops": step.verify.flops,
        "spec_verify_step_bytes": step.verify.bytes,
        "spec_verify_step_seconds": step.verify.seconds,
        "spec_proposer_flops": sum(p.flops for p in step.proposer),
        "spec_proposer_bytes": sum(p.bytes for p in step.proposer),
        "spec_proposer_seconds": sum(p.seconds for p in step.proposer),
        "spec_decode_step_seconds": step.seconds,
        "spec_decode_tokens_per_second": batch * step.tokens_per_sequence / step.seconds,
        "spec_speedup": step.tokens_per_sequence * plain / step.seconds,
        "spec_e2e_seconds": roof.prefill(0, inputs.prompt).seconds + (decode * steps / whole if whole else 0.0),
        "spec_by_batch": rows,
    }
