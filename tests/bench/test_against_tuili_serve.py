"""`tuili bench` against a real `tuili serve` process on loopback (the embedded SmolLM2).

The fake-server tests (test_bench.py) check the timings against known delays; these check what
only a real server can show: that the bench's counts agree with the server's own /metrics
counters, that every summary figure follows from the per-request timings stored in
--output, and that a shared-prefix run gets prefix-cache hits that the server confirms.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import pytest

from tuili.cli import main

BLOCK_SIZE = 16
_READY = re.compile(r"at (http://\S+)/v1")


@pytest.fixture(scope="module")
def tuili_server():
    """One `tuili serve` on an ephemeral loopback port for this module; yields its root URL."""
    log = Path(tempfile.mkstemp(prefix="tuili-bench-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "tuili.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--block-size", str(BLOCK_SIZE)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while (match := _READY.search(log.read_text())) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tuili serve did not start:\n{log.read_text()}", pytrace=False)
            time.sleep(0.2)
        yield match.group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.unlink()


def bench(capsys, tmp_path: Path, url: str, *options: str) -> tuple[dict, str]:
    """Run the `tuili bench` command; return its results.json and its printed report."""
    output = tmp_path / "results.json"
    assert main(["bench", "--base-url", url, "--no-progress", "--output", str(output), *options]) == 0
    return json.loads(output.read_text()), capsys.readouterr().out


def server_delta(run: dict, name: str, label: str = "") -> float:
    """The increase of one of the server's counters over the run, summed over its label sets."""
    entries = [e for key, e in run["server_metrics"].items() if key.split("{")[0] == name and label in key]
    assert entries, f"the server exported no {name}{{{label}}}"
    return sum(e["run"] for e in entries)


