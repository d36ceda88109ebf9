"""PNG charts of a result: latency CDFs for every load point, and for a sweep, throughput and P99
latency against load. matplotlib is imported here only, so that `tuili bench` runs without it.
"""

from __future__ import annotations

import math
from pathlib import Path

from tuili.bench.metrics import RequestRecord
from tuili.bench.report import load_label
from tuili.errors import TuiliError


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TuiliError("--plot needs matplotlib: pip install matplotlib") from None


def _latencies(run: dict) -> dict[str, list[float]]:
    done = [RequestRecord.from_dict(r) for r in run["requests"] if r["ok"]]
    return {
        "TTFT": [r.ttft_s * 1e3 for r in done],
        "TPOT": [r.tpot_s * 1e3 for r in done if r.tpot_s is not None],
        "ITL": [gap * 1e3 for r in done for gap in r.itls_s],
        "E2EL": [r.e2el_s * 1e3 for r in done],
    }


def write_plots(result: dict, directory: str | Path) -> list[Path]:
    """Write the charts into `directory` (created if needed); return their paths."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in result["runs"]:
        for ax, values in zip(axes.flat, _latencies(run).values(), strict=True):
            if values:
                values = sorted(values)
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=load_label(run["load"]))
    for ax, name in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2EL"), strict=True):
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of samples", ylim=(0, 1.01))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    figure.suptitle(f"tuili bench: {result['config']['model']}")
    figure.tight_layout()
    written.append(directory / "latency_cdf.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    if len(result["runs"]) > 1:
        written.append(_sweep_plot(result, directory, plt))
    return written


def _sweep_plot(result: dict, directory: Path, plt) -> Path:
    runs = result["runs"]
    by_rate = all(run["load"]["request_rate"] is not None for run in runs)
    x = [run["load"]["request_rate"] if by_rate else run["load"]["concurrency"] for run in runs]
    summaries = [run["summary"] for run in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(x, [s["output_throughput"] or 0 for s in summaries], "o-", label="output tok/s")
    left.set(xlabel="offered request rate (req/s)" if by_rate else "concurrency", ylabel="output tokens/s",
             title="throughput against load")
    twin = left.twinx()
    twin.plot(x, [s["request_throughput"] or 0 for s in summaries], "s--", color="tab:orange", label="req/s")
    twin.set_ylabel("requests/s")
    left.legend(loc="upper left")
    twin.legend(loc="lower right")
    for field, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL")):
        p99 = [math.nan if s[field]["p99"] is None else s[field]["p99"] for s in summaries]
        right.plot(x, p99, "o-", label=f"{label} P99")
    right.set(xlabel=left.get_xlabel(), ylabel="ms", yscale="log", title="P99 latency against load")
    right.legend()
    for ax in (left, right):
        if not by_rate:
            ax.set_xscale("log", base=2)  # concurrencies double from point to point
        ax.grid(alpha=0.3)
    figure.tight_layout()
    path = directory / "sweep.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
