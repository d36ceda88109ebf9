"""A client that leaves aborts its request, and the request's KV blocks are freed at once."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

ABORTED = "tuili:sequences_finished_total{finish_reason=abort}"
# Long enough that it is still running when the client leaves.
LONG = {"prompt": "Write a long story about a dragon.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _idle(metrics: dict[str, float]) -> bool:
    return metrics["tuili:num_sequences_running"] == 0 and metrics["tuili:num_sequences_waiting"] == 0


def test_a_client_leaving_mid_stream_aborts_its_request(server, auth, scrape, wait_until):
    idle = wait_until(lambda: scrape(server.url), _idle)
    assert idle["tuili:kv_cache_usage"] == 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, headers=auth,
                      timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # referenced until the block ends: dropping it closes the response
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events == 3:
                break
        busy = scrape(server.url)
        assert busy["tuili:num_sequences_running"] == 1 and busy["tuili:kv_cache_usage"] > 0
    # Leaving the block closed the connection.
    after = wait_until(lambda: scrape(server.url), lambda m: _idle(m) and m.get(ABORTED, 0) > idle.get(ABORTED, 0))
    assert after[ABORTED] == idle.get(ABORTED, 0) + 1
    assert after["tuili:kv_cache_usage"] == idle["tuili:kv_cache_usage"]


def test_a_client_leaving_a_non_streamed_call_aborts_it(server, auth, scrape, wait_until):
    idle = wait_until(lambda: scrape(server.url), _idle)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=auth, timeout=httpx.Timeout(10, read=3))
    after = wait_until(lambda: scrape(server.url), lambda m: _idle(m) and m.get(ABORTED, 0) > idle.get(ABORTED, 0))
    assert after[ABORTED] == idle.get(ABORTED, 0) + 1
    assert after["tuili:kv_cache_usage"] == idle["tuili:kv_cache_usage"]
