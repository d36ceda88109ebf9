"""`tuili plan --measure`: run the engine on this machine for the planned shape and set the plan's
predictions against what happened, with the error of each.

Two runs, both with random prompt tokens (so the prefix cache never hits):
  1. one request alone, ``prompt`` tokens, one output token: its time to first token against the
     plan's TTFT, and its prefill MFU;
  2. ``batch`` requests together, ``prompt`` + ``output`` tokens each: every step is timed and
     fed to a UtilizationMeter; each pure decode step is set against the roofline's prediction for
     the same context lengths, and the decode MBU against the predicted one.
The plan is made for what the engine really holds: its working dtype for weights and KV (it
dequantizes GGUF files when loading), whatever --weights says.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field, replace

from tuili.errors import TuiliError
from tuili.perf.checkpoint import ModelSource
from tuili.perf.cost import ModelCost
from tuili.perf.formats import canonical_dtype, weight_format
from tuili.perf.hardware import HardwareSpec
from tuili.perf.meter import UtilizationMeter
from tuili.perf.plan import PlanInputs, Roofline
from tuili.perf.probe import fit_gemv


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


def measure(source: ModelSource, cost: ModelCost, hardware: HardwareSpec, inputs: PlanInputs, device: str) -> MeasureReport:
    from tuili import LLM
    from tuili.engine.runner import kv_bytes_per_block
    from tuili.sampling import SamplingParams

    if inputs.tp != 1 or inputs.gpus != 1:
        raise TuiliError("--measure runs on one device here: drop --tp and --gpus")
    total = inputs.prompt + inputs.output
    llm = LLM(
        model=str(source.path), device=device, max_num_batched_tokens=max(512, inputs.prompt * inputs.batch),
        max_num_seqs=inputs.batch, max_model_len=total + 1,
    )
    engine = llm.engine
    dtype = canonical_dtype(str(engine.dtype))
    inputs = replace(inputs, weights=weight_format(dtype), kv_dtype=dtype, compute_dtype=dtype)
    roof = Roofline(cost, hardware, inputs)
    weight_bytes = engine.runner.weight_bytes()
    kv_per_token = kv_bytes_per_block(engine.model_config, 1, engine.dtype)
    notes = []
    if weight_bytes != cost.weight_bytes(inputs.weights):
        notes.append(f"the engine holds {weight_bytes} bytes of weights, the cost model expected "
                     f"{cost.weight_bytes(inputs.weights)}")
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
            chunks, decodes = engine.last_step.split_prefill_decode()
            meter.record_step(chunks, decodes, seconds)
            if decodes and not chunks:
                decode_log.append((decodes, seconds))
            if first_token is None and outputs:
                first_token = time.perf_counter() - start
        return first_token or 0.0

    def new_meter() -> UtilizationMeter:
        return UtilizationMeter(cost, hardware, weight_bytes, kv_per_token, compute_dtype=dtype)

    run(1, 2, new_meter(), [])  # warm-up: first calls allocate and pick kernels
    prefill_meter = new_meter()
    ttft = run(1, 1, prefill_meter, [])
    decode_meter, decode_log = new_meter(), []
    run(inputs.batch, inputs.output, decode_meter, decode_log)
    if not decode_log:
        raise TuiliError("the run had no pure decode step to measure: use --output 2 or more")

    predicted_steps = [roof.decode(contexts) for contexts, _ in decode_log]
    measured_step = sum(s for _, s in decode_log) / len(decode_log)
    predicted_step = sum(p.seconds for p in predicted_steps) / len(predicted_steps)
    step_bytes = sum(p.bytes for p in predicted_steps)
    bandwidth = hardware.memory_bandwidth
    predicted_mbu = step_bytes / sum(p.seconds for p in predicted_steps) / bandwidth
    measured_mbu = step_bytes / sum(s for _, s in decode_log) / bandwidth
    prefill = roof.prefill(0, inputs.prompt)
    gemv = fit_gemv(hardware.measurements, dtype)
    if gemv is not None:
        # The probe timed one-row matmuls at two sizes: each costs a fixed overhead (dispatch,
        # thread wake-up, kernel launch) plus its bytes at a streaming rate. A decode step is then
        # one such matmul per weight matrix, and its bytes at that rate.
        overhead, rate = gemv
        kernels = cost.matmuls_per_decode_step()
        predicted_at_gemv = sum(overhead * kernels + p.bytes / rate for p in predicted_steps) / len(predicted_steps)
    comparisons = [
        Comparison("TTFT", "s", prefill.seconds, ttft),
        Comparison("prefill MFU", "fraction", prefill.flops / prefill.seconds / hardware.flops(dtype),
                   prefill_meter.prefill_mfu or 0.0),
        Comparison("decode step", "s", predicted_step, measured_step),
        Comparison("decode MBU", "fraction", predicted_mbu, measured_mbu),
    ]
    if gemv is not None:
        comparisons.insert(3, Comparison("decode step, probe's matmul overhead", "s", predicted_at_gemv, measured_step))
        notes.append(f"probe's one-row matmuls: {overhead * 1e6:.0f} µs each + bytes at {rate / 1e9:.1f} GB/s; "
                     f"{kernels} matmuls per decode step")
    return MeasureReport(
        model=str(source.path), device=str(engine.device), dtype=dtype, hardware=hardware.name,
        hardware_origin=hardware.origin, prompt=inputs.prompt, output=inputs.output, batch=inputs.batch,
        comparisons=comparisons, decode_steps=len(decode_log), notes=notes,
    )


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
