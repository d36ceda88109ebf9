"""Run the app under uvicorn on an already-bound socket, with a graceful, status-0 shutdown."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import uvicorn

from tuili.engine.core import LLMEngine
from tuili.server.app import ServerSettings, build_app

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that after the graceful shutdown a SIGINT / SIGTERM started,
    the process ends normally (status 0); uvicorn would re-raise the signal and die of it.

    On the signal uvicorn stops accepting connections, closes idle ones, waits up to
    `timeout_graceful_shutdown` for responses in flight, then cancels the rest (which aborts
    their engine requests); the app's lifespan then stops the engine thread.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(engine: LLMEngine, settings: ServerSettings, sock: socket.socket, shutdown_grace: float,
          log_level: str = "info", access_log: bool = False) -> None:
    """Serve until SIGINT / SIGTERM. `sock` is bound; listening starts here."""
    config = uvicorn.Config(
        build_app(engine, settings), log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=shutdown_grace, lifespan="on",
    )
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    logger.info(
        "serving %s as %r: %s on %s, KV pool %d tokens, max_model_len %d, at http://%s:%d/v1",
        engine.model_path, settings.model_name, str(engine.dtype).removeprefix("torch."), engine.device,
        engine.pool.num_tokens, engine.max_model_len, url_host, port,
    )
    GracefulServer(config).run(sockets=[sock])
    logger.info("stopped")
