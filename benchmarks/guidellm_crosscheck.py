"""tuili bench cross-checked by guidellm: the same workload on the same tuili server, measured by both.

One `tuili serve` process (the embedded SmolLM2 by default) is warmed up, then measured by
`tuili bench` and by guidellm (vLLM's load tester, an independent implementation) with the same
workload: closed loop at --concurrency, --num-requests requests whose prompt and output lengths are
drawn uniformly from the integers in [len*(1-r), len*(1+r)] around --input-len and --output-len
(r = --range-ratio; both tools define the range so), with ignore_eos so that every request makes
exactly its output length.

By default the two tools run at the same time, each with the whole workload (so the server holds
2 x concurrency requests): both then measure the very same engine steps, and a server that runs
faster or slower from one minute to the next (other work on a shared machine moves a CPU
server's step time by tens of percent) cannot pass for a disagreement between the tools. The
lengths must vary for this (the default r = 0.5): with fixed lengths the two closed loops lock
into a fixed phase, one tool's requests always arriving in the middle of the other's decode, and
the tools then measure different things. tuili bench starts when the server sees guidellm's first
request. `--apart` runs them one after the other instead, in the order tuili, guidellm, guidellm,
tuili, ... (--rounds per tool).

The script prints each tool's TTFT and inter-token medians, the server's own view from /metrics
(requests and tokens it served, prefix-cache hits, its own mean TTFT and inter-token latency),
then the mean of each tool's medians over the rounds and their ratios (the issue's goal: within 10%).

The two tools name their inter-token figures differently (docs/bench.md, section 1): guidellm's
"ITL" is one value per request, (last token's arrival - first token's) / (output tokens - 1),
which is tuili's TPOT, (E2EL - TTFT) / (output tokens - 1), but for the short tail from the last
token to `[DONE]`; so TPOT is the figure checked against it. tuili's ITL pools every single gap
between chunks: its median is the typical decode step, below the per-request means whenever some
steps also carry another request's prefill. It is shown, not checked.

guidellm needs torch, which this project pins, so it goes in a venv that sees the system's
packages (nothing of ours is upgraded; guidellm's own dependencies go in the venv), and it needs a
tokenizer for its synthetic prompts: the embedded GGUF's, saved once as a local directory by
transformers, so nothing is downloaded (HF_HUB_OFFLINE is set for it too):

    python -m venv --system-site-packages ~/.cache/tuili-bench/guidellm-venv
    ~/.cache/tuili-bench/guidellm-venv/bin/pip install guidellm
    python benchmarks/guidellm_crosscheck.py         # 2 streams and 32 requests each, 64-192 -> 16-48 tokens
    python benchmarks/guidellm_crosscheck.py --apart --concurrency 4 --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import CACHE, machine, start_server  # noqa: E402

from tuili.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from tuili.bench.server_metrics import parse_metrics  # noqa: E402

GUIDELLM = CACHE / "guidellm-venv" / "bin" / "guidellm"


def smollm2_tokenizer_dir() -> Path:
    """The embedded GGUF's tokenizer as a Hugging Face directory, written once by transformers."""
    path = CACHE / "smollm2-tokenizer"
    if not (path / "tokenizer.json").exists():
        import transformers

        from tuili.models.default_model import default_model_path

        gguf = default_model_path()
        transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return path


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--max-num-seqs", str(2 * args.concurrency), "--max-model-len", "2048"]
    return flags + (["--model", args.model] if args.model else [])


