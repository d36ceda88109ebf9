"""The HTTP routes of `tuili serve`: an OpenAI-compatible API over one engine.

FastAPI because its pydantic request models give strict validation, clear per-field errors
and an OpenAPI schema from the same declarations (the property-based test runs against that
schema), and because it is what OpenAI-compatible servers (vLLM, SGLang) are built on.

    POST /v1/completions, /v1/chat/completions   generation, streamed or not  (key)
    POST /v1/responses                           the Responses API, text only (key; responses.py)
    POST /v1/embeddings                          pooled final hidden states   (key)
    GET  /v1/models, /v1/models/{id}             the served model             (key)
    POST /tokenize, /detokenize                  the model's tokenizer        (key)
    GET  /health                                 200 while the engine thread lives
    GET  /metrics                                Prometheus text format
    GET  /, /dashboard, /static/...              the chat and dashboard pages (web.py)
    GET  /stats                                  the dashboard's figures as JSON  (key)

With --api-key, the routes marked (key) need `Authorization: Bearer KEY`; /health and
/metrics stay open for load balancers and scrapers, and the pages load (their calls need the
key). Every request's Host header must name one of --allowed-hosts (on a loopback address, by
default only loopback names: a web page cannot reach a key-less local server through DNS
rebinding), and a body must be declared JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tuili.engine.block_manager import CacheStats
from tuili.engine.core import LLMEngine
from tuili.engine.spec.speculator import SpecStats
from tuili.engine.state_checkpoints import CheckpointStats
from tuili.perf.meter import UtilizationMeter
from tuili.server.driver import EngineDriver
from tuili.server.embeddings import Embedder, finish_embedding, start_embedding
from tuili.server.errors import ApiError, as_api_error, install_error_handlers
from tuili.server.generation import (
    Backend,
    Generation,
    check_model,
    complete,
    start_chat,
    start_completion,
    stream,
)
from tuili.server.metrics import CONTENT_TYPE, ServerMetrics
from tuili.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedFieldError,
)
from tuili.server.responses import (
    ResponseObject,
    ResponsesRequest,
    complete_response,
    start_response,
    stream_response,
)
from tuili.server.tokenization import PromptTokenizer
from tuili.server.web import LiveStats, StepLog, install_pages, is_public

T = TypeVar("T")
logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 500, 503)}
_STREAMABLE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    max_request_bytes: int = 4 << 20
    allowed_hosts: frozenset[str] | None = None  # lowercased host names without ports; None: any
    content_special_tokens: bool = False  # parse special-token text in message content (unsafe)
    max_sequences_per_request: int = 256
    body_timeout: float = 60.0  # seconds from a request's headers to the end of its body (--body-timeout)
    more_model_names: tuple[str, ...] = ()  # --served-model-name's other names, after model_name
    root_path: str = ""  # --root-path: the path prefix a reverse proxy serves the app under
    tool_call_parser: str = "auto"  # --tool-call-parser (tuili/server/tools.py)
    vllm_metric_names: bool = False  # --vllm-metric-names: /metrics also under vLLM's names (metrics.py)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.more_model_names)


def _cache_samples(stats: CacheStats) -> dict[str, float]:
    """Prefix-cache counters, in prompt tokens: looked up, and served per tier."""
    return {
        "tuili:prefix_cache_queries_total": float(stats.queried_tokens),
        "tuili:prefix_cache_hits_total": float(stats.hit_tokens),
        "tuili:prefix_cache_device_hits_total": float(stats.device_hit_tokens),
        "tuili:prefix_cache_host_hits_total": float(stats.host_hit_tokens),
    }


def _checkpoint_samples(stats: CheckpointStats | None) -> dict[str, float]:
    """A hybrid model's state checkpoints (its prefix cache for the linear-attention layers)."""
    if stats is None:
        return {}
    return {
        "tuili:state_checkpoints_saved_total": float(stats.saved),
        "tuili:state_checkpoints_restored_total": float(stats.restored),
        "tuili:state_checkpoints_evicted_total": float(stats.evicted),
        "tuili:state_checkpoints_filed": float(stats.filed),
        "tuili:state_checkpoints_capacity": float(stats.capacity),
        "tuili:state_checkpoints_spilled_total": float(stats.spilled),
        "tuili:state_checkpoints_host_restored_total": float(stats.host_restored),
    }


