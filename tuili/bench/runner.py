"""A benchmark from its configuration to its result: connect, build the workload, warm up, run each
load point (one, or a sweep up to saturation), and gather summaries, server counters and utilization.

The result is a JSON-ready dict: {"format", "config", "runs": [{"load", "summary", "server_metrics",
"utilization", "server_utilization", "server_speculation", "stopped_early", "requests"}],
"stopped_early"};
docs/bench.md describes every field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tuili.bench import server_metrics
from tuili.bench.client import OpenAIStreamClient
from tuili.bench.loadgen import Load, run_load
from tuili.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, summarize
from tuili.bench.tokens import LocalTokenizer, ServerTokenizer
from tuili.bench.workloads import (
    FileWorkload,
    MultiTurnWorkload,
    PromptBuilder,
    RandomWorkload,
    Session,
    SharedPrefixWorkload,
    collect,
)
from tuili.errors import TuiliError

RESULT_FORMAT = "tuili-bench/1"
DEFAULT_REQUESTS = 100
MAX_SWEEP_POINTS = 12
# A sweep is saturated when one more step of load adds less than this fraction of throughput...
SATURATION_GAIN = 0.10
# ...or, over request rates, when the server completes less than this fraction of the offered rate.
SATURATION_KEEP_UP = 0.90


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    workload: str = "random"
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_groups: int = 4
    prefix_len: int = 1024
    questions_per_prefix: int = 16
    turns: int = 5
    dataset: str | None = None
    tokenizer: str | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    # "concurrency" or "rate"; `sweep_values` empty means doubling until saturation.
    sweep: str | None = None
    sweep_values: list[float] = field(default_factory=list)
    warmup: int = 0
    num_requests: int | None = None
    duration: float | None = None
    slo: dict[str, float] | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    timeout: float = 600.0
    ignore_eos: bool = False
    extra_body: dict | None = None
    seed: int = 0
    hardware: str | None = None
    model_config: str | None = None
    weights: str | None = None
    kv_dtype: str = "bf16"
    devices: int = 1
    metrics_prefix: str = "tuili:"
    progress: bool = False

    def validate(self) -> None:
        def bad(name: str, value: object, expected: str) -> TuiliError:
            return TuiliError(f"--{name.replace('_', '-')} {value!r} is invalid: expected {expected}")

        if not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", self.base_url, "an http:// or https:// URL")
        if self.endpoint not in ("completions", "chat"):
            raise bad("endpoint", self.endpoint, "completions or chat")
        if self.workload not in ("random", "shared-prefix", "multi-turn", "file"):
            raise bad("workload", self.workload, "random, shared-prefix, multi-turn or file")
        if (self.workload == "file") != (self.dataset is not None):
            raise TuiliError("--workload file and --dataset PATH go together: give both or neither")
        for name in ("input_len", "output_len", "prefix_groups", "prefix_len", "questions_per_prefix", "turns"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "an integer >= 1")
        if not 0 <= self.range_ratio < 1:
            raise bad("range_ratio", self.range_ratio, "a number in [0, 1)")
        if self.concurrency is not None and self.concurrency < 1:
            raise bad("concurrency", self.concurrency, "an integer >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise bad("request_rate", self.request_rate, "a number > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise bad("burstiness", self.burstiness, "a number > 0 (1 is Poisson)")
        if self.sweep not in (None, "concurrency", "rate"):
            raise bad("sweep", self.sweep, "concurrency or rate")
        if self.sweep == "concurrency" and any(v < 1 or v != int(v) for v in self.sweep_values):
            raise bad("sweep", self.sweep_values, "concurrencies that are integers >= 1")
        if self.sweep == "rate" and any(not v > 0 for v in self.sweep_values):
            raise bad("sweep", self.sweep_values, "request rates > 0")
        if self.warmup < 0:
            raise bad("warmup", self.warmup, "an integer >= 0")
        if self.num_requests is not None and self.num_requests < 1:
            raise bad("num_requests", self.num_requests, "an integer >= 1")
        if self.duration is not None and not self.duration > 0:
            raise bad("duration", self.duration, "a number of seconds > 0")
        if not self.timeout > 0:
            raise bad("timeout", self.timeout, "a number of seconds > 0")
        # Synthetic workloads never run out: "all at once" for a time needs a count or a cap.
        all_at_once = self.request_rate is not None and math.isinf(self.request_rate) and self.sweep is None
        if (all_at_once and self.num_requests is None and self.duration is not None and self.concurrency is None
                and self.workload != "file"):
            raise TuiliError("--request-rate inf with only --duration would start requests without end: "
                             "add --num-requests or --concurrency")
        if self.model_config is not None and self.hardware is None:
            raise TuiliError("--model-config is for utilization, which needs --hardware too")
        if self.devices < 1:
            raise bad("devices", self.devices, "an integer >= 1")

    def loads(self) -> list[Load] | None:
        """The load points given outright, or None for a sweep that searches for saturation."""
        if self.sweep == "concurrency":
            values = [int(v) for v in self.sweep_values]
            return [Load(concurrency=v) for v in values] if values else None
        if self.sweep == "rate":
            return ([Load(self.concurrency, v, self.burstiness) for v in self.sweep_values]
                    if self.sweep_values else None)
        if self.request_rate is not None:
            return [Load(self.concurrency, self.request_rate, self.burstiness)]
        return [Load(concurrency=self.concurrency or 1)]


def root_url(base_url: str) -> str:
    """The server root for "http://h:p", "http://h:p/" and "http://h:p/v1" alike."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def served_model_path(http: httpx.AsyncClient, root: str, headers: dict[str, str], model: str) -> str:
    """The model's path on this machine, as tuili serve (and vLLM) list it in /v1/models' `root`."""
    try:
        response = await http.get(f"{root}/v1/models", headers=headers)
        response.raise_for_status()
        path = next(m.get("root") for m in response.json()["data"] if m.get("id") == model)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, StopIteration):
        path = None
    if not isinstance(path, str) or not Path(path).exists():
        raise TuiliError(f"the server does not name a local path for model {model!r} in /v1/models "
                         f"(got {path!r}): pass --model-config with its config.json, directory or GGUF file")
    return path


