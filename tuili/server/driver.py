"""The engine's own thread, and the asyncio side's handle on it.

`LLMEngine` is not thread-safe, so exactly one thread — the engine thread — ever touches it.
That thread loops: take the commands the HTTP side queued (add these prompts, abort that
request), run one `engine.step()`, and hand the step's outputs back to the event loop with one
`loop.call_soon_threadsafe` per step. When the engine has nothing to do, the thread blocks on
its command queue, so an idle server burns no CPU. Every connection is served by the same step
loop, which is what makes the batching continuous: a request that arrives mid-generation joins
at the next step.

On the asyncio side an API call is a `Submission`: its engine requests (one per prompt) and
their newest outputs. Engine outputs are cumulative (text and token ids only grow), so a
reader that falls behind loses nothing by seeing only the newest one; a slow client therefore
costs memory for one output per request, never a growing queue.

Metrics are recorded on the engine thread, where the step's timings are known; it also
publishes the engine's `stats()` snapshot after every iteration (`EngineDriver.stats`), which
other threads read instead of the engine.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tuili.engine.core import LLMEngine
from tuili.engine.request import RequestOutput
from tuili.engine.stats import EngineStats
from tuili.pooling import PoolerConfig
from tuili.sampling import SamplingParams
from tuili.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The engine's waiting queue is at --max-waiting; the client should retry later."""


class ShuttingDownError(Exception):
    """The server is shutting down and its grace period is over: no new request is taken."""


class EngineError(Exception):
    """The engine failed while running a request (a bug, logged with its traceback)."""


class Submission:
    """One API call's engine requests, read on the event loop.

    Written only through `_receive` / `_fail`, which the engine thread schedules on the loop.
    """

    def __init__(self, request_ids: list[str], arrival_time: float, group: str | None = None) -> None:
        self.request_ids = request_ids
        self.group = group  # the engine schedules the call's requests fairly against other calls
        self.arrival_time = arrival_time  # when the HTTP side received the call (time.monotonic)
        self._fresh: dict[str, RequestOutput] = {}  # newest output not yet read, per request
        self._final: dict[str, RequestOutput] = {}
        self._changed = asyncio.Event()
        self._error: Exception | None = None

    @property
    def finished(self) -> bool:
        return len(self._final) == len(self.request_ids)

    def _receive(self, output: RequestOutput) -> None:
        self._fresh[output.request_id] = output
        if output.finished:
            self._final[output.request_id] = output
        self._changed.set()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._changed.set()

    async def updates(self) -> AsyncIterator[list[RequestOutput]]:
        """The newest outputs of the requests that progressed, until every request has finished.

        Raises EngineError if the engine failed while running them.
        """
        while True:
            if self._error is not None:
                raise self._error
            if self._fresh:
                batch = list(self._fresh.values())
                self._fresh.clear()
                yield batch
            elif self.finished:
                return
            else:
                await self._changed.wait()
                self._changed.clear()

    async def final(self) -> list[RequestOutput]:
        """The finished outputs, one per request, in submission order."""
        async for _ in self.updates():
            pass
        return [self._final[request_id] for request_id in self.request_ids]


@dataclass
class _Add:
    submission: Submission
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    future: asyncio.Future
    pooling: PoolerConfig | None = None  # an embedding call (tuili/server/embeddings.py)


@dataclass
class _Abort:
    submission: Submission


class _AbortAll:
    """Shutdown's grace is over: abort every request, but deliver their final outputs
    (finish_reason "abort"), so that every response and stream still ends properly."""