def _spec_samples(stats: SpecStats | None) -> dict[str, float]:
    """Speculative decoding's counters (vLLM's spec_decode names), when it is on."""
    if stats is None:
        return {}
    return {
        "tuili:spec_decode_num_drafts_total": float(stats.num_verifications),
        "tuili:spec_decode_num_draft_tokens_total": float(stats.num_proposed_tokens),
        "tuili:spec_decode_num_accepted_tokens_total": float(stats.num_accepted_tokens),
        "tuili:spec_decode_num_emitted_tokens_total": float(stats.num_emitted_tokens),
        "tuili:spec_decode_acceptance_rate": stats.acceptance_rate,
        "tuili:spec_decode_tokens_per_step": stats.tokens_per_verification,
    }


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `engine`; the engine thread starts with the app and stops with it."""
    meter = UtilizationMeter.for_engine(engine)
    engine.add_observer(meter)

    def utilization() -> dict[str, float]:  # read at each scrape, on the HTTP side
        # Tensor parallelism: rank 0's seconds in all-reduces and the logits gather; pipeline
        # parallelism: in its sends and receives between stages (0 on one device).
        pipeline = engine.stage is not None
        communication = {
            "tuili:tensor_parallel_communication_seconds_total": 0.0 if pipeline else engine.communication_seconds(),
            "tuili:pipeline_parallel_communication_seconds_total": engine.communication_seconds() if pipeline else 0.0,
        }
        stats = driver.stats
        return {**meter.summary().prometheus(), **_cache_samples(stats.prefix_cache), **_spec_samples(stats.spec),
                **_checkpoint_samples(stats.state_checkpoints), **communication}

    metrics = ServerMetrics(settings.model_name, utilization, engine.max_model_len, settings.vllm_metric_names)
    driver = EngineDriver(engine, metrics, settings.max_waiting)
    tokenizer = PromptTokenizer(engine.tokenizer, engine.model_config.vocab_size, settings.content_special_tokens)
    backend = Backend(driver, tokenizer, settings.model_names, engine.max_model_len, settings.max_sequences_per_request,
                      settings.tool_call_parser)
    started = int(time.time())
    steps = StepLog(meter)
    engine.add_observer(steps)
    live = LiveStats(engine, metrics, meter, steps, lambda: driver.stats, settings.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        driver.start()
        live.start()
        try:
            yield
        finally:  # uvicorn has already waited out (or cancelled) the requests in flight
            await live.stop()
            await driver.stop()
            tokenizer.close()

    app = FastAPI(title="tuili", version="0.1.0", lifespan=lifespan, root_path=settings.root_path,
                  description="An OpenAI-compatible API over the tuili engine.")
    app.state.abort_all = driver.abort_all  # shutdown's grace is over (serve.py)
    install_error_handlers(app)
    app.add_middleware(_LimitBody, limit=settings.max_request_bytes, timeout=settings.body_timeout)
    app.add_middleware(_RequireJson)
    if settings.api_key:  # added late, so it runs early: no key, no body read
        app.add_middleware(_RequireApiKey, key=settings.api_key)
    if settings.allowed_hosts is not None:  # first of all: a foreign Host learns nothing, not even 401
        app.add_middleware(_CheckHost, allowed=settings.allowed_hosts)
    app.add_middleware(_QuietShutdownCut, closing=lambda: driver.closing)

    @app.get("/health", responses=_ERRORS)
    async def health() -> dict:
        if not driver.alive:
            raise ApiError(503, "the engine thread has stopped", type="server_error")
        return {}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        # The name, not the model's local path: that would tell any client about the server's disk.
        return ModelCard(id=name, created=started, root=settings.model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in settings.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        check_model(backend, model_id)
        return card(model_id)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_STREAMABLE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        gen = await _answer_errors(start_completion(backend, body, arrival), CompletionRequest)
        return await _respond(gen, body.stream, body.stream_options, request, driver)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_STREAMABLE})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        gen = await _answer_errors(start_chat(backend, body, arrival), ChatCompletionRequest)
        return await _respond(gen, body.stream, body.stream_options, request, driver)

    @app.post("/v1/responses", response_model=ResponseObject, responses={**_ERRORS, **_STREAMABLE})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        call = await _answer_errors(start_response(backend, body, arrival), ResponsesRequest)
        if body.stream:
            return _EventStream(stream_response(call), on_close=lambda: driver.release(call.gen.submission))
        return await _whole_response(request, complete_response(call), lambda: driver.release(call.gen.submission))

    embedder = Embedder(backend, engine.config.pooler_config, engine.model_config.hidden_size)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        arrival = time.monotonic()
        call = await _answer_errors(start_embedding(embedder, body, arrival), EmbeddingRequest)
        return await _whole_response(request, finish_embedding(call), lambda: driver.release(call.submission))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(backend, body.model)
        try:
            body.check_supported()
        except UnsupportedFieldError as error:
            raise as_api_error(error, set(TokenizeRequest.model_fields)) from error
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt (text) and messages (a chat)", param="prompt")
        if body.prompt is not None:
            ids = await _answer_errors(tokenizer.encode(body.prompt, body.add_special_tokens), TokenizeRequest)
        else:
            messages = [message.as_template_input() for message in body.messages]
            ids = await _answer_errors(
                tokenizer.apply_chat_template(messages, body.add_generation_prompt), TokenizeRequest
            )
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(backend, body.model)
        return DetokenizeResponse(prompt=await _answer_errors(tokenizer.decode(body.tokens), DetokenizeRequest))

    install_pages(app, live)
    return app


async def _answer_errors(work: Awaitable[T], model: type) -> T:
    """Await `work`, turning a refusal into the API error whose `param` names the field."""
    try:
        return await work
    except ApiError:
        raise
    except Exception as error:
        raise as_api_error(error, set(model.model_fields)) from error


async def _respond(gen: Generation, streaming: bool, stream_options, request: Request, driver: EngineDriver) -> Response:
    if streaming:
        include_usage = bool(stream_options and stream_options.include_usage)
        return _EventStream(stream(gen, include_usage), on_close=lambda: driver.release(gen.submission))
    return await _whole_response(request, complete(gen), lambda: driver.release(gen.submission))


async def _whole_response(request: Request, work: Awaitable[BaseModel], release: Callable[[], None]) -> Response:
    """`work`'s result as a JSON response (499 if the client left first), `release` run after
    on every path."""
    try:
        result = await _unless_disconnected(request, work)
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return Response(result.model_dump_json(), media_type="application/json")
    except ApiError:
        raise
    except Exception as error:
        raise as_api_error(error) from error
    finally:
        release()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None as soon as the client disconnects (then `work` is cancelled)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        watcher.cancel()


class _EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends: finished, failed,
    or cancelled because the client disconnected (Starlette cancels the stream then)."""

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _QuietShutdownCut:
    """ASGI middleware, outermost: a response that uvicorn cancels at shutdown (its client read
    nothing, even after every request was aborted) ends with one log line, not a traceback."""

    def __init__(self, app: ASGIApp, closing) -> None:
        self.app = app
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope["type"] != "http" or not self.closing():
                raise
            logger.warning("%s %s was cut at shutdown: its client was not reading", scope["method"], scope["path"])


