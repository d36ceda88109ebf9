"""Issue 20.5: connections that never finish their request cannot hold the server. Against a
real `tuili serve` with short timeouts and a small connection cap, driven over raw sockets."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.server.conftest import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 2, 3, 40


@pytest.fixture(scope="module")
def guarded():
    process = ServerProcess("--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                            "--max-connections", str(MAX_CONNECTIONS), *ENGINE_ARGS)
    yield process
    log = process.log
    process.stop()
    assert "Traceback" not in log, log


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _open(url: str, data: bytes) -> socket.socket:
    sock = socket.create_connection(_address(url), timeout=30)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(1 << 16):
        received += chunk
    return received


def _was_closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` without answering (an unread request makes that a reset)."""
    sock.settimeout(5)
    try:
        return _read_all(sock) == b""
    except ConnectionResetError:
        return True


PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def _partial_body(size: int = 1000) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{\"prompt\": " % size)


def test_slow_headers_are_answered_408_and_closed_after_the_timeout(guarded):
    url = guarded.url
    started = time.monotonic()
    with _open(url, PARTIAL_HEADERS) as sock:
        answer = _read_all(sock)  # returns when the server closes the connection
    elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT <= elapsed < HEADER_TIMEOUT + 3, elapsed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(body)["error"]
    assert error["code"] == "header_timeout" and "--header-timeout" in error["message"]


def test_a_slow_body_is_answered_408_after_the_timeout(guarded):
    url = guarded.url
    started = time.monotonic()
    with _open(url, _partial_body()) as sock:
        answer = _read_all(sock)
    elapsed = time.monotonic() - started
    assert BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 3, elapsed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and "--body-timeout" in error["message"]


def test_stalled_connections_past_the_cap_leave_room_for_real_requests(guarded):
    """Ten times --max-connections connections that send part of a request and stop: each new
    one evicts the oldest stalled one, so /health and a completion still get in."""
    url = guarded.url
    stalled = [_open(url, PARTIAL_HEADERS if i % 2 else _partial_body()) for i in range(10 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        for _ in range(3):
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert done.status_code == 200, done.text
        # The server holds at most the cap: the oldest stalled connections were closed.
        closed = sum(_was_closed(sock) for sock in stalled[: 8 * MAX_CONNECTIONS])
        assert closed >= 8 * MAX_CONNECTIONS - 5, closed
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.parametrize("argv, message", [
    (["--header-timeout", "0"], "--header-timeout 0.0 is invalid: expected seconds > 0"),
    (["--body-timeout", "-1"], "--body-timeout -1.0 is invalid: expected seconds > 0"),
    (["--max-connections", "0"], "--max-connections 0 is invalid: expected at least 1"),
    (["--max-connections", str(10**9)], "--max-connections 1000000000 needs 1000000256 open files"),
    (["--served-model-name", "a", "b", "a"], "--served-model-name ['a', 'b', 'a'] is invalid: a name is given twice"),
    (["--served-model-name", "a", " "], "--served-model-name ['a', ' '] is invalid: a name is empty"),
])
def test_bad_limits_are_refused_at_start(argv, message):
    import argparse

    from tuili.errors import TuiliError
    from tuili.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv])
    with pytest.raises(TuiliError) as refused:
        cli._check_args(args)
    assert message in str(refused.value)


def test_a_new_connection_is_refused_503_when_every_connection_is_busy(guarded):
    """--max-connections streams in flight (requests fully sent, being answered): nothing
    stalled to evict, so a new connection is answered 503 and closed; the streams go on."""
    url = guarded.url
    body = json.dumps({"prompt": "Tell a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    busy = [_open(url, request) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:  # each has its answer started
            assert sock.recv(12) == b"HTTP/1.1 200"
        with _open(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as refused:
            head, _, rest = _read_all(refused).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert json.loads(rest)["error"]["code"] == "too_many_connections"
        assert all(sock.recv(1 << 16) for sock in busy), "the streams in flight go on"
    finally:
        for sock in busy:
            sock.close()
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