async def discover_model(http: httpx.AsyncClient, root: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models."""
    try:
        response = await http.get(f"{root}/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except httpx.ConnectError as exc:
        raise TuiliError(f"cannot connect to {root}: {exc or 'connection refused'}; is the server running?") from None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TuiliError(f"could not read the model name from {root}/v1/models ({exc}): pass --model NAME") from None


def workload_seed(seed: int, part: str) -> int:
    """The prompts' seed for one part of a run ("warmup", "point 0", ...), different for every part and
    every --seed, so that no load point replays the prompts of the warmup or of another point (and
    gets prefix-cache hits for them). Arithmetic on the seed would not do: random.Random(n) ignores
    n's sign, so the warmup's seed - 1 and the second point's seed + 1 gave the same prompts."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{part}".encode()).digest()[:8], "little")


class Prefetch:
    """Sessions built ahead by a background task, so that checking prompts never delays an arrival.

    `prime()` starts the builder and waits until `size` sessions are ready (or the workload ended),
    so a run bounded by time starts its clock with work in hand.
    """

    _END = object()

    def __init__(self, sessions: AsyncIterator[Session], size: int) -> None:
        self._sessions = sessions
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=size)
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: Exception | None = None

    async def prime(self) -> Prefetch:
        self._task = asyncio.create_task(self._fill())
        await self._ready.wait()
        return self

    async def _fill(self) -> None:
        try:
            async for session in self._sessions:
                await self._queue.put(session)
                if self._queue.full():
                    self._ready.set()
        except Exception as exc:  # a workload error (say /tokenize failing): __anext__ re-raises it
            self._error = exc
        finally:
            self._ready.set()
        await self._queue.put(self._END)  # not reached when cancelled, so aclose never waits on a full queue

    def __aiter__(self) -> Prefetch:
        return self

    async def __anext__(self) -> Session:
        item = await self._queue.get()
        if item is self._END:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._sessions.aclose()


async def _from_list(sessions: list[Session]) -> AsyncIterator[Session]:
    for session in sessions:
        yield session


