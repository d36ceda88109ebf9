"""What the multi-process tests share: a `tuili serve` process with worker ranks, its children
read from /proc, and the check that a killed worker fails the request in flight cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

_READY = re.compile(r"at (http://\S+)/v1")


class ServedRanks:
    """Start `tuili serve` (float32, port 0, 2 s shutdown grace) and watch its processes."""

    @staticmethod
    def serve(path: Path, log: Path, *extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "tuili.cli", "serve", "--model", str(path), "--served-model-name", "m",
                   "--dtype", "float32", "--kv-cache-memory", "16MiB", "--port", "0", "--shutdown-grace", "2", *extra]
        return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

    @staticmethod
    def wait_for_url(logs: list[Path], processes: list[subprocess.Popen], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for log in logs:
                match = _READY.search(log.read_text())
                if match:
                    return match.group(1)
            if any(p.poll() is not None for p in processes):
                break
            time.sleep(0.2)
        pytest.fail("no rank started serving:\n" + "\n".join(log.read_text() for log in logs), pytrace=False)

    @staticmethod
    def complete(url: str, max_tokens: int = 8) -> httpx.Response:
        body = {"model": "m", "prompt": [5, 17, 250], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    @classmethod
    def children(cls, pid: int) -> list[int]:
        """Every descendant of `pid`, read from /proc."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                found += [child, *cls.children(child)]
        return found

    @staticmethod
    def alive(pids: list[int]) -> list[int]:
        """Those of `pids` still running (not gone, not zombies)."""
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        return alive

    @classmethod
    def kill_a_worker_mid_request(cls, server: subprocess.Popen, url: str, log: Path, named: str) -> None:
        """SIGKILL the server's one worker while a long request runs: the request fails (an
        error or a 500), the server exits 1 within 15 s, its log names the lost rank (`named`)
        and no process is left."""
        ranks = cls.children(server.pid)
        assert len(cls.alive(ranks)) == 1, "one worker rank"
        answers: list[httpx.Response | Exception] = []

        def long_request() -> None:
            try:
                answers.append(cls.complete(url, max_tokens=3000))
            except httpx.HTTPError as e:  # the server went away before answering
                answers.append(e)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.0)
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        assert server.wait(30) == 1
        assert time.monotonic() - killed < 15
        thread.join(30)
        answer = answers[0]
        assert isinstance(answer, httpx.HTTPError) or answer.status_code == 500, answer
        assert named in log.read_text()
        assert cls.alive(ranks) == []


@pytest.fixture(scope="session")
def served_ranks() -> type[ServedRanks]:
    return ServedRanks
