"""`tuili plan --measure`: run the engine on this machine for the planned shape and set the plan's
predictions against what happened, with the error of each.

Two runs, both with random prompt tokens (so the prefix cache never hits):
  1. one request alone, ``prompt`` tokens, one output token, TTFT_RUNS times: the median time to
     first token against the plan's TTFT, and the prefill MFU over the runs;
  2. ``batch`` requests together, ``prompt`` + ``output`` tokens each: every step is timed and
     fed to a UtilizationMeter; each pure decode step is set against the roofline's prediction for
     the same context lengths, and the decode MBU against the predicted one.
The plan is made for what the engine really holds, whatever --weights says: the bytes of its
weight tensors by kind (float, or quantized codes and scales), its KV cache in its working dtype,
and the compute dtype of its matmuls. Each time is predicted with the host overhead
(tuili/perf/overhead.py) and, beside it, from the roofline alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from tuili.errors import TuiliError
from tuili.perf.checkpoint import ModelSource
from tuili.perf.cost import CheckpointBytes, ModelCost
from tuili.perf.formats import canonical_dtype, weight_format
from tuili.perf.hardware import (
    CURVES,
    ENGINE_PREFILL_ROWS,
    PACKED_FIELDS,
    PER_DTYPE,
    SECONDS_TABLES,
    HardwareSpec,
    link,
)
from tuili.perf.harness import StepLog, build_engine
from tuili.perf.meter import UtilizationMeter
from tuili.perf.plan import PlanInputs, Roofline, SpeculativeStepCost, StepCost, allreduce_seconds
from tuili.perf.probe import CPU_LINK, mean_rates
from tuili.perf.speculation import Speculation, scaled_storage
from tuili.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from tuili.engine.core import LLMEngine


TTFT_RUNS = 3  # lone prompts timed; their median is the measured TTFT
UNSTABLE_RATE_CHANGE = 0.2  # a rate moving more than this between before and after the runs is flagged


@dataclass(frozen=True)
class Comparison:
    name: str
    unit: str  # "s" or "fraction"
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured - self.predicted) / self.predicted


@dataclass
class MeasureReport:
    model: str
    device: str
    dtype: str
    hardware: str
    hardware_origin: str
    prompt: int
    output: int
    batch: int
    comparisons: list[Comparison]
    decode_steps: int
    notes: list[str] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    link: str | None = None  # the link the communication was predicted over (None on one device)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["comparisons"] = [{**asdict(c), "error": c.error} for c in self.comparisons]
        return out


def measure(
    source: ModelSource, cost: ModelCost, hardware: HardwareSpec, inputs: PlanInputs, device: str,
    dtype: str = "auto", refresh: Callable[[Collection[str]], HardwareSpec] | None = None,
) -> MeasureReport:
    """Run the engine and compare. ``refresh`` (for this machine's own probe) measures the host's
    drifting rates again: it runs before and after the engine, and the predictions use the mean of
    the two, so that prediction and measurement see the same machine; it is given the packed
    formats the engine holds (their kernels timed again, the other formats' figures kept)."""
    ranks = inputs.tp * inputs.pp
    if inputs.gpus != ranks:
        raise TuiliError(f"--measure runs one replica of --tp {inputs.tp} x --pp {inputs.pp} = {ranks} ranks on this "
                         f"machine: --gpus {inputs.gpus} would be {inputs.gpus // ranks}; drop --gpus")
    import torch

    threads = torch.get_num_threads()  # the machine's, before the ranks split its cores
    spec = inputs.speculation
    engine, log = build_engine(
        str(source.path), device=device, dtype=dtype,
        max_num_batched_tokens=max(512, inputs.prompt * inputs.batch), max_num_seqs=inputs.batch,
        max_model_len=inputs.prompt + inputs.output + 1, speculative_config=spec.config if spec is not None else None,
        tensor_parallel_size=inputs.tp, pipeline_parallel_size=inputs.pp,
    )
    try:
        return _measure(engine, log, source, cost, hardware, inputs, refresh, threads)
    finally:
        engine.close()  # stops the worker ranks (nothing to do on one device)
        torch.set_num_threads(threads)  # rank 0 gave up the cores its workers took


def _measure(
    engine: LLMEngine, log: StepLog, source: ModelSource, cost: ModelCost, hardware: HardwareSpec,
    inputs: PlanInputs, refresh: Callable[[Collection[str]], HardwareSpec] | None, threads: int,
) -> MeasureReport:  # fmt: skip
    import torch

    ranks = inputs.tp * inputs.pp
    spec = inputs.speculation
    working = canonical_dtype(str(engine.dtype))
    packed = _packed_compute_dtype(engine.model)
    if ranks > 1 and (packed or engine.weights_quantized):
        raise TuiliError(f"--measure with --tp {inputs.tp} --pp {inputs.pp} plans float weights, but the engine holds "
                         f"quantized linears ({engine.weights_quantized or packed}): give --dtype float32, or "
                         f"measure them on one device")
    # Under TP or PP rank 0 holds a shard or a stage: the plan takes the whole model in the
    # engine's working dtype (what each rank holds a part of), which the cost model then splits.
    weights = engine_storage(engine.model) if ranks == 1 else weight_format(working)
    inputs = replace(inputs, weights=weights, kv_dtype=working, conv_state_dtype=working,
                     compute_dtype=packed or working, packed_formats=packed_formats(engine.model),
                     head_format=head_format(engine.model))
    if ranks > 1 and inputs.link is None and engine.device.type == "cpu":
        inputs = replace(inputs, link=link(CPU_LINK))
    if ranks > 1 and inputs.link is None and hardware.interconnect is None:
        raise TuiliError(f"--tp {inputs.tp} --pp {inputs.pp} on {engine.device}: {hardware.name} names no link "
                         f"between its devices; give --link")
    if spec is not None:
        inputs = replace(inputs, speculation=_engine_speculation(engine, cost, spec, inputs.weights))

    def refreshed() -> HardwareSpec:
        # The machine's rates, taken with all its cores (rank 0 runs on its share of them) while
        # the worker ranks wait for a step.
        assert refresh is not None
        torch.set_num_threads(threads)
        try:  # the packed kernels only in the formats this model holds
            return refresh({*inputs.packed_formats, *([inputs.head_format] if inputs.head_format else [])})
        finally:
            torch.set_num_threads(engine_threads)

    engine_threads = torch.get_num_threads()
    probed = hardware
    if refresh is not None:
        hardware = refreshed()
    weight_bytes = engine.weight_bytes()
    decode_weight_bytes = engine.decode_weight_bytes()
    kv_per_token = engine.pool.kv_bytes_per_token
    notes = []
    if packed:
        notes.append(f"the engine holds its linears quantized ({engine.weights_quantized}) and multiplies them in "
                     f"{packed}: the compute peak is {hardware.dtype_used(packed)}'s")
    if ranks == 1 and decode_weight_bytes != cost.decode_weight_bytes(inputs.weights):
        notes.append(f"a decode step of the engine reads {decode_weight_bytes} bytes of weights, the cost model "
                     f"counts {cost.decode_weight_bytes(inputs.weights)}")
    if hardware.estimated:
        notes.append("the hardware figures are a quick estimate: run `tuili probe` first for measured ones")

    rng = random.Random(0)
    vocab = cost.shape.vocab_size

    def prompt_ids() -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(inputs.prompt)]}

    def run(requests: int, max_tokens: int, meter: UtilizationMeter, decode_log: list,
            decode_comm: list | None = None) -> tuple[float, float]:  # fmt: skip
        """Run ``requests`` fresh requests to completion; return the first token's delay and the
        seconds rank 0 spent communicating. Each pure decode step's own communication is
        appended to ``decode_comm``."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        comm_start = engine.communication_seconds()
        start = time.perf_counter()
        for _ in range(requests):
            engine.add_request(prompt_ids(), params)
        first_token = None
        while engine.has_unfinished_requests():
            comm = engine.communication_seconds()
            t0 = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - t0
            assert log.last is not None  # every step with work reports
            chunks, decodes = log.last.prefill_chunks, log.last.decode_context_lens
            record = log.last
            meter.record_step(chunks, decodes, seconds, record.verify_chunks, record.num_accepted,
                              record.draft_forwards)
            if (decodes or record.verify_chunks) and not chunks:
                decode_log.append((decodes, record.verify_chunks, record.draft_forwards, seconds))
                if decode_comm is not None:
                    decode_comm.append(engine.communication_seconds() - comm)
            if first_token is None and outputs:
                first_token = time.perf_counter() - start
        return first_token or 0.0, engine.communication_seconds() - comm_start

    def new_meter() -> UtilizationMeter:
        # The engine's decode_weight_bytes is one sequence's; a mixture of experts reads more
        # experts as the batch grows, which the meter takes from the cost model's read fraction.
        # Under TP or PP the report takes the prefill's FLOPs and seconds from the meter and
        # sets them against all the ranks' devices; the meter's MBU, from rank 0's bytes, is unused.
        return UtilizationMeter(cost, hardware, weight_bytes, kv_per_token, compute_dtype=inputs.compute_dtype,
                                decode_weight_bytes=None if cost.shape.moe is not None else decode_weight_bytes,
                                draft_weight_bytes=engine.draft_weight_bytes())

    run(1, 2, new_meter(), [])  # warm-up: first calls allocate and pick kernels
    if spec is not None or ranks > 1:
        # A speculating engine captures a CPU graph per shape of verification rows and per draft
        # batch the first time it meets one, as tensor-parallel ranks capture their decode steps
        # per batch size: a warm-up run of the measured shape meets most of them, so that the
        # timed steps are steps (and their collectives once each), not captures.
        run(inputs.batch, inputs.output, new_meter(), [])
    prefill_meter = new_meter()
    # The median of a few: one prompt's time swings with the host's load from one run to the next.
    lone = [run(1, 1, prefill_meter, []) for _ in range(TTFT_RUNS)]
    ttft = sorted(t for t, _ in lone)[TTFT_RUNS // 2]
    prefill_comm = sorted(c for _, c in lone)[TTFT_RUNS // 2]
    decode_meter, decode_log, decode_comm = new_meter(), [], []
    run(inputs.batch, inputs.output, decode_meter, decode_log, decode_comm)
    if not decode_log:
        raise TuiliError("the run had no pure decode step to measure: use --output 2 or more")
    metered = hardware  # the rates taken before the runs
    if refresh is not None:
        after = refreshed()
        hardware = mean_rates(metered, after)
        notes.append(_drift_note(probed, metered, after, inputs.compute_dtype))
    # MFU and MBU are taken against all the ranks' devices together: on a CPU the one machine they
    # share (each rank predicted at its share of it), on GPUs a device per rank.
    machine = hardware
    devices = 1
    if ranks > 1 and engine.device.type == "cpu":
        hardware = shared_by(machine, ranks)
        notes.append(_ranks_note(engine, inputs, machine, threads, engine_threads))
    elif ranks > 1:
        devices = ranks
    roof = Roofline(cost, hardware, inputs)

    # Each step as it was scheduled: a speculating engine's verification chunks, plain decodes
    # beside them, and its proposer's forwards before the step.
    predicted_steps = [roof.speculative_step(decodes, verify, forwards) if spec is not None else roof.decode(decodes)
                       for decodes, verify, forwards, _ in decode_log]  # fmt: skip
    measured_step = sum(s for *_, s in decode_log) / len(decode_log)
    predicted_step = sum(p.seconds for p in predicted_steps) / len(predicted_steps)
    roofline_step = sum(_roofline(p) for p in predicted_steps) / len(predicted_steps)
    # All ranks' bytes: each of the tp ranks of a stage reads its share, and the stages' shares
    # add up to the whole model.
    step_bytes = sum(p.bytes for p in predicted_steps) * inputs.tp
    bandwidth = machine.memory_bandwidth * devices
    peak = machine.flops(inputs.compute_dtype) * devices
    predicted_mbu = step_bytes / sum(p.seconds for p in predicted_steps) / bandwidth
    measured_mbu = step_bytes / sum(s for *_, s in decode_log) / bandwidth
    prefill = roof.prefill(0, inputs.prompt)
    comparisons = [
        Comparison("TTFT", "s", prefill.seconds, ttft),
        Comparison("TTFT, roofline alone", "s", prefill.roofline, ttft),
        Comparison("prefill MFU", "fraction",
                   prefill.flops / prefill.seconds / peak,
                   # the meter's own MFU is None above its peak: the rate against the mean rates here
                   prefill_meter.prefill_flops / prefill_meter.prefill_seconds / peak),
        Comparison("decode step", "s", predicted_step, measured_step),
        Comparison("decode step, roofline alone", "s", roofline_step, measured_step),
        Comparison("decode MBU", "fraction", predicted_mbu, measured_mbu),
    ]
    if ranks > 1:
        predicted_comm = [_rank0_comm(roof, cost, inputs, len(decodes), len(decodes)) for decodes, *_ in decode_log]
        comparisons += [
            Comparison("communication per decode step", "s", sum(predicted_comm) / len(predicted_comm),
                       sum(decode_comm) / len(decode_comm)),
            Comparison("communication in the prefill", "s", _rank0_comm(roof, cost, inputs, 1, inputs.prompt),
                       prefill_comm),
        ]
        notes.append(_communication_note(inputs, roof))
    if spec is not None:
        notes.append(_speculation_note(engine, inputs, decode_log, predicted_steps))
    # The notes give the machine's figures (a rank sharing it predicted at its share, above).
    each_rank = f"; each of the {ranks} ranks at 1/{ranks} of these" if hardware is not machine else ""
    if machine.host_overhead_seconds:
        notes.append(f"host overhead {_overhead(predicted_steps[0]) * 1e3:.2f} ms per decode step, "
                     f"{prefill.overhead * 1e3:.2f} ms in the prefill ({cost.shape.num_layers} layers; "
                     + ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in machine.host_overhead_seconds.items()) + ")")
    else:
        notes.append(f"{machine.name} has no measured host overheads: the predictions are the roofline alone; "
                     f"run `tuili probe` to measure them")
    dtype = inputs.compute_dtype
    if not inputs.packed_linears and dtype in machine.linear_stream_bandwidth:
        kernels = sum(_step_cost(p).kernels for p in predicted_steps) / len(predicted_steps)
        curve = sorted(machine.linear_flops_by_rows.get(dtype, {}).items()) or [
            (ENGINE_PREFILL_ROWS, machine.linear_prefill_flops.get(dtype, 0.0))
        ]
        notes.append(f"tuili's {dtype} linears measured here stream weights at "
                     f"{machine.linear_stream_bandwidth[dtype] / 1e9:.1f} GB/s at one row and run "
                     f"{'/'.join(f'{rate / 1e12:.2f}' for _, rate in curve)} TFLOP/s at "
                     f"{'/'.join(str(rows) for rows, _ in curve)} rows{each_rank}: "
                     f"+{kernels * 1e3:.2f} ms per decode step, +{prefill.kernels * 1e3:.2f} ms in the prefill "
                     f"above the roofline")
    if inputs.kv_dtype in machine.decode_attention_bandwidth:
        notes.append(f"tuili's decode attention measured here reads a {inputs.kv_dtype} cache at "
                     f"{machine.decode_attention_bandwidth[inputs.kv_dtype] / 1e9:.1f} GB/s{each_rank} (the memory "
                     f"{machine.memory_bandwidth / 1e9:.1f}): the decode steps' cache reads are charged at it")
    elementwise = machine.elementwise_seconds_per_value.get(roof.compute_dtype, {})
    if elementwise:
        notes.append(f"tuili's elementwise work measured here (ns per value: "
                     f"{', '.join(f'{kind} {seconds * 1e9:.3f}' for kind, seconds in elementwise.items())}{each_rank}): "
                     f"+{roof.elementwise(inputs.prompt) * 1e3:.2f} ms in the prefill, "
                     f"+{roof.elementwise(inputs.batch) * 1e3:.2f} ms per decode step")
    if inputs.packed_linears:
        def rates(by_format: dict[str, float]) -> str:
            return ", ".join(f"{fmt} {by_format[fmt] * 1e9:.3f}" if fmt in by_format else f"{fmt} unmeasured"
                             for fmt in inputs.packed_formats)

        shares = ", ".join(f"{fmt} {share:.0%}" for fmt, share in inputs.packed_formats.items())
        many_rows = (f"the prefill runs it too, at {rates(machine.packed_rows_seconds_per_value)} ns per value and "
                     f"row at many rows" if machine.packed_rows_seconds_per_value else
                     f"the prefill dequantizes them, {prefill.dequant * 1e3:.2f} ms at "
                     f"{rates(machine.packed_dequant_seconds_per_value)} ns per value")
        notes.append(f"packed linears ({shares} of their values): their kernel at "
                     f"{rates(machine.packed_kernel_seconds_per_value)} ns per weight value and row; {many_rows}")
        if machine.packed_call_seconds_by_rows:
            calls = "; ".join(
                f"{fmt} " + ", ".join(f"{rows}: {seconds * 1e9:.3f}" for rows, seconds in sorted(curve.items()))
                for fmt, curve in machine.packed_call_seconds_by_rows.items() if fmt in inputs.packed_formats
            )
            notes.append(f"a packed kernel call is charged on its measured curve (rows: ns per value and call): {calls}")
    return MeasureReport(
        model=str(source.path), device=str(engine.device), dtype=working, hardware=hardware.name,
        hardware_origin=hardware.origin, prompt=inputs.prompt, output=inputs.output, batch=inputs.batch,
        comparisons=comparisons, decode_steps=len(decode_log), notes=notes, tp=inputs.tp, pp=inputs.pp,
        link=roof.link.name if ranks > 1 and roof.link is not None else None,
    )


def shared_by(machine: HardwareSpec, ranks: int) -> HardwareSpec:
    """One of ``ranks`` ranks on ``machine``, splitting its cores (each runs cores / ranks
    threads) and its memory: every rate of the machine divided by the ranks, its packed kernels'
    seconds per value multiplied by them. Host overheads stay: each rank runs a whole step's
    Python. Under TP the ranks run at once, so a step's roofline equals the whole machine's;
    under PP they run one after another on their share of the cores (docs/ruler.md §6)."""
    def each(rates: dict) -> dict:
        return {k: each(v) if isinstance(v, dict) else v / ranks for k, v in rates.items()}

    return replace(
        machine, name=f"{machine.name}, 1/{ranks} per rank", peak_flops=each(machine.peak_flops),
        memory_bandwidth=machine.memory_bandwidth / ranks, memory_bytes=machine.memory_bytes // ranks,
        **{name: {fmt: seconds * ranks for fmt, seconds in getattr(machine, name).items()} for name in PACKED_FIELDS},
        **{name: {outer: {key: seconds * ranks for key, seconds in table.items()}
                  for outer, table in getattr(machine, name).items()} for name in SECONDS_TABLES},
        **{name: each(getattr(machine, name)) for name in (*PER_DTYPE, *CURVES)},
    )


def _rank0_comm(roof: Roofline, cost: ModelCost, inputs: PlanInputs, rows: int, tokens: int) -> float:
    """Seconds rank 0 communicates in a step of ``tokens`` tokens sampling ``rows`` rows, as
    `engine.communication_seconds()` counts them: under TP alone every all-reduce and the logits
    gather (`Roofline.comm` for a decode step); under PP its stage transfers, plus, with TP in
    each stage, the all-reduces of the first stage's layers and the embedding (the logits are
    gathered on the last stage)."""
    if inputs.pp == 1:
        return roof.comm(rows) if tokens == rows else roof.prefill_comm(tokens) + roof.gather(rows)
    transfers = roof.stage_transfer(rows, tokens)
    assert transfers is not None and roof.link is not None  # a link is named or defaulted above
    if inputs.tp == 1:
        return transfers
    first_stage_layers = sum(cost.stage_layer_kinds(inputs.pp)[0])
    return transfers + (2 * first_stage_layers + 1) * allreduce_seconds(tokens * roof.hidden_bytes, inputs.tp, roof.link)


def _ranks_note(engine: LLMEngine, inputs: PlanInputs, machine: HardwareSpec, threads: int, engine_threads: int) -> str:
    ranks = inputs.tp * inputs.pp
    held = engine.runner.weight_bytes_per_rank()
    crowded = f" ({ranks} ranks on {threads} threads take turns)" if ranks * engine_threads > threads else ""
    return (f"{ranks} ranks (--tp {inputs.tp} --pp {inputs.pp}) share this machine: {engine_threads} of its {threads} "
            f"threads each{crowded}, and its memory bandwidth, so the predictions take each rank's rates as 1/{ranks} of "
            f"{machine.name}'s; the decode step and TTFT are indicative, the communication is the point. MFU and "
            f"MBU are the whole machine's. The ranks hold {', '.join(str(b) for b in held)} bytes of weights")


def _communication_note(inputs: PlanInputs, roof: Roofline) -> str:
    """How the communication rows were measured and predicted."""
    assert roof.link is not None
    note = (f"communication: rank 0's seconds in collectives (engine.communication_seconds()) around each pure "
            f"decode step and around the lone prompt's step (median of {TTFT_RUNS}), against the ruler's over "
            f"{roof.link.name} ({roof.link.bandwidth / 1e9:g} GB/s, {roof.link.latency * 1e6:g} µs); the ruler counts "
            f"bf16 activations and logits, the engine sends its working dtype and gathers float32 logits; each collective waits for the last rank to "
            f"arrive, so the measured time holds the ranks' skew too (on a loaded machine, most of it)")
    if inputs.pp > 1:
        note += ("; under PP rank 0's communication includes its waits for the later stages to run their layers "
                 "(docs/engine.md), so it exceeds the transfers, and the stages send over gloo (TCP on this "
                 "machine), not the shared-memory link: give --link for another")
    return note


def _step_cost(step: StepCost | SpeculativeStepCost) -> StepCost:
    """The target's forward of a step (a speculating step's verification)."""
    return step.verify if isinstance(step, SpeculativeStepCost) else step


def _roofline(step: StepCost | SpeculativeStepCost) -> float:
    """A step's roofline alone: the target's forward's and each proposer forward's."""
    if isinstance(step, SpeculativeStepCost):
        return step.verify.roofline + sum(p.roofline for p in step.proposer)
    return step.roofline


def _overhead(step: StepCost | SpeculativeStepCost) -> float:
    if isinstance(step, SpeculativeStepCost):
        return step.verify.overhead + sum(p.overhead for p in step.proposer)
    return step.overhead


def _engine_speculation(engine: LLMEngine, cost: ModelCost, spec: Speculation, target: CheckpointBytes) -> Speculation:
    """``spec`` with the proposer's weights as the engine holds them: a draft model's tensors by
    kind (packed or not), the MTP block at the bytes per parameter of the engine's target."""
    if spec.proposer is None:
        return spec
    if spec.head_shared:
        return replace(spec, proposer_weights=scaled_storage(cost, target, spec.proposer))
    draft = engine.speculator.proposer.runner.model
    return replace(spec, proposer_weights=engine_storage(draft), proposer_formats=packed_formats(draft))


