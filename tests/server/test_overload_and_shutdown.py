"""A full waiting queue answers 503; SIGTERM lets the request in flight finish, then exits 0;
past --shutdown-grace every request ends with finish_reason "abort" (own server).

The first two run on the `tight_server` (one sequence running, at most one waiting); the SIGTERM test
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


def test_sigint_past_the_grace_ends_every_stream_with_abort_then_done():
    """Past --shutdown-grace the requests in flight are aborted, and each still ends properly:
    a stream with finish_reason "abort" (and its usage) then [DONE], a whole response with
    "abort"; the log has no traceback and the process exits 0."""
    from tests.server.conftest import ENGINE_ARGS, ServerProcess

    server = ServerProcess("--shutdown-grace", "1", *ENGINE_ARGS)
    try:
        url = server.url
        body = {**LONG, "max_tokens": 400, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
        whole = {}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as streamed, \
                httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as chat:
            rest, chat_rest = _first_events(streamed, 2), _first_events(chat, 2)
            plain = threading.Thread(target=lambda: whole.update(response=httpx.post(
                f"{url}/v1/completions", json={**LONG, "max_tokens": 400}, timeout=120)))
            plain.start()
            time.sleep(0.5)
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            events = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
            chat_events = [line.removeprefix("data: ") for line in chat_rest if line.startswith("data: ")]
            plain.join(timeout=60)
        assert time.monotonic() - started < 30, "the streams were not ended at the grace"
        assert events[-1] == "[DONE]" and chat_events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"]}
        assert reasons == {0: "abort", 1: "abort"}, reasons
        usage = chunks[-1]["usage"]
        assert 0 < usage["completion_tokens"] < 2 * 400
        assert json.loads(chat_events[-2])["choices"][0]["finish_reason"] == "abort"
        response = whole["response"]
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "abort"
        assert server.process.wait(timeout=60) == 0
        log = server.log
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
        assert "aborting the requests in flight" in log
    finally:
        server.stop()