_STOP = object()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one engine request, for delivery and metrics."""

    submission: Submission
    num_choices: int
    tokens_seen: int = 0
    last_token_time: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> reason


class EngineDriver:
    """Owns the engine thread. Create it, `start()` it from the event loop, `stop()` at shutdown."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self.stats: EngineStats = engine.stats()  # replaced whole by the engine thread, so any thread may read it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = False  # set by the engine thread when it fails
        self._closing = False  # set by abort_all(): new requests are refused
        self._thread = threading.Thread(target=self._run, name="tuili-engine", daemon=True)

    # ---- the asyncio side --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead and self.engine.healthy()

    async def submit(
        self,
        api_id: str,
        prompts: list[list[int]],
        prompt_texts: list[str | None],
        params: SamplingParams,
        arrival_time: float,
        pooling: PoolerConfig | None = None,
    ) -> Submission:
        """Queue one engine request per prompt (all or none); return once the engine has them.
        With `pooling` they are embedding requests (`params` unused).

        Raises RequestError or ValueError for a request the engine refuses, QueueFullError
        when --max-waiting is reached.
        """
        submission = Submission([f"{api_id}-{i}" for i in range(len(prompts))], arrival_time, group=api_id)
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Add(submission, prompts, prompt_texts, params, future, pooling))
        if self._dead:  # checked after the put: a thread that died before it will not drain it
            raise EngineError("the engine thread has stopped (see the server log)")
        try:
            await future
        except asyncio.CancelledError:
            # The client left before the engine took the request: take it back out.
            self.release(submission)
            raise
        return submission

    def release(self, submission: Submission) -> None:
        """The caller is done with `submission`: abort what is unfinished, freeing its KV blocks now."""
        if not submission.finished:
            self._commands.put(_Abort(submission))

    @property
    def closing(self) -> bool:
        """Whether abort_all() was called: the server is shutting down."""
        return self._closing

    def abort_all(self) -> None:
        """End every request now, as shutdown does once its grace is over: each gets its final
        output with finish_reason "abort" on the choices that had not finished, so streams end
        with a finish reason and [DONE]; requests submitted from now on are refused (503)."""
        self._closing = True
        self._commands.put(_AbortAll())

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running and end the engine thread."""
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug: say so, and leave no caller waiting forever
            logger.exception("the engine thread failed; this server can no longer generate")
            self._dead = True
            error = EngineError("the engine thread has stopped (see the server log)")
            self._fail_all(error)
            for command in self._take_commands(block=False):
                if isinstance(command, _Add):
                    self._call_soon(_settle, command.future, error)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            for command in self._take_commands(block=not engine.has_unfinished_requests()):
                if command is _STOP:
                    self._abort(list(self._tracked))
                    return
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _AbortAll):
                    # Stay tracked: the next step() returns their final outputs, which are delivered.
                    for request_id in self._tracked:
                        engine.abort_request(request_id)
                else:
                    self._abort([r for r in command.submission.request_ids if r in self._tracked])
            if engine.has_unfinished_requests():
                self._step()
                if not engine.has_unfinished_requests():
                    _trim_heap()
            self.stats = stats = engine.stats()
            self.metrics.set_engine_state(stats.num_running, stats.num_waiting, stats.kv_cache_usage)

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add) -> None:
        engine, sub = self.engine, command.submission
        try:
            if self._closing:
                raise ShuttingDownError("the server is shutting down and takes no new requests")
            waiting = engine.stats().num_waiting
            incoming = len(command.prompts) * command.params.n
            # The sequences this call adds count, not only the queue before it. An empty queue
            # takes any call (one may ask for more than --max-waiting, up to
            # --max-sequences-per-request), or such a call could never run.
            if self.max_waiting is not None and waiting and waiting + incoming > self.max_waiting:
                raise QueueFullError(
                    f"the server is at capacity: {waiting} sequences are waiting and this request adds "
                    f"{incoming} (--max-waiting {self.max_waiting}); retry later"
                )
            added: list[str] = []
            try:
                for request_id, ids, text in zip(sub.request_ids, command.prompts, command.prompt_texts, strict=True):
                    engine.add_request({"prompt_token_ids": ids, "prompt": text}, command.params, request_id,
                                       group=sub.group, pooling=command.pooling)
                    added.append(request_id)
            except BaseException:
                for request_id in added:
                    engine.abort_request(request_id)
                raise
        except Exception as error:  # RequestError, ValueError, QueueFullError, ShuttingDownError: the caller's answer
            self._call_soon(_settle, command.future, error)
            return
        for request_id, ids in zip(sub.request_ids, command.prompts, strict=True):
            self._tracked[request_id] = _Tracked(sub, command.params.n)
            self.metrics.prompt_tokens.inc(len(ids))
        self._call_soon(_settle, command.future, None)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            tracked = self._tracked.pop(request_id)
            aborted = tracked.num_choices - len(tracked.finish_reasons)
            if aborted:
                self.metrics.count_finished("abort", aborted)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineError("the engine failed while running this request (see the server log)"))
            return
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted in this same iteration
                continue
            self._record(tracked, output, now)
            deliveries.append((tracked.submission, output))
            if output.finished:
                del self._tracked[output.request_id]
        if deliveries:
            self._call_soon(_deliver, deliveries)

    def _record(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        m, times = self.metrics, output.metrics
        tokens = sum(len(choice.token_ids) for choice in output.outputs)
        new_tokens = tokens - tracked.tokens_seen
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if tracked.last_token_time is None:
                first_token = times.first_token_time if times and times.first_token_time else now
                m.time_to_first_token.observe(first_token - tracked.submission.arrival_time)
                if times and times.first_scheduled_time:
                    m.queue_time.observe(times.first_scheduled_time - tracked.submission.arrival_time)
            else:
                m.inter_token_latency.observe(now - tracked.last_token_time)
            tracked.tokens_seen, tracked.last_token_time = tokens, now
        for choice in output.outputs:
            if choice.finish_reason is not None and choice.index not in tracked.finish_reasons:
                tracked.finish_reasons[choice.index] = choice.finish_reason
                m.count_finished(choice.finish_reason)
        if output.finished:
            finished = times.finished_time if times and times.finished_time else now
            m.e2e_latency.observe(finished - tracked.submission.arrival_time)
            m.observe_finished(len(output.prompt_token_ids), [len(c.token_ids) for c in output.outputs],
                               times.first_scheduled_time if times else None,
                               times.first_token_time if times else None, finished)
            if output.embedding is not None:  # no choices, no tokens: one sequence, queued like any other
                m.count_finished("stop")
                if times and times.first_scheduled_time:
                    m.queue_time.observe(times.first_scheduled_time - tracked.submission.arrival_time)

    def _fail_all(self, error: Exception) -> None:
        failed = {id(t.submission): t.submission for t in self._tracked.values()}
        for request_id in list(self._tracked):  # best effort: the engine may be what failed
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after an engine failure failed too", request_id)
        self._tracked.clear()
        for submission in failed.values():
            self._call_soon(submission._fail, error)

    def _call_soon(self, callback, *args) -> None:
        assert self._loop is not None, "EngineDriver.start() was not called"
        self._loop.call_soon_threadsafe(callback, *args)


def _load_malloc_trim():
    libc_name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(libc_name).malloc_trim if libc_name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_malloc_trim = _load_malloc_trim()


def _trim_heap() -> None:
    """Give the C heap's free memory back to the OS. glibc keeps what a busy spell freed (a
    256-sequence step's logits and activations land in its heap once its mmap threshold has
    risen), so a server's resident memory would stay at its high-water mark (+400 MB after
    benchmarks/soak.py) instead of returning to where it stood. Called when the engine falls
    idle, where its few milliseconds delay nobody."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the waiting handler was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(deliveries: list[tuple[Submission, RequestOutput]]) -> None:
    for submission, output in deliveries:
        submission._receive(output)