def _speculation_note(
    engine: LLMEngine, inputs: PlanInputs, decode_log: list, predicted: list[SpeculativeStepCost],
) -> str:  # fmt: skip
    """What the speculating run did against what the plan assumes."""
    spec = inputs.speculation
    assert spec is not None
    stats = engine.stats().spec
    verifying = [p for p, (_, verify, _, _) in zip(predicted, decode_log, strict=True) if verify]
    proposing = sum(sum(f.seconds for f in p.proposer) for p in verifying)
    note = (f"speculation ({spec.config.method}, k up to {spec.k}): the plan assumes acceptance {spec.acceptance:g}, "
            f"{spec.tokens_per_step:.2f} tokens per verification; the run kept "
            f"{stats.num_accepted_tokens} of {stats.num_proposed_tokens} proposals "
            f"({stats.acceptance_rate:.2f}), {stats.tokens_per_verification:.2f} tokens per verification; "
            f"{len(verifying)} of {len(decode_log)} decode steps verified")
    if verifying:
        note += f", predicted {proposing / len(verifying) * 1e3:.2f} ms of proposer forwards in each"
    return note


def _drift_note(probed: HardwareSpec, before: HardwareSpec, after: HardwareSpec, dtype: str) -> str:
    """How this machine's rates moved: at its last probe, just before the runs and just after."""
    note = (f"rates measured again around the runs (the predictions use the mean): memory read "
            f"{probed.memory_bandwidth / 1e9:.1f} GB/s at the probe, {before.memory_bandwidth / 1e9:.1f} before, "
            f"{after.memory_bandwidth / 1e9:.1f} after; {probed.dtype_used(dtype)} matmul {probed.flops(dtype) / 1e12:.2f} TFLOP/s "
            f"at the probe, {before.flops(dtype) / 1e12:.2f} before, {after.flops(dtype) / 1e12:.2f} after")
    moved = max(abs(after.memory_bandwidth / before.memory_bandwidth - 1), abs(after.flops(dtype) / before.flops(dtype) - 1))
    if moved > UNSTABLE_RATE_CHANGE:
        note += (f" — the machine's speed moved by {moved:.0%} within the run, so these errors measure that "
                 f"as much as the model: run again when it is quieter")
    return note