class Benchmark:
    """One benchmark run; `await Benchmark(config).run()` returns the result dict."""

    def __init__(self, config: BenchConfig) -> None:
        config.validate()
        self.config = config
        self.root = root_url(config.base_url)
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.local_tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else None
        self.cost = None
        if config.model_config is not None:
            self.cost = self._load_cost(config.model_config)

    def _load_cost(self, model_path: str):
        from tuili.bench.utilization import load_cost_model

        c = self.config
        return load_cost_model(model_path, c.hardware, c.weights, c.kv_dtype, c.devices)

    async def run(self) -> dict:
        c = self.config
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(c.timeout, connect=min(c.timeout, 10.0))
        # trust_env=False: a load test measures the server, never a proxy picked up from the environment.
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
            model = c.model or await discover_model(http, self.root, self.headers)
            if c.hardware is not None and self.cost is None:
                # No --model-config: a server on this machine names its model's path.
                self.cost = self._load_cost(await served_model_path(http, self.root, self.headers, model))
            server_tokenizer = ServerTokenizer(http, self.root, model, self.headers)
            counter = server_tokenizer if await server_tokenizer.available() else self.local_tokenizer
            builder = PromptBuilder(counter)
            await builder.calibrate(random.Random(c.seed))
            client = OpenAIStreamClient(http, self.root, c.endpoint, model, api_key=c.api_key,
                                        extra_body=c.extra_body, ignore_eos=c.ignore_eos,
                                        tokenizer=self.local_tokenizer)
            result: dict = {"format": RESULT_FORMAT,
                            "config": {**asdict(c), "api_key": None, "model": model, "root_url": self.root,
                                       "prompt_check": counter.name if counter else "none"},
                            "runs": [], "stopped_early": None}
            if c.warmup:
                warm = Load(concurrency=min(c.warmup, c.concurrency or 1))
                sessions = await self._sessions(self._workload(builder, workload_seed(c.seed, "warmup")), c.warmup)
                await run_load(sessions, client.send, warm,
                               num_requests=c.warmup, duration=None, seed=c.seed)
            for point, load in enumerate(self._points(result["runs"])):
                run = await self._run_point(http, client, builder, load, point)
                result["runs"].append(run)
                if run["stopped_early"]:
                    result["stopped_early"] = run["stopped_early"]
                    break
            return result

    def _points(self, runs: list[dict]):
        """The load points in order; a searching sweep looks at the runs so far to decide the next."""
        c = self.config
        given = c.loads()
        if given is not None:
            yield from given
            return
        for step in range(MAX_SWEEP_POINTS):
            if c.sweep == "concurrency":
                yield Load(concurrency=2 ** step)
            else:
                yield Load(c.concurrency, (c.request_rate or 1.0) * 2 ** step, c.burstiness)
            if saturated(runs):
                return

    def _workload(self, builder: PromptBuilder, seed: int):
        c = self.config
        if c.workload == "random":
            return RandomWorkload(builder, c.input_len, c.output_len, c.range_ratio, seed)
        if c.workload == "shared-prefix":
            return SharedPrefixWorkload(builder, c.prefix_groups, c.prefix_len, c.questions_per_prefix,
                                        c.input_len, c.output_len, c.range_ratio, seed)
        if c.workload == "multi-turn":
            return MultiTurnWorkload(builder, c.turns, c.input_len, c.output_len, c.range_ratio, seed)
        return FileWorkload(c.dataset, c.output_len, self.local_tokenizer)

    async def _sessions(self, workload, requests: int | None) -> AsyncIterator[Session]:
        if requests is None:
            return await Prefetch(workload.sessions(), size=64).prime()
        # A known count: build (and check) every prompt before the clock starts.
        return _from_list(await collect(workload.sessions(), requests))

    async def _run_point(self, http: httpx.AsyncClient, client: OpenAIStreamClient, builder: PromptBuilder,
                         load: Load, point: int) -> dict:
        c = self.config
        workload = self._workload(builder, workload_seed(c.seed, f"point {point}"))
        requests = c.num_requests
        if requests is None and c.duration is None:
            requests = workload.default_requests or DEFAULT_REQUESTS
        sessions = await self._sessions(workload, requests)
        before = await server_metrics.scrape(http, self.root, c.metrics_prefix, self.headers)
        outcome = await run_load(sessions, client.send, load, num_requests=requests, duration=c.duration,
                                 seed=c.seed + point, progress=c.progress)
        after = await server_metrics.scrape(http, self.root, c.metrics_prefix, self.headers)
        counters = server_metrics.compare(before or {}, after) if after is not None else None
        return {
            "load": load.to_dict(),
            "summary": summarize(outcome.records, c.slo, c.percentiles),
            "server_metrics": counters,
            "utilization": self._utilization(outcome.records),
            "server_utilization": server_metrics.server_utilization(counters, c.metrics_prefix),
            "server_speculation": server_metrics.server_speculation(counters, c.metrics_prefix),
            "stopped_early": outcome.stopped_early,
            "requests": [r.to_dict() for r in outcome.records],
        }

    def _utilization(self, records: list[RequestRecord]) -> dict | None:
        if self.cost is None:
            return None
        from tuili.bench.utilization import estimate

        return estimate(records, self.cost)


def saturated(runs: list[dict]) -> bool:
    """Whether the last load point of a sweep shows the server saturated (see the constants above).

    Over request rates, the rate a point really offered is measured from its requests' start times
    rather than taken as the nominal one: a few dozen Poisson arrivals stray from it by 20%.
    """
    if not runs:
        return False
    last = runs[-1]
    achieved = last["summary"]["request_throughput"] or 0.0
    starts = sorted(r["start_s"] for r in last["requests"])
    if last["load"]["request_rate"] is not None and len(starts) >= 2 and starts[-1] > starts[0]:
        offered = (len(starts) - 1) / (starts[-1] - starts[0])
        if achieved < SATURATION_KEEP_UP * offered:
            return True
    if len(runs) >= 2:
        previous = runs[-2]["summary"]["request_throughput"] or 0.0
        return achieved < previous * (1 + SATURATION_GAIN)
    return False


def run_benchmark(config: BenchConfig) -> dict:
    return asyncio.run(Benchmark(config).run())