class ServerView:
    """The server's counters over one phase: what it served and its own latency means."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        samples = parse_metrics(httpx.get(f"{self.url}/metrics", trust_env=False).text, "tuili:")
        totals: dict[str, float] = {}
        for key, (_, value) in samples.items():
            name = key.split("{")[0]
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def prompt_tokens(self) -> float:
        """Prompt tokens the server has accepted since this view began."""
        return self._read()["tuili:prompt_tokens_total"] - self.before["tuili:prompt_tokens_total"]

    def finish(self) -> dict[str, float]:
        after = self._read()
        d = {name: after[name] - self.before.get(name, 0.0) for name in after}

        def mean_ms(histogram: str) -> float:
            return d[f"{histogram}_sum"] / d[f"{histogram}_count"] * 1e3 if d[f"{histogram}_count"] else float("nan")

        return {
            "requests": d["tuili:e2e_request_latency_seconds_count"],
            "prompt_tokens": d["tuili:prompt_tokens_total"],
            # Prompt tokens the server was given minus those its prefills computed: prefix-cache hits.
            "cached_tokens": d["tuili:prompt_tokens_total"] - d["tuili:prefill_tokens_total"],
            "generation_tokens": d["tuili:generation_tokens_total"],
            "ttft_mean_ms": mean_ms("tuili:time_to_first_token_seconds"),
            "itl_mean_ms": mean_ms("tuili:inter_token_latency_seconds"),
        }


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """The integers lengths are drawn from, as docs/bench.md defines them (and vLLM's benchmark)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    return low, max(low, math.ceil(mean * (1 + range_ratio)))


def tuili_phase(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    config = BenchConfig(base_url=url, model=model, concurrency=args.concurrency, num_requests=args.num_requests,
                         input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                         ignore_eos=True, seed=seed)
    s = run_benchmark(config)["runs"][0]["summary"]
    return {"completed": s["completed"], "failed": s["failed"], "ttft_ms": s["ttft_ms"]["p50"],
            "itl_ms": s["itl_ms"]["p50"], "tpot_ms": s["tpot_ms"]["p50"],
            "prompt_tokens": s["input_tokens"] / max(s["completed"], 1),
            "output_tokens": s["output_tokens"] / max(s["completed"], 1)}


class GuideLLMRun:
    """One `guidellm run` subprocess with the crosscheck's workload; `result()` waits and reads its report."""

    def __init__(self, url: str, model: str, tokenizer: Path, args: argparse.Namespace, seed: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="guidellm-")
        self._report = Path(self._dir.name) / "benchmarks.json"
        # Every option as JSON, so that paths and names need no escaping.
        options = {
            "--backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions"},
            "--profile": {"kind": "concurrent", "streams": args.concurrency},
            "--constraint": {"kind": "max_requests", "count": args.num_requests},
            "--tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            # With min and max but no stdev, guidellm draws uniformly from the integers in [min, max].
            "--data": {"kind": "synthetic_text", "prompt_tokens": args.input_len, "output_tokens": args.output_len,
                       **dict(zip(("prompt_tokens_min", "prompt_tokens_max"),
                                  length_range(args.input_len, args.range_ratio), strict=True)),
                       **dict(zip(("output_tokens_min", "output_tokens_max"),
                                  length_range(args.output_len, args.range_ratio), strict=True))},
            "--seed": {"kind": "static", "value": seed},
            "--output": {"kind": "json", "path": str(self._report)},
        }
        command = [str(args.guidellm), "run", "--disable-progress"]
        for flag, value in options.items():
            command += [flag, json.dumps(value)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "GUIDELLM__DEFAULT_RESULTS_DIR": self._dir.name}
        self._log = (Path(self._dir.name) / "guidellm.log").open("w+")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        cwd=self._dir.name)

    def result(self) -> dict:
        try:
            if self.process.wait() != 0 or not self._report.exists():
                self._log.seek(0)
                sys.exit(f"guidellm failed ({self.process.returncode}):\n{self._log.read()[-4000:]}")
            metrics = json.loads(self._report.read_text())["benchmarks"][0]["metrics"]
        finally:
            self._log.close()
            self._dir.cleanup()

        def median(metric: str) -> float:
            return metrics[metric]["successful"]["median"]

        totals = metrics["request_totals"]
        return {"completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
                "ttft_ms": median("time_to_first_token_ms"), "itl_ms": median("inter_token_latency_ms"),
                "prompt_tokens": metrics["prompt_token_count"]["successful"]["mean"],
                "output_tokens": metrics["output_token_count"]["successful"]["mean"]}


def show_tool(name: str, figures: dict) -> None:
    tpot = f", TPOT {figures['tpot_ms']:.1f}" if "tpot_ms" in figures else ""
    print(f"{name:>8}: {figures['completed']} completed, {figures['failed']} failed, "
          f"{figures['prompt_tokens']:.1f} prompt / {figures['output_tokens']:.1f} output tokens per request; "
          f"medians (ms): TTFT {figures['ttft_ms']:.1f}, ITL {figures['itl_ms']:.1f}{tpot}")


def show_server(server: dict) -> None:
    print(f"{'server':>8}: {server['requests']:.0f} requests, {server['prompt_tokens']:.0f} prompt tokens "
          f"({server['cached_tokens']:.0f} from its prefix cache), {server['generation_tokens']:.0f} generated; "
          f"its own means (ms): TTFT {server['ttft_mean_ms']:.1f}, ITL {server['itl_mean_ms']:.1f}")