def engine_storage(model: torch.nn.Module) -> CheckpointBytes:
    """The bytes the engine's model holds per kind of weight (tuili/perf/shapes.py KINDS): its
    parameters and its quantized linears' and experts' codes and scales, each storage once (a
    tied embedding is one tensor); a packed copy of the output matrix in that matrix's place."""
    from tuili.layers.linear import PanelEmbedding, PanelLinear
    from tuili.layers.moe import QuantizedExperts
    from tuili.layers.quant import QuantizedLinear

    tensors = list(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, PanelLinear, PanelEmbedding, QuantizedExperts)):
            tensors += [(f"{name}.{b}", t) for b, t in module.named_buffers()]
    if model.lm_head.decode_copy is not None:
        # A decode copy of the output matrix serves the logits of decode steps of few rows: it
        # stands for that matrix (the embedding when tied, whose token lookup reads only a few
        # rows), as what a step reads.
        output = "model.embed_tokens" if model.config.tie_word_embeddings else "lm_head"
        tensors = [
            (name.replace("lm_head.decode_copy", output, 1), t)
            for name, t in tensors
            if not name.startswith(f"{output}.") or name.startswith("lm_head.decode_copy")
        ]
    seen: set[int] = set()
    by_kind: dict[str, int] = {}
    for name, tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        kind = _kind(name)
        by_kind[kind] = by_kind.get(kind, 0) + storage.nbytes()
    return CheckpointBytes(by_kind, "the engine's weight tensors")