def percentile(values: list[float], p: int) -> float:
    """Linear interpolation between order statistics (the definition in docs/bench.md), by statistics."""
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def test_summary_follows_from_timings_and_agrees_with_the_server(tuili_server, capsys, tmp_path):
    requests, tokens = 8, 6
    slo = {"ttft_ms": 1500.0, "tpot_ms": 300.0}
    result, out = bench(capsys, tmp_path, tuili_server, "--concurrency", "3", "--num-requests", str(requests),
                        "--warmup", "2", "--input-len", "32", "--output-len", str(tokens), "--ignore-eos",
                        "--slo", ",".join(f"{k}={v}" for k, v in slo.items()))
    assert result["config"]["prompt_check"] == "server"
    run = result["runs"][0]
    s, records = run["summary"], run["requests"]

    # Counts: the client's and the server's (which saw the 2 warmup requests before the run).
    assert s["requests_sent"] == s["completed"] == len(records) == requests and s["failed"] == 0
    assert sorted(r["index"] for r in records) == list(range(requests))
    assert server_delta(run, "tuili:sequences_finished_total", 'finish_reason="length"') == requests
    assert s["token_sources"] == {"usage": requests}
    assert s["output_tokens"] == requests * tokens == server_delta(run, "tuili:generation_tokens_total")
    assert s["input_tokens"] == server_delta(run, "tuili:prompt_tokens_total")
    assert re.search(rf"Requests sent / completed / failed\s+{requests} / {requests} / 0\n", out)

    for r in records:
        assert r["ok"] and r["output_tokens"] == r["max_tokens"] == tokens
        # The prompt was built to 32 tokens (or the nearest a whole word allows) by /tokenize.
        assert r["prompt_tokens"] == r["expected_prompt_tokens"] and abs(r["prompt_tokens"] - 32) <= 2
        times = r["chunk_times_s"]
        assert 0 < r["ttft_s"] == times[0] and times == sorted(times) and times[-1] <= r["e2el_s"]
        assert r["ttft_s"] <= r["e2el_s"]

    # TPOT = (E2EL - TTFT) / (output tokens - 1) per request; ITL = every gap between text chunks.
    tpots = [(r["e2el_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3 for r in records]
    assert s["tpot_ms"]["count"] == requests
    assert s["tpot_ms"]["mean"] == pytest.approx(statistics.fmean(tpots))
    assert s["tpot_ms"]["p50"] == pytest.approx(statistics.median(tpots))
    assert s["tpot_ms"]["p90"] == pytest.approx(percentile(tpots, 90))
    itls = [(b - a) * 1e3 for r in records for a, b in pairwise(r["chunk_times_s"])]
    assert s["itl_ms"]["count"] == len(itls) and s["itl_ms"]["p50"] == pytest.approx(statistics.median(itls))
    assert s["ttft_ms"]["p50"] == pytest.approx(statistics.median(r["ttft_s"] * 1e3 for r in records))

    # Rates over the run's duration, and goodput counted by hand against the SLO.
    duration = max(r["start_s"] + r["e2el_s"] for r in records) - min(r["start_s"] for r in records)
    assert s["duration_s"] == pytest.approx(duration)
    assert s["request_throughput"] == pytest.approx(requests / duration)
    good = sum(r["ttft_s"] * 1e3 <= slo["ttft_ms"] and tpot <= slo["tpot_ms"] for r, tpot in zip(records, tpots, strict=True))
    assert s["good_requests"] == good
    assert s["goodput"] == pytest.approx(good / duration) and s["goodput"] <= s["request_throughput"]

    # The server's own utilization, from its counters' increase over the run.
    assert run["server_utilization"]["source"] == "counters over the run"
    assert run["server_utilization"]["prefill_mfu"] > 0 and run["server_utilization"]["decode_mbu"] > 0


def test_shared_prefix_run_hits_the_servers_prefix_cache(tuili_server, capsys, tmp_path):
    groups, questions, prefix_len, question_len = 2, 3, 64, 8
    result, out = bench(capsys, tmp_path, tuili_server, "--workload", "shared-prefix", "--endpoint", "chat",
                        "--prefix-groups", str(groups), "--questions-per-prefix", str(questions),
                        "--prefix-len", str(prefix_len), "--input-len", str(question_len),
                        "--output-len", "2", "--concurrency", "1")
    run = result["runs"][0]
    s, records = run["summary"], run["requests"]
    assert s["completed"] == len(records) == groups * questions

    # One request at a time: every question after its group's first finds the system prompt's
    # full blocks cached, and nothing of its own (unique) question.
    hits = [r for r in records if r["cached_tokens"]]
    assert len(hits) >= groups * (questions - 1)
    for r in hits:
        assert prefix_len - BLOCK_SIZE <= r["cached_tokens"] <= r["prompt_tokens"] - question_len
        assert r["cached_tokens"] % BLOCK_SIZE == 0

    # The report shows the hits, and the server agrees: prompt tokens it was given minus those its
    # prefill computed are the tokens its cache served.
    cached = sum(r["cached_tokens"] for r in records)
    assert s["cached_tokens"] == cached > 0
    served = server_delta(run, "tuili:prompt_tokens_total") - server_delta(run, "tuili:prefill_tokens_total")
    assert served == cached
    assert re.search(rf"Input tokens from the prefix cache\s+{cached} \(", out)


def test_no_load_point_replays_the_prompts_of_another(tuili_server, capsys, tmp_path):
    # With a prefix cache, a point that resent the warmup's (or an earlier point's) prompts would
    # get cache hits that flatter its TTFT. Every prompt here has a full block, so a replay shows.
    # (A seed of its own: the same seed and lengths as another test's run would replay that run.)
    result, _ = bench(capsys, tmp_path, tuili_server, "--seed", "3", "--sweep", "concurrency=1,1,1", "--warmup", "1",
                      "--num-requests", "2", "--input-len", str(2 * BLOCK_SIZE), "--output-len", "2")
    assert [run["summary"]["completed"] for run in result["runs"]] == [2, 2, 2]
    assert [run["summary"]["cached_tokens"] for run in result["runs"]] == [0, 0, 0]
