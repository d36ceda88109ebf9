"""Real `tuili serve` processes on loopback ephemeral ports, shared by the server tests.

Loading the default model takes seconds, so each server starts once per session and the
offline `LLM` the tests compare against loads in this process while the servers load.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from tuili.models.default_model import DEFAULT_MODEL_FILE

API_KEY = "test-key"
# Small enough that "ten times the context" is a cheap prompt and two engines fit in RAM;
# the outputs the tests compare do not depend on either. float32 by name (the GGUF dequantized
# at load): the tests compare greedy texts of the same prompts run in different batches, and
# the packed bf16 kernels (and bf16 in general) round differently for different batch sizes,
# so near-ties flip; float32 keeps batch composition out of the results.
MAX_MODEL_LEN = 512
DTYPE = "float32"
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB", "--dtype", DTYPE]
# The main server answers to the name it would take by default (the model file's stem) and to an
# alias with a slash in it, as Hugging Face names have (GET /v1/models/{id} must take it).
MODEL_ALIAS = "tuili-test/alias"
SERVED_NAMES = [Path(DEFAULT_MODEL_FILE).stem, MODEL_ALIAS]
_READY = re.compile(r"at (http://\S+)/v1")
_LOAD_TIMEOUT = 600.0


class ServerProcess:
    """One `tuili serve` subprocess; `url` waits until it listens."""

    def __init__(self, *args: str) -> None:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="tuili-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "tuili.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._url: str | None = None

    @property
    def log(self) -> str:
        return Path(self._log.name).read_text()

    @property
    def url(self) -> str:
        """The server's root URL (no /v1), once it accepts connections."""
        deadline = time.monotonic() + _LOAD_TIMEOUT
        while self._url is None:
            match = _READY.search(self.log)
            if match:
                self._url = match.group(1)
            elif self.process.poll() is not None:
                pytest.fail(f"tuili serve exited with {self.process.returncode}:\n{self.log}", pytrace=False)
            elif time.monotonic() > deadline:
                pytest.fail(f"tuili serve did not start within {_LOAD_TIMEOUT}s:\n{self.log}", pytrace=False)
            else:
                time.sleep(0.2)
        return self._url

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            os.unlink(self._log.name)


@pytest.fixture(scope="session")
def server():
    """The main server: default model, API key required."""
    process = ServerProcess("--api-key", API_KEY, "--served-model-name", *SERVED_NAMES, *ENGINE_ARGS)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def tight_server():
    """A server that runs one sequence at a time and queues at most one more."""
    process = ServerProcess("--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-grace", "60", *ENGINE_ARGS)
    yield process
    process.stop()


ROOT_PATH = "/tuili"


@pytest.fixture(scope="session")
def web_server():
    """The browser tests' server: API key required, served under a path prefix (as behind a
    reverse proxy that passes the prefix on)."""
    process = ServerProcess("--api-key", API_KEY, "--root-path", ROOT_PATH, *ENGINE_ARGS)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def offline_llm(server):
    """The offline API on the same model, loaded here while the server loads."""
    from tuili import LLM

    return LLM(dtype=DTYPE, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)


@pytest.fixture(scope="session")
def model_name(server) -> str:
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    return response.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def max_model_len(server, auth) -> int:
    """The context length the server reports (tests/server starts it with MAX_MODEL_LEN)."""
    return httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"][0]["max_model_len"]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    # One per test: a test drives it in its own asyncio.run(), and a client's pooled connections
    # belong to the loop that opened them (a shared one failed with "Event loop is closed").
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _scrape(url: str) -> dict[str, float]:
    """The server's `tuili:` samples, as `name` or `name{label=value}` (model label left out) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("tuili:") and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.fixture(scope="session")
def scrape():
    """scrape(url) -> the server's metrics (see _scrape)."""
    return _scrape


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _wait_until(read, done, timeout: float = 60.0):
    """Call read() until done(value) holds; return that value (fail after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"still not done after {timeout}s: {value}", pytrace=False)
        time.sleep(0.1)


@pytest.fixture(scope="session")
def wait_until():
    """wait_until(read, done, timeout=60) -> the first read() value that is done()."""
    return _wait_until
