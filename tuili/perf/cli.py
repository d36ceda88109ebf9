"""`tuili plan` and `tuili probe`: the ruler on the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection

from tuili.engine.cli import parse_json_object
from tuili.errors import TuiliError
from tuili.perf.speculation import DEFAULT_ACCEPTANCE


def register(subparsers) -> None:
    """Add `plan` and `probe` to the `tuili` parser."""
    plan = subparsers.add_parser(
        "plan", help="capacity and latency of a model on some hardware, from the cost model",
        description="Predict memory, capacity, TTFT, decode speed and communication of a model on a "
        "hardware spec, from its config alone (no weights loaded). Figures are roofline floors divided "
        "by the assumed --mfu/--mbu; docs/ruler.md defines each. --measure runs the engine on this "
        "machine for the same shape and prints predicted against measured.",
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--model", help="Hugging Face checkpoint directory or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    source.add_argument("--config", help="a config.json alone")
    plan.add_argument("--hardware", help="a preset name (see --list-hardware) or a JSON/YAML spec file "
                      "(default: this machine's last `tuili probe`, else a quick estimate)")
    plan.add_argument("--device", default="auto", help="this machine's device for --measure and the default "
                      "--hardware: cpu, cuda or cuda:N (default: cuda when present)")
    plan.add_argument("--gpus", type=int, default=None, help="devices in all (default: --tp x --pp)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    plan.add_argument("--pp", type=int, default=1, help="pipeline stages, contiguous layers each (default 1)")
    plan.add_argument("--weights", help="storage precision: bf16, fp16, fp32, fp8, int8, int4 or a GGUF type "
                      "(default: what the checkpoint stores, else bf16)")
    plan.add_argument("--kv", default="bf16", help="KV cache dtype: bf16, fp16, fp8 or fp32 (default bf16)")
    plan.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    plan.add_argument("--output", type=int, default=256, help="output tokens (default 256)")
    plan.add_argument("--context", type=int, default=None, help="tokens a request holds (default: prompt + output)")
    plan.add_argument("--batch", type=int, default=1, help="sequences decoding together (default 1)")
    plan.add_argument("--link", help="link for TP all-reduce and KV transfer, e.g. nvlink4, pcie4, 100gbe, ib-ndr "
                      "(default: the hardware's interconnect)")
    plan.add_argument("--reserve", type=float, default=None,
                      help="share of device memory kept for activations and runtime (default 0.10)")
    plan.add_argument("--mfu", type=float, default=1.0, help="achievable share of peak FLOP/s assumed (default 1)")
    plan.add_argument("--mbu", type=float, default=1.0, help="achievable share of bandwidth assumed (default 1)")
    plan.add_argument("--json", action="store_true", help="one flat JSON object in SI units")
    plan.add_argument("--measure", action="store_true",
                      help="also run the engine here for this shape and compare (a small model on a CPU); with "
                      "--tp/--pp it starts the other ranks here and compares their communication too")
    plan.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                      help="the engine's working dtype for --measure (default auto: bf16 on a CPU with bf16 "
                      "arithmetic, else float32; GGUF Q4_0/Q4_1/Q5_x/Q8_0 and K-quant linears stay packed unless float32 "
                      "is named)")
    plan.add_argument("--speculative-config", type=parse_json_object, default=None, metavar="JSON",
                      help="plan a speculating engine: the same dict as `tuili serve --speculative-config` "
                      "('{\"method\": \"ngram\", \"num_speculative_tokens\": 4}', a draft \"model\", or "
                      "\"mtp\"); decode steps then verify k proposals each, and the plan prints decode tokens/s "
                      "with and without speculation side by side")
    plan.add_argument("--spec-acceptance", type=float, default=None, metavar="A",
                      help="assumed probability that the target keeps each proposed token, in [0, 1] "
                      f"(default {DEFAULT_ACCEPTANCE}); a step then yields (1 - A^(k+1)) / (1 - A) tokens per sequence")
    plan.add_argument("--list-hardware", action="store_true", help="list hardware presets and links with sources")
    plan.set_defaults(func=run_plan)

    probe = subparsers.add_parser(
        "probe", help="measure this machine's memory bandwidth and matmul throughput",
        description="Measure memory bandwidth (read, copy) and matmul throughput per dtype at large and "
        "decode-like shapes; print a table and save a spec that `tuili plan` and the engine's MFU/MBU use.",
    )
    probe.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when present)")
    probe.add_argument("--quick", action="store_true", help="fewer shapes and repeats: a few seconds")
    probe.add_argument("--no-save", action="store_true", help="print only; keep the saved spec as it is")
    probe.add_argument("--json", action="store_true", help="print the spec as JSON")
    probe.set_defaults(func=run_probe)


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_plan(args: argparse.Namespace) -> int:
    from tuili.perf import hardware as hw

    try:
        if args.list_hardware:
            print(_format_presets(hw.PRESETS, hw.LINKS))
            return 0
        from tuili.perf.checkpoint import ModelSource, read_config, read_model
        from tuili.perf.cost import ModelCost
        from tuili.perf.formats import canonical_dtype, weight_format
        from tuili.perf.plan import DEFAULT_RESERVE_FRACTION, PlanInputs, make_plan
        from tuili.perf.resolve import current_hardware

        device = _device(args.device)
        if args.config:
            source = ModelSource(args.config, read_config(args.config), None)
        else:
            if args.model is None:
                from tuili.models.default_model import default_model_path

                args.model = str(default_model_path())
            source = read_model(args.model)
        cost = ModelCost.from_config(source.config)
        spec = current_hardware(device, args.hardware)
        if args.weights:
            storage = weight_format(args.weights)
        else:
            storage = source.weights or weight_format("bf16")
        speculation = None
        if args.speculative_config is not None:
            from tuili.perf.speculation import speculation_for

            acceptance = DEFAULT_ACCEPTANCE if args.spec_acceptance is None else args.spec_acceptance
            speculation = speculation_for(args.speculative_config, acceptance, source.config, storage)
        elif args.spec_acceptance is not None:
            raise TuiliError(f"--spec-acceptance {args.spec_acceptance} is the acceptance of speculative decoding: "
                             f"add --speculative-config, or drop it")
        inputs = PlanInputs(
            weights=storage, speculation=speculation, kv_dtype=canonical_dtype(args.kv), gpus=args.gpus or args.tp * args.pp, tp=args.tp, pp=args.pp,
            context=args.context or args.prompt + args.output, prompt=args.prompt, output=args.output,
            batch=args.batch, link=hw.link(args.link) if args.link else None,
            reserve_fraction=DEFAULT_RESERVE_FRACTION if args.reserve is None else args.reserve,
            mfu=args.mfu, mbu=args.mbu,
        )
        if args.dtype != "auto" and not args.measure:
            raise TuiliError(
                f"--dtype {args.dtype} sets the engine's dtype for --measure: add --measure, or drop it"
            )
        if args.measure:
            from tuili.perf.measure import format_measurement, measure

            if args.config:
                raise TuiliError("--measure runs the model, so it needs --model (a checkpoint), not --config")
            # This machine's own rates drift with its load: take them again around the runs.
            # A preset or a spec file is a fixed reference and stays as given.
            refresh = None
            if spec.origin in ("probe", "estimate"):
                from tuili.perf.probe import refresh_rates

                def refresh(packed_formats: Collection[str]) -> hw.HardwareSpec:
                    return refresh_rates(spec, device, packed_formats)
            report = measure(source, cost, spec, inputs, device, args.dtype, refresh)
            print(json.dumps(report.as_dict(), indent=2) if args.json else format_measurement(report))
            return 0
        plan = make_plan(cost, spec, inputs)
    except TuiliError as e:
        print(f"tuili: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from tuili.perf.hardware import save_probe
    from tuili.perf.probe import probe

    try:
        device = _device(args.device)
        spec, results = probe(device, quick=args.quick)
        path = None if args.no_save else save_probe(spec, device)
    except TuiliError as e:
        print(f"tuili: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(spec.to_dict(), indent=2))
    else:
        print(f"{spec.name}: {_gib(spec.memory_bytes)} memory")
        width = max(len(m.name) for m in results)
        for m in results:
            if m.unit == "B/s":
                value = f"{m.value / 1e9:10.2f} GB/s   "
            elif m.unit == "s" and m.value < 1e-6:
                value = f"{m.value * 1e9:10.4f} ns     "
            elif m.unit == "s":
                value = f"{m.value * 1e6:10.1f} µs     "
            else:
                value = f"{m.value / 1e12:10.3f} TFLOP/s"
            print(f"  {m.name:<{width}}  {value}  ({m.seconds * 1e3:.2f} ms per run)")
    if path is not None:
        print(f"saved to {path}: `tuili plan` and the engine's MFU/MBU use it on this machine", file=sys.stderr)
    return 0


# ---- formatting ---------------------------------------------------------------------------------

def _si(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def format_plan(p: dict) -> str:
    tp, pp = p["tp"], p["pp"]
    lines = [
        ("model", f"{p['model_type']}: {_si(p['params_total'], '')} params, {_si(p['params_matmul'], '')} in matmuls, "
                  f"{_si(p['params_active'], '')} active per token"),
        ("weights", f"{p['weights_format']}: {_si(p['weights_bytes'], 'B')}"
                    + (f", {_si(p['weights_bytes_per_device'], 'B')} per device" if tp > 1 or pp > 1 else "")
                    + (f" (stages: {', '.join(_si(b, 'B') for b in p['weights_bytes_per_stage'])})" if pp > 1 else "")),
        ("KV cache", f"{p['kv_dtype']}: {_si(p['kv_bytes_per_token'], 'B')}/token, "
                     f"{_si(p['kv_bytes_per_request'], 'B')} per {p['context_tokens']}-token request"
                     + (f"; state {_si(p['state_bytes_per_request'], 'B')} per request" if p["state_bytes_per_request"] else "")
                     + (f"; prefix-cache state checkpoints {_si(p['state_checkpoint_bytes_per_device'], 'B')} per device"
                        if p["state_checkpoint_bytes_per_device"] else "")),
        ("hardware", f"{p['hardware']} [{p['hardware_origin']}]: {_si(p['peak_flops_per_device'], 'FLOP/s')} "
                     f"{p['compute_dtype']}, {_si(p['memory_bandwidth_per_device'], 'B/s')}, "
                     f"{_gib(p['memory_bytes_per_device'])} — {p['hardware_source']}"),
        ("capacity", f"{p['gpus']} device(s), TP {tp}{f', PP {pp}' if pp > 1 else ''}: {p['max_concurrent_requests']} concurrent requests of "
                     f"{p['context_tokens']} tokens ({p['reserve_fraction']:.0%} = {_gib(p['reserve_bytes_per_device'])} "
                     f"per device reserved for activations and runtime)"),
        ("prefill", f"{p['prompt_tokens']} tokens: {_si(p['prefill_flops'], 'FLOP')} -> TTFT {_seconds(p['ttft_seconds'])}"
                    + _split(p["prefill_roofline_seconds"], p["prefill_dequant_seconds"],
                             p["prefill_overhead_seconds"])),
        ("decode", f"batch {p['batch']} at {p['context_tokens']} tokens: {_si(p['decode_step_bytes'], 'B')}"
                   f"{' per device' if tp > 1 else ''} per step -> {_seconds(p['decode_step_seconds'])}/step"
                   + _split(p["decode_step_roofline_seconds"], p["decode_step_dequant_seconds"],
                            p["decode_step_overhead_seconds"])
                   + f", {p['decode_tokens_per_second']:.1f} tokens/s"),
        *_speculative_lines(p),
        ("overhead", _overhead_line(p)),
        ("compute-bound", "never (KV reads grow as fast as compute)" if p["compute_bound_batch"] is None
                          else f"from batch {p['compute_bound_batch']:.1f}"),
        ("end to end", f"{p['prompt_tokens']} + {p['output_tokens']} tokens: {_seconds(p['e2e_seconds'])}"
                       + (f" ({_seconds(p['spec_e2e_seconds'])} speculating)" if p["speculative_method"] else "")),
    ]
    if tp > 1:
        lines.append(("all-reduce", f"{_si(p['allreduce_bytes_per_step'], 'B')} per device per step over "
                                    f"{p['link']}: {_seconds(p['allreduce_seconds_per_step'])}"))
    if pp > 1:
        over = (f" over {p['link']}: {_seconds(p['stage_transfer_seconds_per_step'])}"
                if p["stage_transfer_seconds_per_step"] is not None else " (no link named: give --link for its time)")
        lines.append(("stage transfer", f"{_si(p['stage_transfer_bytes_per_step'], 'B')} per decode step between "
                                        f"{pp} stages (hidden states on, logits back){over}"))
    if p["kv_transfer_seconds"] is not None:
        lines.append(("KV transfer", f"one {p['prompt_tokens']}-token prompt's KV ({_si(p['kv_transfer_bytes'], 'B')}) "
                                     f"over {p['link']}: {_seconds(p['kv_transfer_seconds'])}"))
    if p["assumed_mfu"] != 1 or p["assumed_mbu"] != 1:
        lines.append(("assumed", f"MFU {p['assumed_mfu']:.0%}, MBU {p['assumed_mbu']:.0%} of peak"))
    if p["hardware_origin"] == "estimate":
        lines.append(("note", "the hardware figures are a quick estimate: run `tuili probe` for measured ones"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


def _speculative_lines(p: dict) -> list[tuple[str, str]]:
    """The speculation line and its table: decode tokens/s without and with speculation per batch."""
    if p["speculative_method"] is None:
        return []
    k, tokens = p["num_speculative_tokens"], p["spec_tokens_per_step"]
    proposer = (f"{_seconds(p['spec_proposer_seconds'])} proposing ({k} forwards, "
                f"{_si(p['spec_proposer_bytes'], 'B')}) + " if p["spec_proposer_seconds"] else "")
    lines = [
        ("speculation", f"{p['speculative_method']}, k={k}, assumed acceptance {p['spec_acceptance']:g}: "
                        f"{tokens:.2f} tokens per sequence per step; batch {p['batch']}: {proposer}"
                        f"{_seconds(p['spec_verify_step_seconds'])} verifying ({k + 1} rows per sequence, "
                        f"{_si(p['spec_verify_step_bytes'], 'B')}) -> {p['spec_decode_tokens_per_second']:.1f} "
                        f"tokens/s, {p['spec_speedup']:.2f}x"),
    ]
    if p["proposer_weights_bytes"] or p["proposer_bytes_per_request"]:
        lines.append(("proposer memory", f"{_si(p['proposer_weights_bytes'], 'B')} of weights, "
                                         f"{_si(p['proposer_bytes_per_request'], 'B')} of KV and state per request; "
                                         f"the engine's kv_cache_memory for its own pool: "
                                         f"{_si(p['kv_cache_memory_bytes'], 'B')}"))
    header = f"{'batch':>6} {'step':>10} {'tokens/s':>10} {'spec step':>10} {'tokens/s':>10} {'speedup':>8}"
    lines += [("decode tokens/s", "without, then with speculation (a speedup below 1: it does not pay)"), ("", header)]
    for row in p["spec_by_batch"]:
        lines.append(("", f"{row['batch']:>6} {_seconds(row['step_seconds']):>10} {row['tokens_per_second']:>10.1f} "
                          f"{_seconds(row['speculative_step_seconds']):>10} "
                          f"{row['speculative_tokens_per_second']:>10.1f} {row['speedup']:>7.2f}x"))
    return lines


def _split(roofline: float, dequant: float, overhead: float) -> str:
    if not (dequant or overhead):
        return ""
    return (f" (roofline {_seconds(roofline)}" + (f" + dequantization {_seconds(dequant)}" if dequant else "")
            + f" + host overhead {_seconds(overhead)})")


def _overhead_line(p: dict) -> str:
    from tuili.perf.overhead import HOST_KEYS

    if not any(p[f"host_overhead_seconds_{k}"] for k in HOST_KEYS):
        return (f"none counted: {p['hardware']} has no measured host overhead (a datasheet preset or a probe "
                f"from before it was measured), so times are the roofline floor, which an eager engine does "
                f"not reach; `tuili probe` on the machine measures it")
    measured = ", ".join(f"{k} {_seconds(p[f'host_overhead_seconds_{k}'])}" for k in HOST_KEYS
                         if p[f"host_overhead_seconds_{k}"])
    return (f"{_seconds(p['decode_step_overhead_seconds'])} per decode step, "
            f"{_seconds(p['prefill_overhead_seconds'])} in the prefill, {_seconds(p['e2e_overhead_seconds'])} "
            f"end to end (per step and per layer, measured: {measured})")


def _format_presets(presets: dict, links: dict) -> str:
    out = ["hardware presets (dense peak FLOP/s per dtype, memory bandwidth, memory, interconnect):"]
    for name, spec in presets.items():
        flops = ", ".join(f"{d} {v / 1e12:g}T" for d, v in spec.peak_flops.items())
        out.append(f"  {name:<16} {flops}; {spec.memory_bandwidth / 1e9:g} GB/s; {_gib(spec.memory_bytes)}; "
                   f"{spec.interconnect}\n  {'':<16} source: {spec.source}")
    out.append("links (bytes/s per direction, typical latency):")
    for name, link in links.items():
        out.append(f"  {name:<16} {link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} µs — {link.source}")
    return "\n".join(out)