def _kind(name: str) -> str:
    module = name.rsplit(".", 1)[0]
    if "embed_tokens" in name:
        return "embedding"
    if "lm_head" in name:
        return "lm_head"
    if module.endswith("norm"):
        return "norm"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"
    if module.endswith((".mlp.gate", ".mlp.shared_expert_gate")):
        return "router"
    if ".mlp." in name:
        return "mlp"
    if ".linear_attn." in name:  # Gated DeltaNet: projections, conv, A_log, dt_bias (its norm is a norm)
        return "linear_attention"
    raise TuiliError(f"the engine holds a weight {name!r} the cost model has no kind for")


def packed_formats(model: torch.nn.Module) -> dict[str, float]:
    """The packed formats (PACKED_FORMATS) of the model's packed linears outside the output head,
    each with its share of their weight values; empty where its layers hold float linears."""
    from tuili.layers.quant import PackedLinear

    values: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and not name.startswith("lm_head."):
            fmt = module.kernel_format
            values[fmt] = values.get(fmt, 0) + module.in_features * module.out_features
    total = sum(values.values())
    return {fmt: count / total for fmt, count in sorted(values.items())}


def head_format(model: torch.nn.Module) -> str:
    """The packed format of the output matrix's copy that a decode step's logits read, or "" where
    they read a float matrix."""
    from tuili.layers.quant import PackedLinear

    copy = getattr(getattr(model, "lm_head", None), "decode_copy", None)
    return copy.kernel_format if isinstance(copy, PackedLinear) else ""


