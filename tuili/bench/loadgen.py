"""The load generator: when each request is sent, and when the run stops.

Two arrival models. Closed loop (`rate is None`): `concurrency` sessions are in flight at all times,
a new one starting as soon as one ends. Open loop: sessions start at the times of a Poisson
process of `rate` per second (gaps drawn from a Gamma distribution with shape `burstiness` and
mean 1/rate, so burstiness 1 is Poisson, below 1 burstier, above 1 more regular), optionally
capped at `concurrency` in flight; `rate == inf` starts them all at once. A session's turns follow
one another, each sent when the previous reply has ended.

The run stops issuing when `num_requests` requests have been sent, when `duration` seconds have
passed, when the workload has no more sessions, or when the first `abort_after` requests have all
failed (an unreachable or broken server); requests in flight are waited for and counted.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from tqdm import tqdm

from tuili.bench.metrics import RequestRecord
from tuili.bench.workloads import Session

Send = Callable[[RequestRecord, list[dict], float], Awaitable[None]]


@dataclass
class Load:
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0

    def describe(self) -> str:
        if self.rate is None:
            return f"concurrency {self.concurrency}"
        if math.isinf(self.rate):
            text = "all at once"
        else:
            text = f"{self.rate:g} req/s" + (f" (burstiness {self.burstiness:g})" if self.burstiness != 1 else "")
        return text + (f", at most {self.concurrency} in flight" if self.concurrency else "")

    def to_dict(self) -> dict:
        return {"concurrency": self.concurrency,
                "request_rate": None if self.rate is None or math.isinf(self.rate) else self.rate,
                "all_at_once": self.rate is not None and math.isinf(self.rate),
                "burstiness": self.burstiness}

    @classmethod
    def from_dict(cls, data: dict) -> Load:
        rate = math.inf if data["all_at_once"] else data["request_rate"]
        return cls(data["concurrency"], rate, data["burstiness"])


@dataclass
class LoadResult:
    records: list[RequestRecord]
    stopped_early: str | None = None


class _RunState:
    """The budget of requests and time, and the early stop; shared by all sessions of a run.

    Invariant: issued + reserved <= num_requests, where `reserved` counts the turns of started
    sessions not sent yet; a session gives back what it did not send when it ends.
    """

    def __init__(self, num_requests: int | None, deadline: float | None, abort_after: int) -> None:
        self.num_requests, self.deadline, self.abort_after = num_requests, deadline, abort_after
        self.issued = 0
        self.reserved = 0
        self.finished: list[RequestRecord] = []
        self.stopped_early: str | None = None

    def running(self) -> bool:
        return self.stopped_early is None and (self.deadline is None or time.perf_counter() < self.deadline)

    def reserve(self, turns: int) -> int:
        """Room for a new session of `turns` turns: how many of them it may send (0: start none)."""
        if not self.running():
            return 0
        room = turns if self.num_requests is None else min(turns, self.num_requests - self.issued - self.reserved)
        self.reserved += room
        return room

    def take(self) -> int | None:
        """The index of a reserved request about to be sent, or None when the run issues no more."""
        if not self.running():
            return None
        self.reserved -= 1
        self.issued += 1
        return self.issued - 1

    def exhausted(self) -> bool:
        return self.num_requests is not None and self.issued >= self.num_requests

    def give_back(self, turns: int) -> None:
        self.reserved -= turns

    def finish(self, record: RequestRecord) -> None:
        self.finished.append(record)
        first = self.finished[:self.abort_after]
        if (self.stopped_early is None and len(first) == self.abort_after
                and not any(r.ok for r in first)):
            self.stopped_early = (f"the first {self.abort_after} requests all failed; the last with "
                                  f"{record.error_kind}: {record.error}")


async def run_load(sessions: AsyncIterator[Session], send: Send, load: Load, *, num_requests: int | None,
                   duration: float | None, seed: int = 0, progress: bool = False,
                   abort_after: int = 10) -> LoadResult:
    """Drive `send` with the sessions under `load` until a bound is reached; return every record."""
    if load.rate is None and not load.concurrency:
        raise ValueError("a closed loop needs a concurrency >= 1")
    origin = time.perf_counter()
    state = _RunState(num_requests, None if duration is None else origin + duration, abort_after)
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    bar = tqdm(total=num_requests, unit="req", desc=load.describe(), disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    arrivals = random.Random(seed)

    async def run_session(number: int, session: Session, turns: int, holds_slot: bool) -> None:
        sent = 0
        try:
            if slots is not None and not holds_slot:
                await slots.acquire()
                holds_slot = True
            history = list(session.context)
            for turn_number, turn in enumerate(session.turns[:turns]):
                index = state.take()
                if index is None:
                    return
                sent += 1
                history.append({"role": "user", "content": turn.user})
                record = RequestRecord(index=index, session=number, turn=turn_number, start_s=0.0,
                                       max_tokens=turn.max_tokens, expected_prompt_tokens=turn.expected_tokens)
                await send(record, history, origin)
                state.finish(record)
                bar.update(1)
                if not record.ok:
                    return  # the conversation cannot go on without this reply
                history.append({"role": "assistant", "content": record.text})
        finally:
            state.give_back(turns - sent)
            if holds_slot:
                slots.release()

    tasks: set[asyncio.Task] = set()

    async def start(number: int, session: Session) -> bool:
        """Start `session` once the run has room for it; False when it never will."""
        while True:
            if load.rate is None:
                await slots.acquire()  # closed loop: a slot frees when a session ends
            turns = state.reserve(len(session.turns))
            if turns:
                task = asyncio.create_task(run_session(number, session, turns, holds_slot=load.rate is None))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                return True
            if load.rate is None:
                slots.release()
            running = {task for task in tasks if not task.done()}
            if not state.running() or state.exhausted() or not running:
                return False
            # Every request left is reserved by a running conversation; one cut short gives some back.
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)

    next_arrival = origin
    try:
        number = 0
        async for session in sessions:
            if load.rate is not None and not math.isinf(load.rate):
                next_arrival += arrivals.gammavariate(load.burstiness, 1.0 / (load.rate * load.burstiness))
                if state.deadline is not None and next_arrival >= state.deadline:
                    break
                await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            if not await start(number, session):
                break
            number += 1
            await asyncio.sleep(0)  # let started sessions run even when arrivals are immediate
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
        aclose = getattr(sessions, "aclose", None)
        if aclose is not None:
            await aclose()
    return LoadResult(sorted(state.finished, key=lambda r: r.index), state.stopped_early)

