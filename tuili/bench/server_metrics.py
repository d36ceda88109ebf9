"""The server's own counters: /metrics scraped before and after a run, in Prometheus text format.

Only samples with the given name prefix (tuili serve's `tuili:`) are kept, histogram buckets
aside. Counters (and a histogram's _sum and _count) are reported as their increase over the run,
gauges as their value at the end, so the server's view sits beside the client's.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

CUMULATIVE_SUFFIXES = ("_total", "_sum", "_count")


def sample_key(name: str, labels: dict[str, str]) -> str:
    """`name{a="x",b="y"}` with labels sorted, as Prometheus prints them."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_metrics(text: str, prefix: str) -> dict[str, tuple[str, float]]:
    """key -> (kind, value), kind "counter" for cumulative samples and "gauge" for the rest."""
    samples: dict[str, tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix) or sample.name.endswith(("_bucket", "_created")):
                continue
            cumulative = family.type in ("counter", "histogram", "summary") or sample.name.endswith(
                CUMULATIVE_SUFFIXES)
            samples[sample_key(sample.name, sample.labels)] = ("counter" if cumulative else "gauge",
                                                                float(sample.value))
    return samples


async def scrape(http: httpx.AsyncClient, root_url: str, prefix: str,
                 headers: dict[str, str] | None = None) -> dict[str, tuple[str, float]] | None:
    """The server's metrics with `prefix`, or None when it has no readable /metrics."""
    try:
        response = await http.get(f"{root_url}/metrics", headers=headers)
        if response.status_code != 200:
            return None
        return parse_metrics(response.text, prefix)
    except (httpx.HTTPError, ValueError):
        return None


def compare(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict[str, dict]:
    """key -> {"kind", "before", "after", "run"}: "run" is a counter's increase or a gauge's end value."""
    report = {}
    for key, (kind, value) in sorted(after.items()):
        start = before.get(key, (kind, 0.0))[1]
        report[key] = {"kind": kind, "before": start, "after": value,
                       "run": value - start if kind == "counter" else value}
    return report


def over_run(server_metrics: dict[str, dict], name: str) -> float | None:
    """A metric's value over the run, whatever its labels (tuili serve adds model_name): counters
    summed over label sets, gauges their largest; None when the server does not export it."""
    entries = [e for key, e in server_metrics.items() if key.split("{")[0] == name]
    if not entries:
        return None
    values = [e["run"] for e in entries]
    return sum(values) if entries[0]["kind"] == "counter" else max(values)


def server_utilization(server_metrics: dict[str, dict] | None, prefix: str = "tuili:") -> dict | None:
    """The server's own MFU and MBU over the run, from its FLOP, byte and time counters' increases;
    failing those, its cumulative gauges (since it started). None when it exports neither."""
    if not server_metrics:
        return None

    def run(name: str) -> float | None:
        return over_run(server_metrics, prefix + name)

    result = {}
    flops, seconds, peak = run("prefill_flops_total"), run("prefill_seconds_total"), run("peak_flops")
    if flops is not None and seconds and peak:
        result["prefill_mfu"] = flops / seconds / peak
    nbytes, seconds, bandwidth = run("decode_bytes_total"), run("decode_seconds_total"), run("memory_bandwidth")
    if nbytes is not None and seconds and bandwidth:
        result["decode_mbu"] = nbytes / seconds / bandwidth
    source = "counters over the run"
    for key in ("prefill_mfu", "decode_mbu"):
        if key not in result and run(key) is not None:
            result[key] = run(key)
            source = "gauges since the server started"
    if not result:
        return None
    result["source"] = source
    return result


def server_speculation(server_metrics: dict[str, dict] | None, prefix: str = "tuili:") -> dict | None:
    """Speculative decoding over the run, from the server's spec_decode counters (vLLM's names)
    and their increases: verifications (sequence-steps that verified proposals), proposed and
    accepted tokens, the acceptance rate (accepted / proposed) and the tokens a verifying step
    emitted on average (accepted + the target's own). None when the server does not speculate."""
    if not server_metrics:
        return None
    names = {"verifications": "num_drafts_total", "proposed_tokens": "num_draft_tokens_total",
             "accepted_tokens": "num_accepted_tokens_total", "emitted_tokens": "num_emitted_tokens_total"}
    found = {key: over_run(server_metrics, f"{prefix}spec_decode_{name}") for key, name in names.items()}
    if any(value is None for value in found.values()):
        return None
    result: dict[str, float] = {key: float(value) for key, value in found.items() if value is not None}
    result["acceptance_rate"] = result["accepted_tokens"] / result["proposed_tokens"] if result["proposed_tokens"] else 0.0
    result["tokens_per_verification"] = (result["emitted_tokens"] / result["verifications"]
                                         if result["verifications"] else 0.0)
    return result
