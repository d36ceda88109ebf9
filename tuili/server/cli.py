"""`tuili serve`: load a model and serve it over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys

from tuili.engine.cli import add_engine_args, engine_kwargs, parse_bytes, worker_rank_status
from tuili.errors import TuiliError
from tuili.server.tools import PARSERS as TOOL_PARSERS


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics). With no --model, serves the embedded "
        "SmolLM2-135M-Instruct. SIGINT / SIGTERM shut it down gracefully.",
    )
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on the API routes and /stats (/health, /metrics and the "
                      "pages stay open; the pages ask for the key)")
    http.add_argument("--root-path", default="",
                      help="the path prefix a reverse proxy serves this server under, e.g. /tuili (the proxy may "
                      "strip it or pass it on); the pages' links are relative, so they work under it")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="the names /v1/models lists and a request's model may give; the first is the default "
                      "(default: the model file or directory name)")
    http.add_argument("--allowed-hosts", default=None,
                      help="comma-separated host names the Host header may give, '*' for any (default: "
                      "localhost, 127.0.0.1 and ::1 when --host is a loopback address, else any)")
    http.add_argument("--special-tokens-in-messages", action="store_true",
                      help="parse special-token text in chat message content as special tokens, as before "
                      "(unsafe: a user message can then forge a system turn); by default content is plain text")
    http.add_argument("--max-waiting", type=int, default=None,
                      help="answer 503 while this many sequences wait to be scheduled (default: no limit)")
    http.add_argument("--max-sequences-per-request", type=int, default=256,
                      help="most sequences (prompts x n) one request may ask for; more get 400 (default 256)")
    http.add_argument("--max-request-bytes", type=parse_bytes, default=4 << 20,
                      help="largest request body accepted, e.g. 4MiB (default); larger ones get 413")
    http.add_argument("--header-timeout", type=float, default=10.0,
                      help="seconds a connection may take to send a request's headers before it is answered 408 "
                      "and closed (default 10)")
    http.add_argument("--body-timeout", type=float, default=60.0,
                      help="seconds from a request's headers to the end of its body before it is answered 408 "
                      "(default 60)")
    http.add_argument("--max-connections", type=int, default=1000,
                      help="most connections open at once; at the cap a new one evicts the one that has waited "
                      "longest for its request, or is refused 503 if all are busy (default 1000)")
    http.add_argument("--shutdown-grace", type=float, default=30.0,
                      help="seconds requests in flight get to finish after SIGINT / SIGTERM before they are "
                      "aborted (default 30)")
    http.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS],
                      help="how tool calls are read from a chat answer: hermes (<tool_call> JSON: Hermes, Qwen), "
                      "llama3_json (Llama 3.1+ JSON), mistral ([TOOL_CALLS]); auto (default): the one the chat "
                      "template's own format needs, hermes for a template that renders no tools")
    http.add_argument("--vllm-metric-names", action="store_true",
                      help="also export /metrics under vLLM's metric and label names (vllm:num_requests_running, "
                      "vllm:request_success{finished_reason}, ...), so a vLLM Grafana board works unchanged "
                      "(docs/server.md has the mapping)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(serve)
    # A server streams to people, so its steps are paced by default (tuili/engine/pacing.py).
    serve.set_defaults(func=run_serve, max_itl_stretch=2.0)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = worker_rank_status(args)  # torchrun's ranks other than 0 serve no HTTP
    if status is not None:
        return status
    try:
        _check_args(args)
        # Bind first: a port in use fails now, not after the model has loaded.
        sock = _bind(args.host, args.port)
    except (TuiliError, OSError) as e:
        print(f"tuili: error: {e}", file=sys.stderr)
        return 2
    with sock:
        try:
            engine = _load_engine(args)
        except TuiliError as e:
            print(f"tuili: error: {e}", file=sys.stderr)
            return 2
        return _serve(engine, args, sock)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise TuiliError(f"--port {args.port} is invalid: expected 0 to 65535")
    if args.max_waiting is not None and args.max_waiting < 1:
        raise TuiliError(f"--max-waiting {args.max_waiting} is invalid: expected at least 1")
    if args.max_sequences_per_request < 1:
        raise TuiliError(f"--max-sequences-per-request {args.max_sequences_per_request} is invalid: expected at least 1")
    if args.shutdown_grace < 0:
        raise TuiliError(f"--shutdown-grace {args.shutdown_grace} is invalid: expected seconds >= 0")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            raise TuiliError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: expected seconds > 0")
    if args.max_connections < 1:
        raise TuiliError(f"--max-connections {args.max_connections} is invalid: expected at least 1")
    _ensure_file_descriptors(args.max_connections)
    if args.max_request_bytes < 1024:
        raise TuiliError(f"--max-request-bytes {args.max_request_bytes} is invalid: expected at least 1KiB")
    allowed_hosts(args.allowed_hosts, args.host)  # raises on a bad list
    names = args.served_model_name or []
    if any(not name.strip() for name in names):
        raise TuiliError(f"--served-model-name {names} is invalid: a name is empty")
    if len(set(names)) != len(names):
        raise TuiliError(f"--served-model-name {names} is invalid: a name is given twice")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise TuiliError(f"--root-path {args.root_path!r} is invalid: expected a path like /tuili "
                         "(a leading slash, no trailing one)")
    if args.api_key is not None and not args.api_key:
        raise TuiliError("--api-key is empty: expected a key")


_SPARE_FDS = 256  # model files, the tokenizer, logs, threads: what the process needs besides connections


def _ensure_file_descriptors(max_connections: int) -> None:
    """Raise the soft open-files limit so --max-connections connections fit, or refuse to start."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + _SPARE_FDS
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise TuiliError(
            f"--max-connections {max_connections} needs {needed} open files but this process may have at "
            f"most {hard} (ulimit -Hn): lower --max-connections to {max(1, hard - _SPARE_FDS)} or raise the limit"
        )
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError) as e:  # e.g. above the kernel's nr_open
        raise TuiliError(
            f"--max-connections {max_connections} needs {needed} open files but raising the limit failed: {e}"
        ) from e


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(option: str | None, listen_host: str) -> frozenset[str] | None:
    """The host names requests may give (None: any). By default a server on a loopback address
    answers only loopback names, which is what stops DNS rebinding; one listening on another
    address is meant to be reached by names this process cannot know, so it answers any."""
    if option is None:
        try:
            loopback = ipaddress.ip_address(listen_host).is_loopback
        except ValueError:
            loopback = listen_host.lower() == "localhost"
        return _LOOPBACK_NAMES if loopback else None
    names = frozenset(name.strip().lower().strip("[]") for name in option.split(",") if name.strip())
    if "*" in names:
        return None
    if not names:
        raise TuiliError(f"--allowed-hosts {option!r} is invalid: expected comma-separated host names, or '*'")
    return names


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise TuiliError(f"--host {host!r} is not an address this machine can listen on: {e}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def _load_engine(args: argparse.Namespace):
    from tuili.config import EngineConfig
    from tuili.engine.core import LLMEngine

    return LLMEngine(EngineConfig(**engine_kwargs(args)))


def _serve(engine, args: argparse.Namespace, sock: socket.socket) -> int:
    from tuili.server.app import ServerSettings
    from tuili.server.serve import serve

    name, *more = args.served_model_name or [_default_name(engine.model_path)]
    settings = ServerSettings(name, args.api_key, args.max_waiting, args.max_request_bytes,
                              allowed_hosts(args.allowed_hosts, args.host), args.special_tokens_in_messages,
                              args.max_sequences_per_request, args.body_timeout, tuple(more), args.root_path,
                              args.tool_call_parser, vllm_metric_names=args.vllm_metric_names)
    if engine.parallel is not None:
        # A lost rank: the requests in flight have failed; shut down as SIGTERM does, then exit 1.
        engine.parallel.on_failure = lambda reason: os.kill(os.getpid(), signal.SIGTERM)
    serve(engine, settings, sock, args.shutdown_grace, args.log_level, args.access_log,
          header_timeout=args.header_timeout, max_connections=args.max_connections)
    engine.close()
    if not engine.healthy():
        print(f"tuili: error: {engine.parallel.failure}", file=sys.stderr)
        return 1
    return 0


def _default_name(path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name
