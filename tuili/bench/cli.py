"""`tuili bench`: load-test an OpenAI-compatible endpoint; `tuili bench compare a.json b.json`."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from tuili.errors import TuiliError


def _sweep(text: str) -> tuple[str, list[float]]:
    """"concurrency", "rate", or either with explicit values: "concurrency=1,2,4"."""
    kind, _, values = text.partition("=")
    if kind not in ("concurrency", "rate"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected concurrency or rate, optionally =V1,V2,...")
    try:
        return kind, [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the values after '=' must be numbers") from None


def _rate(text: str) -> float:
    try:
        return float(text)  # float() reads "inf" too
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected requests per second, or inf") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


def register(subparsers) -> None:
    """Add `bench` (and its `compare` form) to the `tuili` parser."""
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server: latency percentiles, goodput, utilization",
        description="Load-test any OpenAI-compatible endpoint (tuili serve, vLLM, SGLang, ...) with "
                    "streaming requests and report TTFT, TPOT, ITL and E2EL percentiles, throughput, "
                    "goodput under SLOs, failures by kind and, given the hardware and model config, "
                    "prefill MFU and decode MBU. Every metric is defined in docs/bench.md. "
                    "`tuili bench compare A.json B.json` prints two saved runs side by side.")
    p.set_defaults(func=run_command)
    target = p.add_argument_group("server")
    target.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    target.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a request counts as failed with 'timeout' (default: %(default)s)")
    target.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos=true (vLLM / tuili) so every request generates its max_tokens")
    target.add_argument("--extra-body", type=_json_object, metavar="JSON",
                        help='fields merged into every request body, e.g. \'{"temperature": 0}\'')

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "file"),
                      help="random (default), shared-prefix, multi-turn, or file (with --dataset)")
    work.add_argument("--dataset", metavar="PATH",
                      help="JSONL of {prompt} / {messages} / ShareGPT {conversations} records (or a JSON array)")
    work.add_argument("--input-len", type=int, default=256, help="prompt (or question, or turn) tokens, mean")
    work.add_argument("--output-len", type=int, default=128, help="max_tokens of each request, mean")
    work.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s)")
    work.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: K system prompts")
    work.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: P tokens per system prompt")
    work.add_argument("--questions-per-prefix", type=int, default=16, help="shared-prefix: N questions each")
    work.add_argument("--turns", type=int, default=5, help="multi-turn: user turns per conversation")
    work.add_argument("--tokenizer", metavar="PATH",
                      help="local tokenizer.json (or a directory with one): checks prompts when the server "
                           "has no /tokenize, and counts tokens when a stream carries no usage")
    work.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int,
                      help="closed loop of N requests in flight (default 1); with --request-rate, a cap")
    load.add_argument("--request-rate", type=_rate,
                      help="open loop: Poisson arrivals at R requests (conversations) per second; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the Gamma arrival gaps: 1 Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--sweep", type=_sweep, metavar="concurrency|rate[=V1,V2,...]",
                      help="run several load points: the values given, or doubling (from 1, or from "
                           "--request-rate) until throughput stops growing by 10%% or the server falls "
                           "behind 90%% of the offered rate")
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    load.add_argument("--num-requests", type=int,
                      help="requests per load point (default 100, or the workload's own size, "
                           "unless --duration bounds the run)")
    load.add_argument("--duration", type=float, help="seconds per load point after which no request starts")

    report = p.add_argument_group("report")
    report.add_argument("--slo", metavar="ttft_ms=..,tpot_ms=..,e2el_ms=..",
                        help="latency limits for goodput (requests per second meeting all of them)")
    report.add_argument("--percentiles", default="",
                        help="more percentiles besides 50, 90 and 99, e.g. 95,99.9")
    report.add_argument("--hardware", metavar="NAME|spec.json",
                        help="hardware preset or spec (tuili plan's) to report MFU and MBU against")
    report.add_argument("--model-config", metavar="PATH",
                        help="the served model: its config.json, checkpoint directory or GGUF file "
                             "(default: the path a server on this machine gives in /v1/models, as tuili serve does)")
    report.add_argument("--weights", metavar="FORMAT",
                        help="weight storage for MBU (bf16, fp8, int8, int4, q4_1, ...; default: the "
                             "checkpoint's real bytes, or bf16 for a bare config.json)")
    report.add_argument("--kv-dtype", default="bf16", help="KV cache dtype for MBU (default: %(default)s)")
    report.add_argument("--devices", type=int, default=1,
                        help="devices the server runs on (tensor parallel): peaks scale with it")
    report.add_argument("--metrics-prefix", default="tuili:",
                        help="prefix of the server's /metrics samples to show (default: %(default)s)")
    report.add_argument("--output", metavar="results.json",
                        help="write the configuration, summaries and every request's timings")
    report.add_argument("--plot", metavar="DIR", help="write PNG charts (needs matplotlib)")
    report.add_argument("--no-progress", action="store_true", help="no live progress bar")

    sub = p.add_subparsers(dest="bench_command", metavar="compare")
    compare = sub.add_parser("compare", help="print two saved runs side by side with ratios",
                             description="Print two `tuili bench --output` files side by side: each "
                                         "load point's throughputs and latencies and the ratio B / A.")
    compare.add_argument("a", help="the first results.json (A)")
    compare.add_argument("b", help="the second results.json (B)")
    compare.set_defaults(func=compare_command)


def config_from_args(args: argparse.Namespace):
    from tuili.bench.metrics import parse_percentiles, parse_slo
    from tuili.bench.runner import BenchConfig

    if not args.base_url:
        raise TuiliError("--base-url is required: the server to benchmark, e.g. http://127.0.0.1:8000")
    sweep, sweep_values = args.sweep or (None, [])
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        workload=args.workload or ("file" if args.dataset else "random"), input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len, questions_per_prefix=args.questions_per_prefix, turns=args.turns,
        dataset=args.dataset, tokenizer=args.tokenizer, concurrency=args.concurrency,
        request_rate=args.request_rate, burstiness=args.burstiness, sweep=sweep, sweep_values=sweep_values,
        warmup=args.warmup, num_requests=args.num_requests, duration=args.duration,
        slo=parse_slo(args.slo) if args.slo else None, percentiles=parse_percentiles(args.percentiles),
        timeout=args.timeout, ignore_eos=args.ignore_eos, extra_body=args.extra_body, seed=args.seed,
        hardware=args.hardware, model_config=args.model_config, weights=args.weights,
        kv_dtype=args.kv_dtype, devices=args.devices, metrics_prefix=args.metrics_prefix,
        progress=not args.no_progress and sys.stderr.isatty())


def run_command(args: argparse.Namespace) -> int:
    from tuili.bench import report
    from tuili.bench.runner import run_benchmark

    try:
        config = config_from_args(args)
        if args.plot:
            from tuili.bench.plots import require_matplotlib

            require_matplotlib()
        result = run_benchmark(config)
    except TuiliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: the server stopped answering while the workload was prepared: {exc!r}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(report.render(result))
    if args.output:
        report.write_result(result, args.output)
        print(f"\nresults written to {args.output}")
    if args.plot:
        from tuili.bench.plots import write_plots

        for path in write_plots(result, args.plot):
            print(f"plot written to {path}")
    if result["stopped_early"]:
        print(f"\nthe run stopped early: {result['stopped_early']}", file=sys.stderr)
        return 1
    if not any(run["summary"]["completed"] for run in result["runs"]):
        print("\nno request completed", file=sys.stderr)
        return 1
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from tuili.bench import report

    try:
        a, b = report.read_result(args.a), report.read_result(args.b)
    except TuiliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.render_compare(a, b, (args.a, args.b)))
    return 0

