"""The server's Prometheus metrics, all prefixed `tuili:`; with --vllm-metric-names also under
vLLM's names and label names (`VLLM_NAMES`), so that a dashboard made for vLLM works unchanged.

Counted on the engine thread (prometheus_client's metrics are thread-safe), read by `GET
/metrics`. The utilization meter the server attaches to the engine (`tuili/perf/meter.py`: live
prefill MFU, decode MBU and the totals behind them) is read at each scrape, under the meter's
own lock. The engine schedules *sequences*: a request with n choices is n sequences, so the
running / waiting gauges and the finished counter count sequences (for n = 1 the same as
requests). Latencies are measured from the moment the HTTP side received the call, so they
include tokenization and the wait for the engine thread to pick the request up.

Per request (an engine request: one prompt, with its n choices), observed when its final output
is delivered, as vLLM does: prompt tokens, generation tokens (all choices), the most tokens one
choice generated, prefill time (first schedule to first token) and decode time (first token to
the last). An embedding request has no decode: its prefill ends with its vector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

# Bucket edges in seconds, spanning a fast GPU's milliseconds to a loaded CPU's minutes.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
# Per-request phases in seconds (vLLM's request_prefill/decode_time buckets).
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)

# tuili's metric families and the vLLM families each is also exported as with --vllm-metric-names
# (docs/server.md has the table). Label `finish_reason` is renamed `finished_reason`, vLLM's.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tuili:num_sequences_running": ("vllm:num_requests_running",),
    "tuili:num_sequences_waiting": ("vllm:num_requests_waiting",),
    # vLLM's current name, and the one its example Grafana board still reads; both are 0 to 1
    "tuili:kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tuili:prompt_tokens": ("vllm:prompt_tokens",),
    "tuili:generation_tokens": ("vllm:generation_tokens",),
    "tuili:sequences_finished": ("vllm:request_success",),
    "tuili:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM's current name, and the older one its example Grafana board reads
    "tuili:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tuili:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tuili:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tuili:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "tuili:request_generation_tokens": ("vllm:request_generation_tokens",),
    "tuili:request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    "tuili:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "tuili:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "tuili:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tuili:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tuili:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tuili:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tuili:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(float(step * scale))
        scale *= 10

__all__ = ["CONTENT_TYPE", "ServerMetrics"]


class ServerMetrics:
    """Every metric the server exports, in a registry of its own."""

    def __init__(self, model_name: str, utilization: Callable[[], dict[str, float]] | None = None,
                 max_model_len: int = 131072, vllm_names: bool = False) -> None:
        """`utilization` returns the utilization meter's samples by name (`UtilizationSummary.prometheus`)
        and the prefix cache's counters. `vllm_names`: also export VLLM_NAMES' families under
        vLLM's names (--vllm-metric-names)."""
        self.registry = CollectorRegistry()
        self._vllm_registry: CollectorRegistry | None = None
        if vllm_names:
            self._vllm_registry = CollectorRegistry()
            self._vllm_registry.register(_VllmAliases(self.registry))
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
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "tuili:request_prompt_tokens", "Prompt tokens of each finished request.", tokens
        )
        self.request_generation_tokens = histogram(
            "tuili:request_generation_tokens", "Tokens each finished request generated, over its choices.", tokens
        )
        self.request_max_num_generation_tokens = histogram(
            "tuili:request_max_num_generation_tokens", "The most tokens one choice of each finished request generated.",
            tokens,
        )
        self.request_prefill_time = histogram(
            "tuili:request_prefill_time_seconds", "From a request's first schedule to its first token (or its "
            "embedding).", _PHASE_BUCKETS,
        )
        self.request_decode_time = histogram(
            "tuili:request_decode_time_seconds", "From a request's first token to its last.", _PHASE_BUCKETS
        )

    def count_finished(self, finish_reason: str, sequences: int = 1) -> None:
        self._sequences_finished.labels(model_name=self._model_name, finish_reason=finish_reason).inc(sequences)

    def set_engine_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.num_running.set(running)
        self.num_waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def observe_finished(self, prompt_tokens: int, choice_tokens: list[int], first_scheduled: float | None,
                         first_token: float | None, finished: float) -> None:
        """A request's final output: its token counts (`choice_tokens`: per choice; none for an
        embedding) and its phases from the engine's monotonic timestamps."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(sum(choice_tokens))
        self.request_max_num_generation_tokens.observe(max(choice_tokens, default=0))
        if first_scheduled is not None:
            prefill_end = first_token if first_token is not None else finished
            self.request_prefill_time.observe(max(0.0, prefill_end - first_scheduled))
        self.request_decode_time.observe(max(0.0, finished - first_token) if first_token is not None else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (and of the vLLM aliases, when on)."""
        text = generate_latest(self.registry)
        if self._vllm_registry is not None:
            text += generate_latest(self._vllm_registry)
        return text



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


class _VllmAliases:
    """The families of VLLM_NAMES, read from `source` at each scrape, renamed to vLLM's names and
    label names: one set of counts, two names, never out of step."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # collect() only at scrape time: the source's families are known then

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            for alias in VLLM_NAMES.get(family.name, ()):
                renamed = Metric(alias, family.documentation, family.type, family.unit)
                renamed.samples = [
                    Sample(alias + sample.name[len(family.name):],
                           {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()},
                           sample.value, sample.timestamp, sample.exemplar)
                    for sample in family.samples
                ]
                yield renamed
