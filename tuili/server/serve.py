"""Run the app under uvicorn on an already-bound socket, with a graceful, status-0 shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn

from tuili.engine.core import LLMEngine
from tuili.server.app import ServerSettings, build_app
from tuili.server.connections import ConnectionGuard

logger = logging.getLogger(__name__)


# After the grace, aborted requests get this long to send their last events before uvicorn
# cancels what is left (a client that reads nothing: its stream's writes never complete).
_CUT_AFTER = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that after the graceful shutdown a SIGINT / SIGTERM started,
    the process ends normally (status 0); uvicorn would re-raise the signal and die of it.

    On the signal uvicorn stops accepting connections, closes idle ones and waits for the
    responses in flight. When `grace` seconds have passed, `on_grace_over` aborts every engine
    request, which ends each response and stream properly (finish_reason "abort", then
    [DONE]); uvicorn cancels what is still running `_CUT_AFTER` seconds later. The app's
    lifespan then stops the engine thread.
    """

    def __init__(self, config: uvicorn.Config, grace: float, on_grace_over: Callable[[], None]) -> None:
        config.timeout_graceful_shutdown = grace + _CUT_AFTER
        super().__init__(config)
        self.grace = grace
        self.on_grace_over = on_grace_over

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _grace_over(self) -> None:
        if self.server_state.tasks:
            logger.info("shutdown grace (%gs) is over: aborting the requests in flight", self.grace)
        self.on_grace_over()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(engine: LLMEngine, settings: ServerSettings, sock: socket.socket, shutdown_grace: float,
          log_level: str = "info", access_log: bool = False, header_timeout: float = 10.0,
          max_connections: int = 1000) -> None:
    """Serve until SIGINT / SIGTERM. `sock` is bound; listening starts here."""
    app = build_app(engine, settings)
    guard = ConnectionGuard(header_timeout, settings.body_timeout, max_connections)
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on", http=guard.protocol())
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    logger.info(
        "serving %s as %s: %s on %s, KV pool %d tokens, max_model_len %d, at http://%s:%d/v1",
        engine.model_path, ", ".join(map(repr, settings.model_names)), str(engine.dtype).removeprefix("torch."), engine.device,
        engine.pool.num_tokens, engine.max_model_len, url_host, port,
    )
    logger.info("chat page at http://%s:%d/, live dashboard at http://%s:%d/dashboard", url_host, port, url_host, port)
    GracefulServer(config, shutdown_grace, app.state.abort_all).run(sockets=[sock])
    logger.info("stopped")
