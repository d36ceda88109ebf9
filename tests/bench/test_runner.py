"""The runner's pure parts: URLs, load points, the saturation rule, configuration checks."""

import math

import pytest

from tuili.bench.loadgen import Load
from tuili.bench.runner import BenchConfig, root_url, saturated
from tuili.errors import TuiliError


def test_root_url_accepts_the_v1_form():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert root_url(url) == "http://h:8000"


def test_load_points():
    assert BenchConfig("http://x").loads() == [Load(concurrency=1)]
    assert BenchConfig("http://x", request_rate=3.0, concurrency=8, burstiness=0.5).loads() == [Load(8, 3.0, 0.5)]
    assert BenchConfig("http://x", sweep="concurrency", sweep_values=[1, 4]).loads() == [Load(1), Load(4)]
    assert BenchConfig("http://x", sweep="rate").loads() is None  # searching
    for load in (Load(2), Load(None, 2.5, 0.5), Load(4, math.inf)):
        assert Load.from_dict(load.to_dict()) == load
    assert Load(4, math.inf).describe() == "all at once, at most 4 in flight"


def point(throughput, rate=None, starts=()):
    return {"load": {"request_rate": rate}, "summary": {"request_throughput": throughput},
            "requests": [{"start_s": s} for s in starts]}


def test_saturation_rules():
    assert not saturated([])
    assert not saturated([point(10.0)])
    assert not saturated([point(10.0), point(11.0)])  # +10% is still growth
    assert saturated([point(10.0), point(10.9)])
    # Rates: the offered rate is measured from the start times (here 9 gaps over 1 s = 9 req/s).
    starts = [i / 9 for i in range(10)]
    assert not saturated([point(8.5, rate=12.0, starts=starts)])  # nominal 12, really offered 9
    assert saturated([point(7.5, rate=9.0, starts=starts)])  # completes < 90% of what arrived


@pytest.mark.parametrize("options, message", [
    ({"base_url": "localhost:8000"}, "an http:// or https:// URL"),
    ({"endpoint": "embeddings"}, "completions or chat"),
    ({"input_len": 0}, "--input-len 0 is invalid"),
    ({"burstiness": 0}, "--burstiness 0 is invalid"),
    ({"request_rate": -1.0}, "--request-rate -1.0 is invalid"),
    ({"sweep": "concurrency", "sweep_values": [1.5]}, "integers >= 1"),
    ({"duration": 0}, "--duration 0 is invalid"),
    ({"request_rate": math.inf, "duration": 5.0}, "would start requests without end"),
    ({"dataset": "x.jsonl"}, "--workload file and --dataset PATH go together"),
    ({"model_config": "config.json"}, "needs --hardware too"),
])
def test_bad_configurations(options, message):
    config = BenchConfig(**{"base_url": "http://x", **options})
    with pytest.raises(TuiliError, match=message.replace("+", r"\+").replace(".", r"\.")):
        config.validate()
