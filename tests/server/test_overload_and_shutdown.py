"""A full waiting queue answers 503; SIGTERM lets the request in flight finish, then exits 0.

Both run on the `tight_server` (one sequence running, at most one waiting); the shutdown test
ends that server, so it comes last in this module.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Write a long story about a dragon.", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def _first_events(response: httpx.Response, count: int):
    """Read until `count` data events have arrived; return the line iterator to go on with.

    Keep it referenced: a line iterator that is garbage-collected closes the response."""
    lines = response.iter_lines()
    seen = 0
    for line in lines:
        seen += line.startswith("data: ")
        if seen == count:
            return lines
    pytest.fail("the stream ended early")


def test_a_full_waiting_queue_answers_503(tight_server, scrape, wait_until):
    url = tight_server.url
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as running:
        rest = _first_events(running, 2)  # now it holds the one running slot
        waiting_result = {}
        waiting = threading.Thread(target=lambda: waiting_result.update(response=httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300)))
        waiting.start()
        wait_until(lambda: scrape(url), lambda m: m["tuili:num_sequences_waiting"] == 1)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "--max-waiting 1" in error["message"]
        del rest
    # Closing the first stream aborted it; the waiting request now runs to the end.
    waiting.join(timeout=300)
    assert waiting_result["response"].status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300).status_code == 200


def test_sigterm_finishes_the_stream_in_flight_then_exits_0(tight_server):
    url = tight_server.url
    tokens = 60  # a few seconds of decoding: still in flight after the signal
    body = {**LONG, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        rest = _first_events(response, 1)
        tight_server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert tight_server.process.poll() is None, "the server exited with a stream in flight"
        with pytest.raises(httpx.ConnectError):  # no new connections once shutting down
            httpx.get(f"{url}/health", timeout=10)
        events = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == tokens
    assert tight_server.process.wait(timeout=60) == 0
