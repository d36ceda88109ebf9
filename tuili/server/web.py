"""The pages `tuili serve` shows a person, and the live figures its dashboard draws.

    GET /             a chat with the served model (static page; it calls /v1/chat/completions)
    GET /dashboard    live counters and the roofline (static page; it polls /stats each second)
    GET /static/...   the pages' scripts and styles, and the libraries they use, shipped in the
                      package (tuili/server/static/vendor, each with its licence): nothing is
                      loaded from another site, so the pages work offline
    GET /stats        the dashboard's figures as JSON (needs the key like the API; docs/server.md)

The pages themselves hold no data, so they load without the API key; everything they show
comes from key-protected calls, for which the page asks the user for the key once and keeps it
in the tab's sessionStorage. All their URLs are relative, so they work under a path prefix
(`--root-path`, or a proxy that strips one).

Every figure comes from the engine's own counters, read the way /metrics reads them (its
registry), so the page and a Prometheus scrape agree. Rates and percentiles are over recent
windows, from snapshots of those counters taken each second: latency percentiles are
interpolated within the /metrics histograms' buckets over the last minute, as Prometheus'
histogram_quantile does. The roofline's points are the engine's recent forward steps, each
costed by the utilization meter's model (tuili/perf/meter.py).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

from tuili.engine.core import LLMEngine
from tuili.engine.stats import EngineStats, StepRecord
from tuili.perf.meter import UtilizationMeter
from tuili.server.metrics import ServerMetrics

STATIC_DIR = files("tuili.server") / "static"
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
# Paths a browser must load without a key: the pages and their static files (no data in them).
PUBLIC_PATHS = frozenset(PAGES)
PUBLIC_PREFIX = "/static/"

# The pages may load only this server's own files; an injected <script> or <img> elsewhere is
# refused by the browser even if the Markdown sanitizer ever missed one.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

RATE_WINDOW = 5.0  # seconds the tokens/s figures average over: live, yet not one step's noise
LATENCY_WINDOW = 60.0  # seconds the percentiles and last-minute figures cover
SAMPLE_EVERY = 1.0
STEP_WINDOW = 30.0  # seconds of forward steps the roofline shows
STEP_EVERY = 0.2  # seconds between the steps of one kind costed: a sample, as costing one at
#                   batch 256 takes ~0.7 ms of the engine thread (as much again as the meter's)
MAX_STEPS_SHOWN = 150  # per kind (prefill, decode): the newest


@dataclass(frozen=True)
class StepPoint:
    """One forward step on the roofline: its useful FLOPs and necessary bytes, as the meter counts them."""

    time: float  # time.monotonic() when it was recorded
    kind: str  # "prefill" (any prompt tokens in it, with or without decodes) or "decode"
    flops: float
    bytes: float
    seconds: float
    sequences: int  # prefill chunks plus decodes
    context_len: int  # their mean context length after the step

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.seconds


class StepLog:
    """An engine observer keeping recent steps' roofline points (engine thread writes, HTTP reads):
    at most one step of each kind every STEP_EVERY seconds.

    A step's bytes are the meter's decode-step bytes over all its sequences, a prefill chunk
    counted as one sequence reading its context's KV: the weights once, every sequence's KV, its
    state. That is a prefill's lower bound too (it also writes its chunk's KV), which is right for
    a roofline: the point shows the least traffic the step's work needed.
    """

    wants_device_time = False  # the meter asks for it; steps timed without it are left out

    def __init__(self, meter: UtilizationMeter, keep: int = 1024) -> None:
        self.meter = meter
        self._steps: deque[StepPoint] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._last = {"prefill": -math.inf, "decode": -math.inf}  # when each kind was last kept

    def on_step(self, record: StepRecord) -> None:
        if not record.synchronized or record.seconds <= 0 or record.num_tokens == 0:
            return
        kind, now = "prefill" if record.prefill_chunks else "decode", time.monotonic()
        if now - self._last[kind] < STEP_EVERY:
            return
        self._last[kind] = now
        cost = self.meter.cost
        chunk_ends = [start + length for start, length in record.prefill_chunks]
        flops = sum(cost.prefill_flops(start, length) for start, length in record.prefill_chunks)
        if record.decode_context_lens:
            flops += cost.decode_flops(record.decode_context_lens)
        # A speculative verification chunk is decode work, as the meter counts it: every
        # position's FLOPs, its context's KV read once.
        for start, length in record.verify_chunks:
            flops += cost.decode_flops(range(start + 1, start + length + 1))
        lens = [*chunk_ends, *record.decode_context_lens, *(start + length for start, length in record.verify_chunks)]
        point = StepPoint(now, kind, float(flops),
                          float(self.meter.step_decode_bytes(lens)), record.seconds, len(lens), round(sum(lens) / len(lens)))
        with self._lock:
            self._steps.append(point)

    def since(self, start: float) -> list[StepPoint]:
        with self._lock:
            return [step for step in self._steps if step.time >= start]

    def decode_intensity(self, batch: int, context_len: int) -> float:
        """FLOPs per byte of a decode step of `batch` sequences at `context_len` tokens each."""
        lens = [max(1, context_len)] * max(1, batch)
        return self.meter.cost.decode_flops(lens) / self.meter.step_decode_bytes(lens)


@dataclass(frozen=True)
class _Snapshot:
    time: float  # time.monotonic()
    values: dict[str, float]  # /metrics samples by name (labels but model_name kept: name{k=v})
    buckets: dict[str, list[tuple[float, float]]]  # histogram -> [(upper bound, cumulative count)]


class LiveStats:
    """Snapshots of the server's counters each second, and the dashboard's figures from them."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, meter: UtilizationMeter,
                 steps: StepLog, engine_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.meter = meter
        self.steps = steps
        self.engine_stats = engine_stats
        self.model_name = model_name
        self.started = time.monotonic()
        self._history: deque[_Snapshot] = deque()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Take a snapshot each second from now on (call on the event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _sample_forever(self) -> None:
        while True:
            self._remember(self._snapshot())
            await asyncio.sleep(SAMPLE_EVERY)

    def _remember(self, snapshot: _Snapshot) -> None:
        self._history.append(snapshot)
        while self._history and self._history[0].time < snapshot.time - LATENCY_WINDOW - 2 * SAMPLE_EVERY:
            self._history.popleft()

    def _snapshot(self) -> _Snapshot:
        values: dict[str, float] = {}
        buckets: dict[str, list[tuple[float, float]]] = {}
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                if sample.name.endswith("_bucket"):
                    bound = float(labels.pop("le"))
                    buckets.setdefault(sample.name.removesuffix("_bucket"), []).append((bound, sample.value))
                    continue
                label = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                values[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
        return _Snapshot(time.monotonic(), values, {name: sorted(b) for name, b in buckets.items()})

    def _before(self, now: _Snapshot, seconds: float) -> _Snapshot | None:
        """The newest snapshot at least `seconds` older than `now`, else the oldest one (None: none)."""
        older = [s for s in self._history if s.time <= now.time - 0.5 * SAMPLE_EVERY]
        if not older:
            return None
        fitting = [s for s in older if s.time <= now.time - seconds]
        return fitting[-1] if fitting else older[0]

    def figures(self) -> dict:
        """The dashboard's figures (GET /stats; every field is described in docs/server.md)."""
        now = self._snapshot()
        stats = self.engine_stats()
        recent, minute = self._before(now, RATE_WINDOW), self._before(now, LATENCY_WINDOW)
        summary = self.meter.summary()
        v = now.values

        def rate(name: str) -> float | None:
            if recent is None:
                return None
            return (v.get(name, 0.0) - recent.values.get(name, 0.0)) / (now.time - recent.time)

        def delta(name: str) -> float:
            return v.get(name, 0.0) - (minute.values.get(name, 0.0) if minute else 0.0)

        def percentiles(histogram: str) -> dict:
            current = now.buckets.get(histogram, [])
            past = dict(minute.buckets.get(histogram, [])) if minute else {}
            counts = [(bound, count - past.get(bound, 0.0)) for bound, count in current]
            total = counts[-1][1] if counts else 0.0
            return {"count": int(total), **{f"p{q}": _quantile(q / 100, counts) for q in (50, 90, 99)}}

        hits, queries = "tuili:prefix_cache_hits_total", "tuili:prefix_cache_queries_total"
        minute_queries = delta(queries)
        slots = self.engine.pool.num_state_slots
        peak, bandwidth = summary.peak_flops, summary.memory_bandwidth
        steps = self.steps.since(now.time - STEP_WINDOW)
        last_decode = next((s for s in reversed(steps) if s.kind == "decode"), None)
        batch = stats.num_running or (last_decode.sequences if last_decode else 1)
        context = last_decode.context_len if last_decode else 1
        return {
            "model": self.model_name,
            "uptime_seconds": now.time - self.started,
            "requests": {"running": stats.num_running, "waiting": stats.num_waiting},
            "kv_cache": {
                "usage": stats.kv_cache_usage, "blocks": stats.num_blocks, "free_blocks": stats.num_free_blocks,
                "cached_blocks": stats.num_cached_blocks, "tokens": self.engine.pool.num_tokens,
            },
            # a running sequence of a model with recurrent layers holds one state slot
            "state_slots": {"slots": slots, "used": stats.num_running, "usage": stats.num_running / slots}
            if slots else None,
            "prefix_cache": {
                "queried_tokens": stats.prefix_cache.queried_tokens, "hit_tokens": stats.prefix_cache.hit_tokens,
                "hit_rate": stats.prefix_cache.hit_rate,
                "hit_rate_last_minute": delta(hits) / minute_queries if minute_queries else None,
            },
            "throughput": {
                "window_seconds": RATE_WINDOW,
                "prompt_tokens_per_second": rate("tuili:prefill_tokens_total"),
                "generation_tokens_per_second": rate("tuili:generation_tokens_total"),
                "history": self._rate_history(now),
            },
            "totals": {
                "prompt_tokens": v.get("tuili:prompt_tokens_total", 0.0),
                "prompt_tokens_computed": v.get("tuili:prefill_tokens_total", 0.0),
                "generation_tokens": v.get("tuili:generation_tokens_total", 0.0),
                "sequences_finished": {
                    name.split("finish_reason=")[1].rstrip("}"): value for name, value in v.items()
                    if name.startswith("tuili:sequences_finished_total{")
                },
                "steps": stats.num_steps, "preemptions": stats.num_preemptions,
            },
            "latency": {
                "window_seconds": LATENCY_WINDOW,
                "ttft_seconds": percentiles("tuili:time_to_first_token_seconds"),
                "inter_token_seconds": percentiles("tuili:inter_token_latency_seconds"),
            },
            "roofline": {
                "hardware": summary.hardware, "hardware_origin": summary.hardware_origin,
                "compute_dtype": summary.compute_dtype, "peak_flops": peak, "memory_bandwidth": bandwidth,
                "ridge_intensity": peak / bandwidth,
                "decode_batch": batch, "decode_context_len": context,
                "decode_intensity": self.steps.decode_intensity(batch, context),
                "prefill_mfu": summary.prefill_mfu, "decode_mbu": summary.decode_mbu,
                "prefill_peak_exceeded": summary.prefill_peak_exceeded,
                "decode_peak_exceeded": summary.decode_peak_exceeded,
                "prefill_mfu_last_minute": _utilization(delta("tuili:prefill_flops_total"),
                                                        delta("tuili:prefill_seconds_total"), peak),
                "decode_mbu_last_minute": _utilization(delta("tuili:decode_bytes_total"),
                                                       delta("tuili:decode_seconds_total"), bandwidth),
                "steps": [
                    {"age_seconds": round(now.time - s.time, 3), "kind": s.kind, "sequences": s.sequences,
                     "flops": s.flops, "bytes": s.bytes, "seconds": s.seconds,
                     "intensity": s.intensity, "flops_per_second": s.flops_per_second}
                    for kind in ("prefill", "decode")
                    for s in [s for s in steps if s.kind == kind][-MAX_STEPS_SHOWN:]
                ],
            },
        }

    def _rate_history(self, now: _Snapshot) -> dict[str, list[float]]:
        """Tokens/s between consecutive snapshots of the last minute, for the dashboard's chart."""
        history = [*self._history, now]
        ages, prompt, generation = [], [], []
        for a, b in zip(history, history[1:], strict=False):
            span = b.time - a.time
            if span < 0.5 * SAMPLE_EVERY:
                continue
            ages.append(round(b.time - now.time, 2))
            prompt.append((b.values.get("tuili:prefill_tokens_total", 0) - a.values.get("tuili:prefill_tokens_total", 0)) / span)
            generation.append((b.values.get("tuili:generation_tokens_total", 0)
                               - a.values.get("tuili:generation_tokens_total", 0)) / span)
        return {"age_seconds": ages, "prompt_tokens_per_second": prompt, "generation_tokens_per_second": generation}


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: interpolate linearly within the bucket holding rank q.
    None with no observations; the highest finite bound when the rank is in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def _utilization(work: float, seconds: float, peak: float) -> float | None:
    """As the meter's: None with no time in the window, or above the peak (the peak is then wrong)."""
    if seconds <= 0:
        return None
    fraction = work / seconds / peak
    return fraction if fraction <= 1.0 else None


def install_pages(app: FastAPI, live: LiveStats) -> None:
    """Add the pages, their static files and GET /stats to `app`."""
    for path, page in PAGES.items():
        app.add_api_route(path, _page_route(page), methods=["GET"], include_in_schema=False)
    # Only the files shipped: a path is looked up, never joined onto a directory. (Not Starlette's
    # StaticFiles: under a root path that a proxy strips it looks for /static/static/...)
    shipped = {
        f"{folder}{item.name}": item
        for folder, directory in (("", STATIC_DIR), ("vendor/", STATIC_DIR / "vendor"))
        for item in directory.iterdir() if item.is_file()
    }
    media = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        item = shipped.get(name)
        if item is None:
            return Response(f"no file static/{name}", status_code=404, media_type="text/plain")
        suffix = "." + item.name.rsplit(".", 1)[-1]
        return FileResponse(str(item), media_type=media.get(suffix, "text/plain"),
                            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    @app.get("/stats", include_in_schema=False)
    async def stats() -> JSONResponse:
        return JSONResponse(live.figures(), headers={"Cache-Control": "no-store"})


def _page_route(page: str):
    async def serve_page() -> FileResponse:
        return FileResponse(str(STATIC_DIR / page), media_type="text/html", headers=_PAGE_HEADERS)
    return serve_page


def is_public(route_path: str) -> bool:
    """Whether a path (without the root path) is a page or static file, loaded without the key."""
    return route_path in PUBLIC_PATHS or route_path.startswith(PUBLIC_PREFIX)
