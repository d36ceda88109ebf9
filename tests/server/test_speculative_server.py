"""`tuili serve --speculative-config`: answers as without speculation, counters in /metrics."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ENGINE_ARGS, ServerProcess

TEXT = "red green blue yellow red green blue yellow red green blue yellow"


@pytest.fixture(scope="module")
def spec_server():
    process = ServerProcess("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_min": 1, "adaptive": false}', *ENGINE_ARGS)
    yield process
    process.stop()


def test_speculative_server_answers_as_without_and_counts_acceptance(spec_server, server, auth, scrape):
    """Greedy (float32): the same text streamed and whole as the server without speculation; the
    spec_decode counters of vLLM's names count the verifications."""
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key=auth["Authorization"].removeprefix("Bearer "))
    spec = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused")
    kwargs = dict(prompt=f"Repeat: {TEXT}. Again: {TEXT}.", max_tokens=40, temperature=0)
    want = plain.completions.create(model=plain.models.list().data[0].id, **kwargs).choices[0].text
    model = spec.models.list().data[0].id
    assert spec.completions.create(model=model, **kwargs).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in spec.completions.create(model=model, stream=True, **kwargs))
    assert streamed == want
    metrics = scrape(spec_server.url)
    assert metrics["tuili:spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["tuili:spec_decode_num_accepted_tokens_total"] <= metrics["tuili:spec_decode_num_draft_tokens_total"]
    assert metrics["tuili:spec_decode_tokens_per_step"] > 1
