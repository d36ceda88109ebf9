"""Many clients at once: continuous batching must not lose, duplicate or cross-wire tokens."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

CLIENTS = 100
MAX_TOKENS = 6


async def _stream(async_client, model: str, prompt: str) -> tuple[str, str | None, object]:
    stream = await async_client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish_reason, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert finish_reason is None, "text after the finish reason"
            text += choice.text
            finish_reason = choice.finish_reason
    return text, finish_reason, usage


def test_100_concurrent_streams_match_their_whole_results_and_the_metrics(
    server, async_client, model_name, scrape, wait_until
):
    prompts = [f"Fact number {i}: the number {i * 7} is" for i in range(CLIENTS)]
    before = scrape(server.url)

    async def run():
        streams = asyncio.gather(*(_stream(async_client, model_name, p) for p in prompts))
        # The same prompts in one non-streamed call, running alongside the streams.
        whole = async_client.completions.create(model=model_name, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
        return await asyncio.gather(streams, whole)

    streamed, whole = asyncio.run(run())
    after = scrape(server.url)

    assert [c.index for c in whole.choices] == list(range(CLIENTS))
    for (text, finish_reason, usage), choice in zip(streamed, whole.choices, strict=True):
        assert (text, finish_reason) == (choice.text, choice.finish_reason)
        assert usage is not None and usage.completion_tokens <= MAX_TOKENS

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_tokens = sum(u.prompt_tokens for _, _, u in streamed) + whole.usage.prompt_tokens
    completion_tokens = sum(u.completion_tokens for _, _, u in streamed) + whole.usage.completion_tokens
    reasons = [f for _, f, _ in streamed] + [c.finish_reason for c in whole.choices]
    assert grew("tuili:prompt_tokens_total") == prompt_tokens
    assert grew("tuili:generation_tokens_total") == completion_tokens
    for reason in ("stop", "length"):
        assert grew(f"tuili:sequences_finished_total{{finish_reason={reason}}}") == reasons.count(reason)
    assert grew("tuili:sequences_finished_total{finish_reason=abort}") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"tuili:{histogram}_count") == 2 * CLIENTS
    idle = wait_until(lambda: scrape(server.url), lambda m: m["tuili:num_sequences_running"] == 0)
    assert idle["tuili:num_sequences_waiting"] == 0
    assert idle["tuili:kv_cache_usage"] == 0
    # The engine's utilization meter is exported, and it saw this work.
    assert grew("tuili:decode_tokens_total") > 0 and grew("tuili:prefill_tokens_total") > 0
    # A gauge is absent while unknown: its peak was exceeded, which a quick estimate on a busy
    # machine allows (issue 20.9); a figure shown is a real fraction.
    for gauge in ("tuili:prefill_mfu", "tuili:decode_mbu"):
        assert gauge not in after or 0 < after[gauge] <= 1, after.get(gauge)
