"""What one request measured, and the summary of a run: latencies, throughputs, goodput, failures.

Every definition here is the one written in docs/bench.md; change both together.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import pairwise

import numpy as np

from tuili.errors import TuiliError

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SLO_KEYS: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start_s` counts from the run's start.

    `chunk_times_s` holds the arrival time, from the request's start, of every chunk that carried
    text, so TTFT == chunk_times_s[0] and the ITLs are the gaps between consecutive entries.
    A failed request keeps `e2el_s` as the time until the failure was noticed.
    """

    index: int
    session: int
    turn: int
    start_s: float
    max_tokens: int
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    # Where output_tokens came from: "usage" (the server), "tokenizer" (local), "chunks" (one per chunk).
    token_source: str | None = None
    cached_tokens: int | None = None
    # The prompt's new text as counted when the workload built it (server /tokenize or local tokenizer).
    expected_prompt_tokens: int | None = None
    finish_reason: str | None = None
    # The generated text: multi-turn sessions put it into the next turn's history. Not saved.
    text: str = field(default="", repr=False)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times_s)]

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); undefined for fewer than two output tokens."""
        if not self.ok or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        record = asdict(self)
        del record["text"]
        return record

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        return cls(**data)


def parse_slo(text: str) -> dict[str, float]:
    """Parse "ttft_ms=500,tpot_ms=50" into {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    slo: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise TuiliError(f"--slo item {item!r} is invalid: expected KEY=MILLISECONDS with KEY one of "
                             f"{', '.join(SLO_KEYS)}")
        try:
            limit = float(value)
        except ValueError:
            raise TuiliError(f"--slo {key}={value!r} is invalid: expected a number of milliseconds") from None
        if not limit > 0 or math.isinf(limit):
            raise TuiliError(f"--slo {key}={value!r} is invalid: expected a positive finite number")
        slo[key] = limit
    if not slo:
        raise TuiliError(f"--slo {text!r} is empty: expected e.g. ttft_ms=500,tpot_ms=50")
    return slo


def parse_percentiles(text: str) -> tuple[float, ...]:
    """The default P50/P90/P99 plus those listed in "95,99.9", sorted."""
    extra = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            p = float(item)
        except ValueError:
            p = math.nan
        if not 0 <= p <= 100:
            raise TuiliError(f"--percentiles item {item!r} is invalid: expected a number in [0, 100]")
        extra.add(p)
    return tuple(sorted(set(DEFAULT_PERCENTILES) | extra))


def percentile_key(p: float) -> str:
    """50 -> "p50", 99.9 -> "p99.9"."""
    return f"p{p:g}"


def describe(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float | int | None]:
    """Count, mean, population std, min, max and the percentiles (numpy's linear interpolation)."""
    stats: dict[str, float | int | None] = {"count": len(values)}
    if not values:
        stats.update(mean=None, std=None, min=None, max=None)
        stats.update({percentile_key(p): None for p in percentiles})
        return stats
    array = np.asarray(values, dtype=np.float64)
    stats.update(mean=float(array.mean()), std=float(array.std()), min=float(array.min()),
                 max=float(array.max()))
    stats.update({percentile_key(p): float(np.percentile(array, p)) for p in percentiles})
    return stats


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A completed request meets the SLO when each given limit holds (an undefined TPOT holds)."""
    if not record.ok:
        return False
    measured = {"ttft_ms": record.ttft_s * 1e3, "e2el_ms": record.e2el_s * 1e3,
                "tpot_ms": None if record.tpot_s is None else record.tpot_s * 1e3}
    return all(measured[key] is None or measured[key] <= limit for key, limit in slo.items())


def run_duration(records: list[RequestRecord]) -> float:
    """From the first request's start to the last request's end (failed ones included)."""
    if not records:
        return 0.0
    return max(r.start_s + (r.e2el_s or 0.0) for r in records) - min(r.start_s for r in records)


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    """The run's summary as a JSON-ready dict; latencies in milliseconds, throughputs per second."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = run_duration(records)

    def per_second(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    # None when the server reports no cached count at all, so "no cache" and "no hits" differ.
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    reasons: dict[str, str] = {}
    for r in failed:
        reasons.setdefault(r.error_kind, r.error)
    good = sum(meets_slo(r, slo) for r in done) if slo else None
    return {
        "requests_sent": len(records),
        "completed": len(done),
        "failed": len(failed),
        "failures": dict(Counter(r.error_kind for r in failed).most_common()),
        "failure_reasons": reasons,
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "token_sources": dict(Counter(r.token_source for r in done)),
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "slo": slo,
        "good_requests": good,
        "goodput": None if good is None else per_second(good),
        "ttft_ms": describe([r.ttft_s * 1e3 for r in done], percentiles),
        "tpot_ms": describe([r.tpot_s * 1e3 for r in done if r.tpot_s is not None], percentiles),
        "itl_ms": describe([gap * 1e3 for r in done for gap in r.itls_s], percentiles),
        "e2el_ms": describe([r.e2el_s * 1e3 for r in done], percentiles),
    }
