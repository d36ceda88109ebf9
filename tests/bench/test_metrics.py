"""Summary statistics of hand-made request records, checked against the definitions in docs/bench.md
with the standard library's statistics module as the independent reference for percentiles."""

import statistics

import pytest

from tuili.bench.metrics import RequestRecord as R
from tuili.bench.metrics import describe, parse_percentiles, parse_slo, summarize
from tuili.errors import TuiliError


def ok(index, start, chunks, e2el, out, prompt=10):
    return R(index=index, session=index, turn=0, start_s=start, max_tokens=out, ok=True, ttft_s=chunks[0],
             e2el_s=e2el, chunk_times_s=chunks, prompt_tokens=prompt, output_tokens=out, token_source="usage")


def failed(index, start, kind, elapsed=0.01):
    return R(index=index, session=index, turn=0, start_s=start, max_tokens=5, error_kind=kind,
             error=f"{kind} happened", e2el_s=elapsed)


RECORDS = [
    ok(0, 0.0, [0.10, 0.12, 0.15, 0.16], 0.17, 4),
    ok(1, 0.05, [0.20, 0.30], 0.31, 3),          # one chunk carried two tokens
    ok(2, 0.10, [0.05], 0.06, 1),                 # a single token: TPOT undefined
    failed(3, 0.2, "http_500"),
    failed(4, 0.3, "http_500"),
    failed(5, 0.35, "timeout", elapsed=1.0),
]


def test_counts_throughputs_and_failures():
    s = summarize(RECORDS)
    assert (s["requests_sent"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["failures"] == {"http_500": 2, "timeout": 1}
    assert s["failure_reasons"]["timeout"] == "timeout happened"
    duration = (0.35 + 1.0) - 0.0  # first start to the last end, failed requests included
    assert s["duration_s"] == pytest.approx(duration)
    assert s["request_throughput"] == pytest.approx(3 / duration)
    assert s["output_throughput"] == pytest.approx((4 + 3 + 1) / duration)
    assert s["total_token_throughput"] == pytest.approx((30 + 8) / duration)
    assert s["goodput"] is None


def test_latencies_follow_their_definitions():
    s = summarize(RECORDS, percentiles=(50.0, 90.0, 99.0))
    ttfts = [100.0, 200.0, 50.0]
    tpots = [(0.17 - 0.10) / 3 * 1e3, (0.31 - 0.20) / 2 * 1e3]
    itls = [20.0, 30.0, 10.0, 100.0]
    e2els = [170.0, 310.0, 60.0]
    for key, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", itls), ("e2el_ms", e2els)):
        assert s[key]["count"] == len(values)
        assert s[key]["mean"] == pytest.approx(statistics.fmean(values))
        assert s[key]["std"] == pytest.approx(statistics.pstdev(values))
        cuts = statistics.quantiles(values, n=100, method="inclusive")  # cuts[k-1] is the k-th percentile
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(cuts[p - 1]), (key, p)


def test_goodput_counts_completed_requests_meeting_every_slo():
    # TTFTs 100, 200, 50 ms; TPOTs 23.3, 55 ms (none for the single-token request); E2ELs 170, 310, 60.
    s = summarize(RECORDS, slo={"ttft_ms": 150, "tpot_ms": 30})
    assert s["good_requests"] == 2  # requests 0 and 2; request 1 misses both limits
    assert s["goodput"] == pytest.approx(2 / s["duration_s"])
    assert summarize(RECORDS, slo={"e2el_ms": 100})["good_requests"] == 1
    assert summarize(RECORDS, slo={"e2el_ms": 1000})["goodput"] == pytest.approx(s["request_throughput"])


def test_no_completed_request_gives_empty_statistics():
    s = summarize([failed(0, 0.0, "connect")])
    assert s["completed"] == 0 and s["request_throughput"] == 0
    assert s["ttft_ms"] == describe([], (50.0, 90.0, 99.0))
    assert s["ttft_ms"]["mean"] is None and s["ttft_ms"]["p99"] is None
    assert summarize([])["request_throughput"] is None


def test_records_round_trip_through_json_dicts_without_text():
    record = RECORDS[0]
    record.text = "secret reply"
    data = record.to_dict()
    assert "text" not in data
    back = R.from_dict(data)
    assert back.tpot_s == record.tpot_s and back.itls_s == record.itls_s


def test_slo_parsing():
    assert parse_slo("ttft_ms=500, tpot_ms=50,e2el_ms=1e4") == {"ttft_ms": 500, "tpot_ms": 50, "e2el_ms": 1e4}
    for bad, named in (("ttft=5", "ttft=5"), ("ttft_ms=fast", "fast"), ("tpot_ms=-1", "-1"), ("", "empty")):
        with pytest.raises(TuiliError, match=named):
            parse_slo(bad)


def test_percentiles_always_include_50_90_99():
    assert parse_percentiles("") == (50.0, 90.0, 99.0)
    assert parse_percentiles("99.9, 25") == (25.0, 50.0, 90.0, 99.0, 99.9)
    with pytest.raises(TuiliError, match="101"):
        parse_percentiles("101")
