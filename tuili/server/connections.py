"""Connections that hold the server without sending a request: a header timeout and a cap.

uvicorn (over h11) waits forever for a request's headers: a client that opens connections and
sends a few header bytes now and then (slowloris) keeps each one, until the process runs out of
file descriptors and nothing, /health included, gets in. uvicorn's own `--limit-concurrency`
does not help: it counts those stalled connections against real requests and answers the real
ones 503. So the protocol here is uvicorn's h11 protocol plus:

* a header timeout: a connection waiting for a request's headers (a new one, or one kept
  alive between requests that has begun the next one) longer than `header_timeout` seconds is
  answered 408 and closed; one still receiving a body a second past `body_timeout` (measured
  from its headers) is closed;
* a connection cap: at `max_connections`, a new connection first evicts the connection that has
  waited longest for headers (a stalled one; a client that sends its request gets the slot back
  within milliseconds), and only when every connection is busy with a request is the new one
  answered 503 and closed.

The body has its own deadline at the ASGI level (app.py's body limit), where it can be
answered with an error the app formats.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_SWEEP_SECONDS = 0.5  # how often stalled connections are looked for (the timeout's resolution)


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    """The shared state of every connection of one server: what each waits for, since when."""

    def __init__(self, header_timeout: float, body_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        # conn -> (phase, since): "headers" (waiting for a request's headers), "body" (reading a
        # request's body), or "busy" (the request is read: the app answers it).
        self.phases: dict[GuardedH11Protocol, tuple[str, float]] = {}
        self._sweeping = False
        self._timeout_answer = _raw_error(
            408, "Request Timeout", f"the request's headers did not arrive within {header_timeout:g} seconds "
            "(the server's --header-timeout)", "header_timeout")
        self._full_answer = _raw_error(
            503, "Service Unavailable", f"the server has {max_connections} connections open, every one with a "
            "request in progress (--max-connections); retry later", "too_many_connections")

    def protocol(self) -> type[GuardedH11Protocol]:
        """A protocol class for uvicorn.Config(http=...), bound to this guard."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})

    def opened(self, conn: GuardedH11Protocol) -> None:
        if len(self.phases) >= self.max_connections:
            stalled = [(since, c) for c, (phase, since) in self.phases.items() if phase != "busy"]
            if not stalled:
                logger.warning("--max-connections %d reached, every connection busy: a new one is refused",
                               self.max_connections)
                conn.refuse(self._full_answer)
                return
            _, oldest = min(stalled, key=lambda item: item[0])
            self.phases.pop(oldest)
            oldest.transport.close()  # a connection that has not sent its request gets no answer
        self.phases[conn] = ("headers", time.monotonic())
        if not self._sweeping:
            self._sweeping = True
            asyncio.get_running_loop().call_later(_SWEEP_SECONDS, self._sweep)

    def update(self, conn: GuardedH11Protocol) -> None:
        """Note the phase `conn` is in now (after it received data or finished a response)."""
        if conn not in self.phases:
            return
        state = conn.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else "busy"
        if self.phases[conn][0] != phase:
            self.phases[conn] = (phase, time.monotonic())

    def closed(self, conn: GuardedH11Protocol) -> None:
        self.phases.pop(conn, None)

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn, (phase, since) in list(self.phases.items()):
            if phase == "headers" and now - since > self.header_timeout:
                self.phases.pop(conn)
                if not conn.transport.is_closing():
                    conn.transport.write(self._timeout_answer)
                    conn.transport.close()
            elif phase == "body" and now - since > self.body_timeout + 1.0:
                # The app answers 408 at the body timeout while it reads the body; this catches a
                # body still trickling in after the app answered without reading it.
                self.phases.pop(conn)
                conn.transport.close()
        if self.phases:
            asyncio.get_running_loop().call_later(_SWEEP_SECONDS, self._sweep)
        else:
            self._sweeping = False


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, registered with a ConnectionGuard (set by ConnectionGuard.protocol)."""

    guard: ConnectionGuard
    _refused = False

    def refuse(self, answer: bytes) -> None:
        """Answer `answer` and close, ignoring the request: the end of output is signalled
        first and the socket closed a second later, so a request the client already sent
        does not turn the close into a reset that destroys the answer before it is read."""
        self._refused = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.opened(self)

    def handle_events(self) -> None:
        super().handle_events()
        self.guard.update(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.guard.update(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        super().connection_lost(exc)
