"""Text reports: the summary of a run, the table of a sweep, and two results side by side."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tuili.bench.loadgen import Load
from tuili.bench.metrics import percentile_key
from tuili.bench.runner import RESULT_FORMAT
from tuili.errors import TuiliError

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))


def fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.{digits}f}"


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"{label:<{width}}  {value}" for label, value in rows]


def _table(table: list[list[str]]) -> str:
    """Columns aligned: the first to the left, the others to the right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in table)


def load_label(load: dict) -> str:
    return Load.from_dict(load).describe()


def render_run(run: dict, percentiles: Sequence[float]) -> str:
    s = run["summary"]
    rows = [
        ("Load", load_label(run["load"])),
        ("Requests sent / completed / failed", f"{s['requests_sent']} / {s['completed']} / {s['failed']}"),
    ]
    for kind, number in s["failures"].items():
        rows.append((f"  failed: {kind}", f"{number}  ({s['failure_reasons'][kind]})"))
    rows += [
        ("Duration (s)", fmt(s["duration_s"])),
        ("Input / output tokens", f"{s['input_tokens']} / {s['output_tokens']}"
                                  f"  (counted by {', '.join(s['token_sources']) or '-'})"),
    ]
    if s["cached_tokens"] is not None:
        share = f" ({s['cached_tokens'] / s['input_tokens']:.1%} of input)" if s["input_tokens"] else ""
        rows.append(("Input tokens from the prefix cache", f"{s['cached_tokens']}{share}"))
    rows += [
        ("Request throughput (req/s)", fmt(s["request_throughput"])),
        ("Output token throughput (tok/s)", fmt(s["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(s["total_token_throughput"])),
    ]
    if s["slo"]:
        limits = ", ".join(f"{k} <= {v:g}" for k, v in s["slo"].items())
        rows.append(("Goodput (req/s)", f"{fmt(s['goodput'])}  ({s['good_requests']} requests with {limits})"))
    lines = _rows(rows)
    keys = ["mean"] + [percentile_key(p) for p in percentiles]
    header = f"{'latency (ms)':<12}" + "".join(f"{k:>11}" for k in keys)
    lines += ["", header]
    for field, label in LATENCIES:
        lines.append(f"{label:<12}" + "".join(f"{fmt(s[field][k]):>11}" for k in keys))
    if run.get("utilization") or run.get("server_utilization"):
        lines += ["", *render_utilization(run.get("utilization"), run.get("server_utilization"))]
    if run.get("server_speculation"):
        spec = run["server_speculation"]
        lines += ["", *_rows([("Speculative decoding (server, over the run)",
                               f"{spec['acceptance_rate']:.1%} of {spec['proposed_tokens']:.0f} proposed tokens accepted, "
                               f"{spec['tokens_per_verification']:.2f} tokens per verifying step "
                               f"({spec['verifications']:.0f} verifications)")])]
    if run.get("server_metrics"):
        lines += ["", "server's own counters (over the run; gauges at its end)"]
        lines += _rows([(key, f"{entry['run']:.6g}") for key, entry in run["server_metrics"].items()])
    if run.get("stopped_early"):
        lines += ["", f"STOPPED EARLY: {run['stopped_early']}"]
    return "\n".join(lines)


def render_utilization(bench: dict | None, server: dict | None) -> list[str]:
    """The bench's estimates beside the server's own figures, for whichever of the two exists."""
    def pct(source: dict | None, key: str) -> str:
        value = (source or {}).get(key)
        return "-" if value is None else f"{value:.1%}"

    server_label = f"server ({server['source']})" if server else "server"
    rows = [("utilization", f"{'bench estimate':<16}{server_label}"),
            ("Prefill MFU", f"{pct(bench, 'prefill_mfu'):<16}{pct(server, 'prefill_mfu')}"),
            ("Decode MBU", f"{pct(bench, 'decode_mbu'):<16}{pct(server, 'decode_mbu')}")]
    if bench:
        note = " (an estimate: run `tuili probe` for measured figures)" if bench["hardware_origin"] == "estimate" else ""
        rows.append(("Against", f"{bench['hardware']}: {bench['peak_flops'] / 1e12:,.1f} TFLOP/s "
                                f"{bench['compute_dtype']}, {bench['memory_bandwidth'] / 1e9:,.0f} GB/s{note}"))
        rows.append(("Mean requests decoding together", fmt(bench["mean_decode_batch"])))
    return _rows(rows)


def render_sweep(runs: list[dict]) -> str:
    header = ["load", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "E2EL p99", "failed"]
    table = [header]
    for run in runs:
        s = run["summary"]
        table.append([load_label(run["load"]), fmt(s["request_throughput"]), fmt(s["output_throughput"], 1),
                      fmt(s["goodput"]), fmt(s["ttft_ms"]["p50"], 1), fmt(s["ttft_ms"]["p99"], 1),
                      fmt(s["tpot_ms"]["p50"], 1), fmt(s["tpot_ms"]["p99"], 1), fmt(s["e2el_ms"]["p99"], 1),
                      str(s["failed"])])
    return _table(table)


def render(result: dict) -> str:
    c = result["config"]
    title = f" tuili bench: {c['endpoint']} at {c['root_url']}, model {c['model']}, workload {c['workload']} "
    parts = [title.center(100, "=")]
    for run in result["runs"]:
        parts.append(render_run(run, c["percentiles"]))
    if len(result["runs"]) > 1:
        parts.append("sweep (latencies in ms)\n" + render_sweep(result["runs"]))
    return "\n\n".join(parts)


def read_result(path: str | Path) -> dict:
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise TuiliError(f"{str(path)!r} cannot be read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TuiliError(f"{str(path)!r} is not JSON ({exc}): expected a file written by tuili bench --output") from None
    if not isinstance(result, dict) or result.get("format") != RESULT_FORMAT:
        raise TuiliError(f"{str(path)!r} is not a tuili bench result: expected \"format\": \"{RESULT_FORMAT}\"")
    return result


def write_result(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


# Summary figures shown by `compare`: (label, path into the summary or run, higher is better).
COMPARED = [
    ("completed", ("summary", "completed"), True),
    ("failed", ("summary", "failed"), False),
    ("request throughput (req/s)", ("summary", "request_throughput"), True),
    ("output throughput (tok/s)", ("summary", "output_throughput"), True),
    ("total throughput (tok/s)", ("summary", "total_token_throughput"), True),
    ("input tokens from the prefix cache", ("summary", "cached_tokens"), True),
    ("goodput (req/s)", ("summary", "goodput"), True),
    *((f"{label} {stat} (ms)", ("summary", field, stat), False)
      for field, label in LATENCIES for stat in ("mean", "p50", "p90", "p99")),
    ("prefill MFU", ("utilization", "prefill_mfu"), True),
    ("decode MBU", ("utilization", "decode_mbu"), True),
]


def _dig(run: dict, path: tuple[str, ...]) -> float | None:
    value = run
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, (int, float)) else None


def render_compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    """Each load point of `a` beside the same point of `b`, with the ratio B / A."""
    ca, cb = a["config"], b["config"]
    parts = ["\n".join(_rows([("A", f"{names[0]}: {ca['endpoint']} {ca['model']} at {ca['root_url']}"),
                              ("B", f"{names[1]}: {cb['endpoint']} {cb['model']} at {cb['root_url']}")]))]
    if len(a["runs"]) != len(b["runs"]):
        parts.append(f"A has {len(a['runs'])} load points and B {len(b['runs'])}: comparing the first "
                     f"{min(len(a['runs']), len(b['runs']))}")
    for ra, rb in zip(a["runs"], b["runs"], strict=False):
        table = [[f"A {load_label(ra['load'])} | B {load_label(rb['load'])}", "A", "B", "B / A", ""]]
        for label, path, higher_is_better in COMPARED:
            va, vb = _dig(ra, path), _dig(rb, path)
            if va is None and vb is None:
                continue
            ratio = vb / va if va and vb is not None else None
            verdict = "" if ratio is None or ratio == 1 else (
                "B better" if (ratio > 1) == higher_is_better else "B worse")
            table.append([label, fmt(va), fmt(vb), fmt(ratio, 3), verdict])
        parts.append(_table(table))
    return "\n\n".join(parts)