def _packed_compute_dtype(model: torch.nn.Module) -> str | None:
    """The dtype the engine's quantized linears compute in, or None if its layers hold float
    linears. A packed copy of the output matrix alone (a float GGUF file's logits read from an int8
    copy) does not make the layers packed: the copy's bytes stand for that matrix's."""
    from tuili.layers.moe import QuantizedExperts
    from tuili.layers.quant import QuantizedLinear

    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedExperts)) and not name.startswith("lm_head."):
            return canonical_dtype(str(module.compute_dtype))
    return None


def format_measurement(r: MeasureReport) -> str:
    def show(c: Comparison, value: float) -> str:
        return f"{100 * value:.1f}%" if c.unit == "fraction" else f"{value * 1e3:.2f} ms"

    lines = [
        f"measured {r.model} on {r.device} ({r.dtype}) against {r.hardware} [{r.hardware_origin}]",
        f"prompt {r.prompt}, output {r.output}, batch {r.batch}; {r.decode_steps} decode steps timed"
        + (f"; --tp {r.tp} --pp {r.pp}, communication over {r.link}" if r.tp * r.pp > 1 else ""),
        f"{'':<38}{'predicted':>12}{'measured':>12}{'error':>9}",
    ]
    for c in r.comparisons:
        lines.append(f"{c.name:<38}{show(c, c.predicted):>12}{show(c, c.measured):>12}{100 * c.error:>+8.0f}%")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
