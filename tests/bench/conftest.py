"""The fake OpenAI server the bench tests measure: one process for the whole session, reconfigured per test."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


class FakeServer:
    def __init__(self, url: str) -> None:
        self.url = url

    def configure(self, **config) -> None:
        httpx.post(f"{self.url}/_config", json=config, trust_env=False).raise_for_status()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/_stats", trust_env=False).json()


@pytest.fixture(scope="session")
def fake_server(real_tokenizer_dirs):
    script = Path(__file__).with_name("fake_openai_server.py")
    tokenizer = real_tokenizer_dirs["llama3"] / "tokenizer.json"
    process = subprocess.Popen([sys.executable, str(script), "--tokenizer", str(tokenizer)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(process.stdout.readline())
        server = FakeServer(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{server.url}/v1/models", trust_env=False).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the fake OpenAI server did not start") from None
                time.sleep(0.05)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def reference_tokenizer(real_tokenizer_dirs):
    """Llama 3's tokenizer, loaded by the tokenizers library itself: the reference for counts."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(real_tokenizer_dirs["llama3"] / "tokenizer.json"))


@pytest.fixture(scope="session")
def local_tokenizer(real_tokenizer_dirs):
    """The same tokenizer as tuili bench's --tokenizer loads it (loading takes seconds: once)."""
    from tuili.bench.tokens import LocalTokenizer

    return LocalTokenizer(real_tokenizer_dirs["llama3"])


@pytest.fixture
def server(fake_server):
    """The fake server reset to its defaults for this test."""
    fake_server.configure()
    return fake_server