class _LimitBody:
    """ASGI middleware: a body over `limit` bytes is answered 413, at once when Content-Length
    declares it (after reading and discarding what the client sends, so that it reads the
    answer instead of a reset connection), else as soon as the bytes received pass it. A body
    not complete `timeout` seconds after the request began is answered 408 (and the connection
    closed), so a client trickling a body in cannot hold a request open forever."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = 60.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        self._message = f"the request body is larger than {limit} bytes, the most this server accepts"
        self._late = f"the request body did not arrive within {timeout:g} seconds (the server's --body-timeout)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout
        complete = False

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on, not on 3.10
                raise HTTPException(408, self._late, headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            return message

        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            try:
                while (message := await timed())["type"] == "http.request" and message.get("more_body"):
                    pass
            except HTTPException:
                pass  # answer the 413 all the same; the connection closes after it
            error = ApiError(413, self._message, code="request_too_large")
            return await error.response()(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await timed()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self._message)  # FastAPI re-raises it from its body read
            return message

        await self.app(scope, counted, send)


class _RequireApiKey:
    """ASGI middleware: every route but /health, /metrics, the API docs and the pages (not the
    calls they make) needs the key.

    It answers before the body is read, so an unauthenticated caller gets 401 whatever it sent.
    """

    _OPEN = ("/health", "/metrics", "/openapi.json", "/docs", "/redoc")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        if scope["type"] != "http" or path in self._OPEN or path.startswith("/docs") or is_public(path):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        if given is None or not hmac.compare_digest(given, self._expected):
            message = "no API key given" if given is None else "the API key is wrong"
            error = ApiError(401, f"{message}: send the server's key as 'Authorization: Bearer KEY'",
                             code="invalid_api_key")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the routes match: without the root path when the client sent it (a proxy that
    forwards the prefix), as it is when not (a proxy that strips it). Starlette routes alike."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


def host_name(header: bytes) -> str:
    """The host of a Host header, lowercased, without its port ("[::1]:8000" -> "::1")."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _CheckHost:
    """ASGI middleware: answer 400 to a request whose Host header names none of `allowed`.

    A browser sends the name it resolved; a page on evil.example that rebinds that name to
    127.0.0.1 can otherwise drive a key-less local server (DNS rebinding)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed
        self._expected = ", ".join(sorted(allowed))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host")
        if header is None or host_name(header) not in self.allowed:
            given = "no Host header" if header is None else f"Host {header.decode('latin-1')!r}"
            error = ApiError(400, f"{given} is not a name this server answers to: expected one of "
                             f"{self._expected} (the server's --allowed-hosts)", code="host_not_allowed")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class _RequireJson:
    """ASGI middleware: a POST body must be declared `application/json`, else 415.

    Parsing any body as JSON would let a web form (text/plain, sent cross-site without a
    CORS preflight) post to the API."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
        if declared.split(";", 1)[0].strip().lower() != "application/json":
            given = f"Content-Type {declared!r}" if declared else "no Content-Type"
            error = ApiError(415, f"the request has {given}: expected application/json",
                             code="unsupported_media_type")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
