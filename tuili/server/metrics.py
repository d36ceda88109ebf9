"""The server's Prometheus metrics, all prefixed `tuili:`.

Counted on the engine thread (prometheus_client's metrics are thread-safe), read by `GET
/metrics`. The utilization meter the server attaches to the engine (`tuili/perf/meter.py`: live
prefill MFU, decode MBU and the totals behind them) is read at each scrape, under the meter's
own lock. The engine schedules *sequences*: a request with n choices is n sequences, so the
running / waiting gauges and the finished counter count sequences (for n = 1 the same as
requests). Latencies are measured from the moment the HTTP side received the call, so they
include tokenization and the wait for the engine thread to pick the request up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Bucket edges in seconds, spanning a fast GPU's milliseconds to a loaded CPU's minutes.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)

__all__ = ["CONTENT_TYPE", "ServerMetrics"]


class ServerMetrics:
    """Every metric the server exports, in a registry of its own."""

    def __init__(self, model_name: str, utilization: Callable[[], dict[str, float]] | None = None) -> None:
        """`utilization` returns the utilization meter's samples by name (`UtilizationSummary.prometheus`)
        and the prefix cache's counters."""
        self.registry = CollectorRegistry()
        if utilization is not None:
            self.registry.register(_UtilizationCollector(utilization, model_name))
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=self.registry, labelnames=list(labels)).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=self.registry, labelnames=list(labels)).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name, doc, registry=self.registry, labelnames=list(labels), buckets=buckets
            ).labels(**labels)

        self.num_running = gauge("tuili:num_sequences_running", "Sequences holding KV blocks, scheduled every step.")
        self.num_waiting = gauge("tuili:num_sequences_waiting", "Sequences queued for their (first or resumed) schedule.")
        self.kv_cache_usage = gauge("tuili:kv_cache_usage", "Fraction of the KV cache pool's blocks in use (0 to 1).")
        self.prompt_tokens = counter("tuili:prompt_tokens", "Prompt tokens of the requests the engine accepted.")
        self.generation_tokens = counter("tuili:generation_tokens", "Tokens generated, over all choices.")
        self._sequences_finished = Counter(
            "tuili:sequences_finished",
            "Sequences (choices) finished, by finish reason: stop, length, or abort (the client left).",
            registry=self.registry,
            labelnames=["model_name", "finish_reason"],
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "tuili:time_to_first_token_seconds", "From receiving a request to its first generated token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "tuili:inter_token_latency_seconds",
            "Between consecutive engine steps that gave a request new tokens.",
            _ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "tuili:e2e_request_latency_seconds", "From receiving a request to its last token.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "tuili:request_queue_time_seconds", "From receiving a request to its first schedule.", _REQUEST_BUCKETS
        )

    def count_finished(self, finish_reason: str, sequences: int = 1) -> None:
        self._sequences_finished.labels(model_name=self._model_name, finish_reason=finish_reason).inc(sequences)

    def set_engine_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.num_running.set(running)
        self.num_waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)



class _UtilizationCollector:
    """The utilization samples: names ending in _total are counters, the rest gauges."""

    def __init__(self, samples: Callable[[], dict[str, float]], model_name: str) -> None:
        self._samples, self._model_name = samples, model_name

    def describe(self) -> list[Metric]:
        return []  # names are only known from a first reading; describing none defers to collect()

    def collect(self) -> Iterator[Metric]:
        for name, value in self._samples().items():
            if name.endswith("_total"):
                family = CounterMetricFamily(name.removesuffix("_total"), "engine utilization meter", labels=["model_name"])
            else:
                family = GaugeMetricFamily(name, "engine utilization meter", labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