def ratio_line(label: str, ours: float, theirs: float, goal: float) -> bool:
    ratio = ours / theirs
    ok = abs(ratio - 1) <= goal
    print(f"  {label:<31} tuili {ours:8.1f} ms   guidellm {theirs:8.1f} ms   ratio {ratio:.3f}  "
          f"{'within' if ok else 'OUTSIDE'} {goal:.0%}")
    return ok


def measure_together(url: str, model: str, tokenizer: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Both tools at once, each with the whole workload: they measure the same server steps."""
    phases: dict[str, list[dict]] = {"tuili": [], "guidellm": []}
    for round_ in range(args.rounds):
        view = ServerView(url)
        # Each run its own seed: prompts another run sent would hit the prefix cache.
        theirs = GuideLLMRun(url, model, tokenizer, args, seed=2 * round_ + 1)
        # guidellm takes seconds to import and plan; tuili bench starts with its first request.
        while view.prompt_tokens() == 0:
            if theirs.process.poll() is not None:
                break  # it failed: result() says why
            time.sleep(0.02)
        phases["tuili"].append(tuili_phase(url, model, args, seed=2 * round_ + 2))
        phases["guidellm"].append(theirs.result())
        show_tool("tuili", phases["tuili"][-1])
        show_tool("guidellm", phases["guidellm"][-1])
        show_server(view.finish())
    return phases


def measure_apart(url: str, model: str, tokenizer: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    """One tool after the other, in the order tuili, guidellm, guidellm, tuili, ..."""
    phases: dict[str, list[dict]] = {"tuili": [], "guidellm": []}
    for phase in range(2 * args.rounds):
        tool = "tuili" if phase % 4 in (0, 3) else "guidellm"
        view = ServerView(url)
        if tool == "tuili":
            figures = tuili_phase(url, model, args, seed=phase + 1)
        else:
            figures = GuideLLMRun(url, model, tokenizer, args, seed=phase + 1).result()
        show_tool(tool, figures)
        show_server(view.finish())
        phases[tool].append(figures)
    return phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Hugging Face tokenizer directory for guidellm (default: --model when it is a "
                             "directory, else the embedded GGUF's tokenizer saved once under the bench cache)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm executable (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight, per tool (default 2)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths uniform in [len*(1-r), len*(1+r)] (default 0.5)")
    parser.add_argument("--apart", action="store_true",
                        help="run the tools one after the other (tuili, guidellm, guidellm, tuili, ...) "
                             "instead of at the same time")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs per tool (default: 1 together, 2 apart)")
    parser.add_argument("--goal", type=float, default=0.10, help="largest relative difference accepted (default 0.10)")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.apart else 1)
    if not args.guidellm.exists():
        sys.exit(f"guidellm is not at {args.guidellm}: install it as this script's docstring says, or pass --guidellm")
    tokenizer = args.tokenizer or (Path(args.model) if args.model and Path(args.model).is_dir()
                                   else smollm2_tokenizer_dir())

    print(f"machine: {machine()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    process, url, log = start_server(server_flags(args))
    try:
        model = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
        print(f"workload per tool: {args.num_requests} requests, {args.concurrency} in flight, prompt tokens in "
              f"{list(length_range(args.input_len, args.range_ratio))} -> output tokens in "
              f"{list(length_range(args.output_len, args.range_ratio))} (ignore_eos), /v1/completions on {model}; "
              f"the tools run {'one after the other' if args.apart else 'at the same time'}")
        # Warm-up (not measured): the first steps of a fresh server pay for allocation and caching.
        run_benchmark(BenchConfig(base_url=url, model=model, concurrency=2 * args.concurrency,
                                  num_requests=2 * args.concurrency, input_len=args.input_len,
                                  output_len=args.output_len, ignore_eos=True, seed=0))
        phases = (measure_apart if args.apart else measure_together)(url, model, tokenizer, args)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        log.unlink()

    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    def mean(tool: str, key: str) -> float:
        return statistics.fmean(figures[key] for figures in phases[tool])

    print(f"medians (the mean over {args.rounds} run(s) per tool), tuili bench / guidellm:")
    ok = ratio_line("TTFT", mean("tuili", "ttft_ms"), mean("guidellm", "ttft_ms"), args.goal)
    ok &= ratio_line("TPOT (tuili) vs ITL (guidellm)", mean("tuili", "tpot_ms"), mean("guidellm", "itl_ms"), args.goal)
    ratio = mean("tuili", "itl_ms") / mean("guidellm", "itl_ms")
    print(f"  (not checked: tuili's pooled ITL median {mean('tuili', 'itl_ms'):.1f} ms is {ratio:.3f} x guidellm's "
          "per-request ITL; a different definition, see the docstring)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
