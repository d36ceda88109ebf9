"""`tuili serve --speculative-config`: answers as without speculation, counters in /metrics, and
`tuili bench` reports the acceptance over its run from them."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import ENGINE_ARGS, ServerProcess
from tuili.cli import main

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


def test_bench_reports_the_servers_acceptance_over_its_run(spec_server, tmp_path, capsys):
    """`tuili bench` against the speculating server (copy-heavy prompts from a file): its result's
    server_speculation is the spec_decode counters' increases over the run, as rates, and its
    report prints them."""
    dataset = tmp_path / "copy.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"Repeat: {TEXT}. Again: {TEXT}.", "max_tokens": 24}) + "\n"
                               for _ in range(3)))
    output = tmp_path / "results.json"
    assert main(["bench", "--base-url", spec_server.url, "--workload", "file", "--dataset", str(dataset),
                 "--no-progress", "--output", str(output)]) == 0
    run = json.loads(output.read_text())["runs"][0]

    def delta(name: str) -> float:
        return sum(e["run"] for key, e in run["server_metrics"].items() if key.split("{")[0] == f"tuili:{name}")

    spec = run["server_speculation"]
    assert spec["verifications"] == delta("spec_decode_num_drafts_total") > 0
    assert spec["proposed_tokens"] == delta("spec_decode_num_draft_tokens_total")
    assert spec["acceptance_rate"] == delta("spec_decode_num_accepted_tokens_total") / spec["proposed_tokens"] > 0
    assert spec["tokens_per_verification"] == delta("spec_decode_num_emitted_tokens_total") / spec["verifications"] > 1
    report = capsys.readouterr().out
    assert f"{spec['acceptance_rate']:.1%} of {spec['proposed_tokens']:.0f} proposed tokens accepted" in report
