"""The chat and dashboard pages of `tuili serve`, in a real headless browser (Debian's chromium,
driven by Playwright) against a real server that needs an API key and is served under a path
prefix. Every request the browser makes to another host is blocked and fails the test, so the
pages provably work offline. The test run takes screenshots of both pages; with
TUILI_UPDATE_SCREENSHOTS=1 it writes them over docs/images/*.png (a plain run leaves the
checkout unchanged).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tuili.server.web import LATENCY_WINDOW

API_KEY = "test-key"  # tests/server/conftest.py's
ROOT_PATH = "/tuili"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Where the screenshots go: docs/images when asked to update them, else a temporary folder."""
    import os

    if os.environ.get("TUILI_UPDATE_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        return DOCS_IMAGES
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def base(web_server) -> str:
    """The server's URL with its path prefix."""
    return web_server.url + ROOT_PATH


@pytest.fixture(scope="module")
def browser_page(base):
    """One tab of a headless chromium whose every request is recorded; requests to any host but
    the server's are aborted. Yields (page, requests made, foreign requests attempted)."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, "no chromium on PATH: install Debian's chromium (bash scripts/setup.sh test)"
    local = urlsplit(base).netloc
    seen, foreign, errors = [], [], []

    def route(route):
        url = route.request.url
        if urlsplit(url).netloc == local:
            seen.append(url)
            route.continue_()
        else:
            foreign.append(url)
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.route("**/*", route)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        yield page, seen, foreign
        browser.close()
    assert not foreign, f"the pages tried to reach other hosts: {foreign}"
    assert not errors, f"the pages raised: {errors}"
    outside = [url for url in seen if not urlsplit(url).path.startswith(ROOT_PATH + "/")]
    assert not outside, f"requests outside the path prefix {ROOT_PATH}: {outside}"


def _give_key(page, expect_message: str = "no API key") -> None:
    page.wait_for_selector("#key-form:not([hidden])")
    assert expect_message in page.inner_text("#key-form .key-message")
    page.fill("#key-input", API_KEY)
    page.press("#key-input", "Enter")


def _ask(page, question: str, max_tokens: int, temperature: float = 0.0) -> None:
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def test_pages_load_without_the_key_but_their_data_needs_it(base, web_server):
    for path in ("/", "/dashboard", "/static/chat.js", "/static/vendor/uPlot.LICENSE"):
        assert httpx.get(base + path).status_code == 200, path
        # behind a proxy that strips the prefix the same paths arrive without it
        assert httpx.get(web_server.url + path).status_code == 200, path
    assert httpx.get(web_server.url + "/health").status_code == httpx.get(base + "/health").status_code == 200
    assert "default-src 'self'" in httpx.get(base + "/").headers["content-security-policy"]
    assert httpx.get(base + "/stats").status_code == 401
    assert httpx.get(base + "/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/stats", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(base + "/static/../app.py").status_code in (401, 404)
    assert httpx.get(base + "/static/nothing.js").status_code == 404


def test_chat_streams_the_answer_the_api_gives(base, browser_page, images):
    page, _, _ = browser_page
    page.goto(base + "/")
    _give_key(page)
    model = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
    page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
    # Count the distinct texts the answer shows while it streams.
    page.evaluate("""() => {
        window.answerTexts = new Set();
        new MutationObserver(() => {
            const body = document.querySelector('.message.assistant .body');
            if (body) window.answerTexts.add(body.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    _ask(page, QUESTION, max_tokens=32)
    page.wait_for_selector(".message.assistant .numbers")
    shown = page.get_attribute(".message.assistant", "data-raw")
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)
    expected = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32
    ).choices[0].message.content
    assert shown == expected
    assert page.evaluate("window.answerTexts.size") > 2, "the answer appeared at once, not streamed"
    numbers = page.locator(".message.assistant .numbers")
    assert float(numbers.get_attribute("data-ttft")) > 0
    assert float(numbers.get_attribute("data-tokens-per-second")) > 0
    assert int(numbers.get_attribute("data-completion-tokens")) > 1

    # The same question in a new chat: its prompt is served from the prefix cache, and says so.
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    _ask(page, QUESTION, max_tokens=4)
    page.wait_for_selector(".message.assistant .numbers")
    assert int(page.get_attribute(".message.assistant .numbers", "data-cached-tokens")) > 0
    page.click("#new-chat")
    page.fill("#system-prompt", "You are a helpful assistant. Format code as Markdown.")
    _ask(page, "Write a Python function that adds two numbers.", max_tokens=80)
    page.wait_for_selector(".message.assistant .numbers")
    page.screenshot(path=str(images / "chat.png"))


def test_markdown_is_rendered_and_sanitized(browser_page):
    page, _, foreign = browser_page
    html = page.evaluate("""() => renderMarkdown(
        "# Title\\n\\n```python\\nprint(1)\\n```\\n\\n<img src=x onerror=alert(1)><script>alert(2)</script>"
        + "[link](javascript:alert(3)) <a href='http://example.com' onclick='alert(4)'>x</a>")""")
    assert "<h1>Title</h1>" in html and "<pre><code" in html and "print(1)" in html
    for dangerous in ("onerror", "<script", "javascript:", "onclick"):
        assert dangerous not in html, html
    assert 'target="_blank"' in html and "noopener" in html
    # An answer's image from another site is refused by the page's Content-Security-Policy
    # before any request is made.
    page.evaluate("""() => { const box = document.createElement('div');
        box.innerHTML = renderMarkdown('![t](http://example.com/t.png)');
        document.getElementById('messages').appendChild(box); }""")
    page.wait_for_timeout(300)
    assert not foreign


def test_latency_percentiles_interpolate_within_buckets_as_prometheus_does():
    from tuili.server.web import _quantile

    # 10 observations in (0.1, 0.2], 10 more in (0.2, 0.4]: histogram_quantile gives these
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert _quantile(0.5, buckets) == pytest.approx(0.2)
    assert _quantile(0.25, buckets) == pytest.approx(0.15)
    assert _quantile(0.9, buckets) == pytest.approx(0.36)
    assert _quantile(0.99, [(0.1, 0.0), (float("inf"), 5.0)]) == 0.1  # in +Inf: the highest finite bound
    assert _quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


@pytest.mark.parametrize("root_path", ["tuili", "/tuili/"])
def test_a_bad_root_path_is_refused_at_start(root_path):
    import argparse

    from tuili.errors import TuiliError
    from tuili.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    with pytest.raises(TuiliError, match=f"--root-path '{root_path}' is invalid: expected a path like /tuili"):
        cli._check_args(parser.parse_args(["serve", "--root-path", root_path]))


def test_package_data_ships_every_page_file():
    """The wheel must carry the pages and their libraries: every file under static/ matches a
    package-data pattern in pyproject.toml."""
    import ast
    import fnmatch
    import re

    root = Path(__file__).resolve().parents[2]  # tomllib is not in Python 3.10
    line = re.search(r'^"tuili.server" = (\[.*\])$', (root / "pyproject.toml").read_text(), re.MULTILINE)
    assert line, "pyproject.toml has no package-data for tuili.server"
    patterns = ast.literal_eval(line.group(1))
    static = root / "tuili" / "server"
    for path in (static / "static").rglob("*"):
        if path.is_file():
            name = path.relative_to(static).as_posix()
            assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


def test_stop_aborts_the_request_on_the_server(base, browser_page, scrape, wait_until):
    page, _, _ = browser_page
    aborted = "tuili:sequences_finished_total{finish_reason=abort}"
    before = scrape(base).get(aborted, 0.0)
    page.click("#new-chat")
    _ask(page, "Count from 1 to 500, one number per line.", max_tokens=400)
    page.wait_for_function("() => (document.querySelector('.message.assistant')?.dataset.raw || '').length > 20")
    assert scrape(base)["tuili:num_sequences_running"] == 1
    page.click("#stop")
    wait_until(lambda: scrape(base), lambda m: m["tuili:num_sequences_running"] == 0, timeout=10)
    assert scrape(base)[aborted] == before + 1
    assert page.get_attribute(".message.assistant", "data-finish") == "stopped"


def _figure(page, element: str) -> float | None:
    value = page.get_attribute(f"#{element}", "data-value")
    return float(value) if value else None


def test_dashboard_moves_under_load_and_agrees_with_metrics(base, browser_page, scrape, wait_until, images):
    page, _, _ = browser_page
    page.goto(base + "/dashboard")  # the key typed on the chat page is kept for the tab
    page.wait_for_selector("body[data-updates]")
    assert page.is_hidden("#key-form")
    # the counter itself, not the page's last figure of it (which may be an update old)
    total_before = scrape(base)["tuili:generation_tokens_total"]
    # A load of several seconds, so that the page's updates (one a second) see it running: 6
    # requests of 24 tokens took under a second on a Zen 4 and were missed. 6 of 96 at concurrency
    # 3: two rounds of 96 decode steps (the whole test 23 s alone on an AVX2 Zen 3, 2026-12-07).
    requests, output_len = 6, 96
    load_started = time.monotonic()
    bench = subprocess.Popen(
        [sys.executable, "-m", "tuili.cli", "bench", "--base-url", base, "--api-key", API_KEY,
         "--num-requests", str(requests), "--concurrency", "3", "--input-len", "48", "--output-len", str(output_len),
         "--ignore-eos", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        seen_running = seen_rate = 0.0
        shot = False
        while bench.poll() is None:
            running = _figure(page, "running") or 0
            seen_running = max(seen_running, running)
            seen_rate = max(seen_rate, _figure(page, "generation-rate") or 0)
            halfway = (_figure(page, "generation-total") or 0) >= total_before + requests * output_len / 2
            if running and seen_rate and halfway and not shot:  # the docs show the dashboard under load
                page.screenshot(path=str(images / "dashboard.png"), full_page=True)
                shot = True
            time.sleep(0.2)
        output = bench.stdout.read()
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 0, output
    assert seen_running > 0 and seen_rate > 0, "the dashboard did not move while the load ran"
    wait_until(lambda: _figure(page, "generation-total"), lambda total: total >= total_before + requests * output_len)

    # Idle now: the next update's figures equal a scrape of /metrics.
    wait_until(lambda: _figure(page, "running"), lambda running: running == 0)
    updates = int(page.get_attribute("body", "data-updates"))
    metrics = scrape(base)
    page.wait_for_function("n => Number(document.body.dataset.updates) > n + 1", arg=updates)
    assert _figure(page, "generation-total") == metrics["tuili:generation_tokens_total"]
    assert _figure(page, "prompt-total") == metrics["tuili:prompt_tokens_total"]
    assert _figure(page, "kv-usage") == metrics["tuili:kv_cache_usage"]
    hits, queries = metrics["tuili:prefix_cache_hits_total"], metrics["tuili:prefix_cache_queries_total"]
    assert _figure(page, "hit-rate") == pytest.approx(hits / queries)
    if "tuili:decode_mbu" in metrics:  # absent while the peak it divides by is exceeded
        assert _figure(page, "mbu") == pytest.approx(metrics["tuili:decode_mbu"])
    if "tuili:prefill_mfu" in metrics:
        assert _figure(page, "mfu") == pytest.approx(metrics["tuili:prefill_mfu"])
    ttft_count = metrics["tuili:time_to_first_token_seconds_count"]
    # The page counts the first tokens of the last minute (at least LATENCY_WINDOW seconds back):
    # all of the load's when it began within that; on a slow machine its first ones may have left.
    within_window = time.monotonic() - load_started < LATENCY_WINDOW
    assert (requests if within_window else 1) <= _figure(page, "ttft-count") <= ttft_count
    for name in ("ttft-p50", "ttft-p99", "itl-p50", "itl-p99"):
        assert _figure(page, name) > 0, name
    steps = page.evaluate("() => fetch('stats', {headers: {Authorization: 'Bearer " + API_KEY + "'}})"
                          ".then(r => r.json()).then(s => s.roofline.steps)")
    assert {step["kind"] for step in steps} == {"prefill", "decode"}
