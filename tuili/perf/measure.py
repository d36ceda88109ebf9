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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from tuili.errors import TuiliError
from tuili.perf.checkpoint import ModelSource
from tuili.perf.cost import CheckpointBytes, ModelCost
from tuili.perf.formats import canonical_dtype
from tuili.perf.hardware import ENGINE_PREFILL_ROWS, HardwareSpec
from tuili.perf.harness import build_engine
from tuili.perf.meter import UtilizationMeter
from tuili.perf.plan import PlanInputs, Roofline, SpeculativeStepCost, StepCost
from tuili.perf.probe import mean_rates
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

    def as_dict(self) -> dict:
        out = asdict(self)
        out["comparisons"] = [{**asdict(c), "error": c.error} for c in self.comparisons]
        return out


def measure(
    source: ModelSource, cost: ModelCost, hardware: HardwareSpec, inputs: PlanInputs, device: str,
    dtype: str = "auto", refresh: Callable[[], HardwareSpec] | None = None,
) -> MeasureReport:
    """Run the engine and compare. ``refresh`` (for this machine's own probe) measures the host's
    drifting rates again: it runs before and after the engine, and the predictions use the mean of
    the two, so that prediction and measurement see the same machine."""
    if inputs.tp != 1 or inputs.pp != 1 or inputs.gpus != 1:
        raise TuiliError("--measure runs on one device here: drop --tp, --pp and --gpus")
    total = inputs.prompt + inputs.output
    spec = inputs.speculation
    engine, log = build_engine(
        str(source.path), device=device, dtype=dtype,
        max_num_batched_tokens=max(512, inputs.prompt * inputs.batch), max_num_seqs=inputs.batch,
        max_model_len=total + 1, speculative_config=spec.config if spec is not None else None,
    )
    working = canonical_dtype(str(engine.dtype))
    packed = _packed_compute_dtype(engine.model)
    inputs = replace(inputs, weights=engine_storage(engine.model), kv_dtype=working, conv_state_dtype=working,
                     compute_dtype=packed or working, packed_linears=packed is not None)
    if spec is not None:
        inputs = replace(inputs, speculation=_engine_speculation(engine, cost, spec, inputs.weights))
    probed = hardware
    if refresh is not None:
        hardware = refresh()
    weight_bytes = engine.weight_bytes()
    decode_weight_bytes = engine.decode_weight_bytes()
    kv_per_token = engine.pool.kv_bytes_per_token
    notes = []
    if packed:
        notes.append(f"the engine holds its linears quantized ({engine.weights_quantized}) and multiplies them in "
                     f"{packed}: the compute peak is {packed}'s")
    if decode_weight_bytes != cost.decode_weight_bytes(inputs.weights):
        notes.append(f"a decode step of the engine reads {decode_weight_bytes} bytes of weights, the cost model "
                     f"counts {cost.decode_weight_bytes(inputs.weights)}")
    if hardware.estimated:
        notes.append("the hardware figures are a quick estimate: run `tuili probe` first for measured ones")

    rng = random.Random(0)
    vocab = cost.shape.vocab_size

    def prompt_ids() -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(inputs.prompt)]}

    def run(requests: int, max_tokens: int, meter: UtilizationMeter, decode_log: list) -> float:
        """Run ``requests`` fresh requests to completion; return the first token's delay."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        start = time.perf_counter()
        for _ in range(requests):
            engine.add_request(prompt_ids(), params)
        first_token = None
        while engine.has_unfinished_requests():
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
            if first_token is None and outputs:
                first_token = time.perf_counter() - start
        return first_token or 0.0

    def new_meter() -> UtilizationMeter:
        # The engine's decode_weight_bytes is one sequence's; a mixture of experts reads more
        # experts as the batch grows, which the meter takes from the cost model's read fraction.
        return UtilizationMeter(cost, hardware, weight_bytes, kv_per_token, compute_dtype=inputs.compute_dtype,
                                decode_weight_bytes=None if cost.shape.moe is not None else decode_weight_bytes,
                                draft_weight_bytes=engine.draft_weight_bytes())

    run(1, 2, new_meter(), [])  # warm-up: first calls allocate and pick kernels
    if spec is not None:
        # A speculating engine captures a CPU graph per shape of verification rows and per draft
        # batch the first time it meets one: a warm-up run of the measured shape meets most of
        # them, so that the timed steps are steps, not captures.
        run(inputs.batch, inputs.output, new_meter(), [])
    prefill_meter = new_meter()
    # The median of a few: one prompt's time swings with the host's load from one run to the next.
    ttft = sorted(run(1, 1, prefill_meter, []) for _ in range(TTFT_RUNS))[TTFT_RUNS // 2]
    decode_meter, decode_log = new_meter(), []
    run(inputs.batch, inputs.output, decode_meter, decode_log)
    if not decode_log:
        raise TuiliError("the run had no pure decode step to measure: use --output 2 or more")
    metered = hardware  # the rates the meters' MFU and MBU were taken against
    if refresh is not None:
        after = refresh()
        hardware = mean_rates(metered, after)
        notes.append(_drift_note(probed, metered, after, inputs.compute_dtype))
    roof = Roofline(cost, hardware, inputs)

    # Each step as it was scheduled: a speculating engine's verification chunks, plain decodes
    # beside them, and its proposer's forwards before the step.
    predicted_steps = [roof.speculative_step(decodes, verify, forwards) if spec is not None else roof.decode(decodes)
                       for decodes, verify, forwards, _ in decode_log]  # fmt: skip
    measured_step = sum(s for *_, s in decode_log) / len(decode_log)
    predicted_step = sum(p.seconds for p in predicted_steps) / len(predicted_steps)
    roofline_step = sum(_roofline(p) for p in predicted_steps) / len(predicted_steps)
    step_bytes = sum(p.bytes for p in predicted_steps)
    bandwidth = hardware.memory_bandwidth
    predicted_mbu = step_bytes / sum(p.seconds for p in predicted_steps) / bandwidth
    measured_mbu = step_bytes / sum(s for *_, s in decode_log) / bandwidth
    prefill = roof.prefill(0, inputs.prompt)
    comparisons = [
        Comparison("TTFT", "s", prefill.seconds, ttft),
        Comparison("TTFT, roofline alone", "s", prefill.roofline, ttft),
        Comparison("prefill MFU", "fraction",
                   prefill.flops / prefill.seconds / hardware.flops(inputs.compute_dtype),
                   (prefill_meter.prefill_mfu or 0.0) * metered.flops(inputs.compute_dtype)
                   / hardware.flops(inputs.compute_dtype)),
        Comparison("decode step", "s", predicted_step, measured_step),
        Comparison("decode step, roofline alone", "s", roofline_step, measured_step),
        Comparison("decode MBU", "fraction", predicted_mbu, measured_mbu),
    ]
    if spec is not None:
        notes.append(_speculation_note(engine, inputs, decode_log, predicted_steps))
    if hardware.host_overhead_seconds:
        notes.append(f"host overhead {_overhead(predicted_steps[0]) * 1e3:.2f} ms per decode step, "
                     f"{prefill.overhead * 1e3:.2f} ms in the prefill ({cost.shape.num_layers} layers; "
                     + ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in hardware.host_overhead_seconds.items()) + ")")
    else:
        notes.append(f"{hardware.name} has no measured host overheads: the predictions are the roofline alone; "
                     f"run `tuili probe` to measure them")
    dtype = inputs.compute_dtype
    if not inputs.packed_linears and dtype in hardware.linear_stream_bandwidth:
        kernels = sum(_step_cost(p).kernels for p in predicted_steps) / len(predicted_steps)
        curve = sorted(hardware.linear_flops_by_rows.get(dtype, {}).items()) or [
            (ENGINE_PREFILL_ROWS, hardware.linear_prefill_flops.get(dtype, 0.0))
        ]
        notes.append(f"tuili's {dtype} linears measured here stream weights at "
                     f"{hardware.linear_stream_bandwidth[dtype] / 1e9:.1f} GB/s at one row and run "
                     f"{'/'.join(f'{rate / 1e12:.2f}' for _, rate in curve)} TFLOP/s at "
                     f"{'/'.join(str(rows) for rows, _ in curve)} rows: "
                     f"+{kernels * 1e3:.2f} ms per decode step, +{prefill.kernels * 1e3:.2f} ms in the prefill "
                     f"above the roofline")
    if inputs.packed_linears:
        notes.append(f"packed int4 linears: their kernel at {hardware.int4_kernel_seconds_per_value * 1e9:.2f} ns "
                     f"per weight value and row; the prefill dequantizes them, {prefill.dequant * 1e3:.2f} ms at "
                     f"{hardware.int4_dequant_seconds_per_value * 1e9:.2f} ns per value")
    return MeasureReport(
        model=str(source.path), device=str(engine.device), dtype=working, hardware=hardware.name,
        hardware_origin=hardware.origin, prompt=inputs.prompt, output=inputs.output, batch=inputs.batch,
        comparisons=comparisons, decode_steps=len(decode_log), notes=notes,
    )


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
    return replace(spec, proposer_weights=engine_storage(draft), proposer_packed=_packed_compute_dtype(draft) is not None)


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
            f"{after.memory_bandwidth / 1e9:.1f} after; {dtype} matmul {probed.flops(dtype) / 1e12:.2f} TFLOP/s "
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


def _packed_compute_dtype(model: torch.nn.Module) -> str | None:
    """The dtype the engine's quantized linears compute in, or None if it holds float linears."""
    from tuili.layers.moe import QuantizedExperts
    from tuili.layers.quant import QuantizedLinear

    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedExperts)):
            return canonical_dtype(str(module.compute_dtype))
    return None


def format_measurement(r: MeasureReport) -> str:
    def show(c: Comparison, value: float) -> str:
        return f"{100 * value:.1f}%" if c.unit == "fraction" else f"{value * 1e3:.2f} ms"

    lines = [
        f"measured {r.model} on {r.device} ({r.dtype}) against {r.hardware} [{r.hardware_origin}]",
        f"prompt {r.prompt}, output {r.output}, batch {r.batch}; {r.decode_steps} decode steps timed",
        f"{'':<38}{'predicted':>12}{'measured':>12}{'error':>9}",
    ]
    for c in r.comparisons:
        lines.append(f"{c.name:<38}{show(c, c.predicted):>12}{show(c, c.measured):>12}{100 * c.error:>+8.0f}%")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
