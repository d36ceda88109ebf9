"""`tuili serve` against offline `LLM.generate`: output tokens/s for the same requests.

32 streaming clients (by default) each send one completions request at once to a real `tuili
serve` process (different prompts, greedy, ignore_eos so every request makes exactly
--max-tokens tokens); then the same requests run through `LLM.generate` in this process, all
submitted at once, with the same engine flags. Each side runs --repeat times and its fastest
run counts, which damps noise from other work on the machine. The ratio server / offline is the share of the
engine's throughput the HTTP layer (request handling, SSE encoding, the hand-off between the
engine thread and the event loop) leaves. The issue's bar is 80%.

    python benchmarks/server.py                     # embedded model, 32 clients x 128 tokens
    python benchmarks/server.py --max-tokens 32     # a quicker run
    python benchmarks/server.py --model PATH --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
from common import start_server  # noqa: E402


def prompts(count: int) -> list[str]:
    topics = ["the sea", "a mountain", "bread", "a violin", "the moon", "trains", "a library", "winter"]
    return [f"Request {i}: write a short paragraph about {topics[i % len(topics)]}." for i in range(count)]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--max-num-seqs", str(max(args.clients, 1))]
    return flags + (["--model", args.model] if args.model else [])


async def stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> int:
    """Stream one completion; return its completion token count (from the usage chunk)."""
    stream = await client.completions.create(
        model=None, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def step_seconds(metrics_text: str) -> float:
    """Seconds the engine spent in its forward steps, from the utilization meter's counters."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name in ("tuili:prefill_seconds_total", "tuili:decode_seconds_total")
    )


async def run_clients(url: str, texts: list[str], max_tokens: int, repeat: int) -> tuple[int, float, float]:
    """(tokens, wall seconds, engine step seconds) of the fastest of `repeat` runs of all
    clients streaming at once."""
    async with (
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await stream_one(client, "warm up", 4)
        runs = []
        for _ in range(repeat):
            steps_before = step_seconds((await http.get("/metrics")).text)
            start = time.perf_counter()
            counts = await asyncio.gather(*(stream_one(client, text, max_tokens) for text in texts))
            seconds = time.perf_counter() - start
            steps = step_seconds((await http.get("/metrics")).text) - steps_before
            runs.append((sum(counts), seconds, steps))
        return min(runs, key=lambda run: run[1] / run[0])


def report(name: str, tokens: int, seconds: float, steps: float) -> float:
    print(f"{name}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} output tok/s "
          f"(engine steps {steps:.2f}s, {steps / seconds:.0%} of the time)")
    return tokens / seconds


def server_throughput(args: argparse.Namespace, texts: list[str]) -> float:
    process, url, log = start_server(engine_flags(args))
    try:
        tokens, seconds, steps = asyncio.run(run_clients(url, texts, args.max_tokens, args.repeat))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        log.unlink()
    return report("server ", tokens, seconds, steps)


def offline_throughput(args: argparse.Namespace, texts: list[str]) -> float:
    from tuili import LLM, SamplingParams
    from tuili.perf.meter import UtilizationMeter

    llm = LLM(model=args.model, device=args.device, max_num_seqs=max(args.clients, 1))
    meter = UtilizationMeter.for_engine(llm.engine)  # for its step times: the seconds of the forwards
    llm.engine.add_observer(meter)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(args.repeat):
        steps_before = meter.prefill_seconds + meter.decode_seconds
        start = time.perf_counter()
        results = llm.generate(texts, params)
        seconds = time.perf_counter() - start
        steps = meter.prefill_seconds + meter.decode_seconds - steps_before
        runs.append((sum(len(c.token_ids) for r in results for c in r.outputs), seconds, steps))
    return report("offline", *min(runs, key=lambda run: run[1] / run[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; the fastest counts (default 3)")
    args = parser.parse_args()

    texts = prompts(args.clients)
    # The server first, in its own process, then offline here: never both on the device at once.
    served = server_throughput(args, texts)
    offline = offline_throughput(args, texts)
    print(f"server / offline = {served / offline:.1%} ({args.clients} streaming clients, {args.max_tokens} tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
