"""vLLM's per-request histograms on /metrics, and their vLLM names behind --vllm-metric-names.

A server of its own (so that no other test's requests are counted) with --vllm-metric-names gets
a completion with n=2, a chat and an embedding call through the official openai client; the
scrape must count exactly those requests and tokens, under tuili's names and, with vLLM's label
names, under vLLM's, which the families of vLLM's example Grafana board need. The main server,
without the flag, exports no vllm: name.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

# Every family vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json) reads.
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_per_output_token_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds_bucket", "vllm:gpu_cache_usage_perc",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_max_num_generation_tokens_sum"]


@pytest.fixture(scope="module")
def vllm_named_server():
    process = ServerProcess("--vllm-metric-names", *ENGINE_ARGS)
    yield process
    process.stop()


def _samples(url: str) -> dict[str, float]:
    """name{labels} -> value, labels sorted, every label but model_name shown; model_name checked."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = dict(sample.labels)
            if sample.name.startswith(("tuili:", "vllm:")) and not sample.name.startswith("tuili:tensor_parallel"):
                assert labels.pop("model_name", None) is not None, sample
            shown = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "le")
            if "le" in labels:
                shown = f"{shown},le={labels['le']}" if shown else f"le={labels['le']}"
            samples[f"{sample.name}{{{shown}}}" if shown else sample.name] = sample.value
    return samples


def test_per_request_histograms_count_what_the_requests_did(vllm_named_server):
    client = openai.OpenAI(base_url=f"{vllm_named_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, n=2, seed=1,
                                           extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    embedding = client.embeddings.create(model=model, input=["a b", "c"], encoding_format="float")
    assert completion.usage.completion_tokens == 10 and chat.usage.completion_tokens == 3

    s = _samples(vllm_named_server.url)
    requests = 4  # engine requests: one per prompt, the completion's two choices being one request
    prompt = completion.usage.prompt_tokens + chat.usage.prompt_tokens + embedding.usage.prompt_tokens
    assert s["tuili:request_prompt_tokens_count"] == requests
    assert s["tuili:request_prompt_tokens_sum"] == prompt
    assert s["tuili:request_generation_tokens_count"] == requests
    assert s["tuili:request_generation_tokens_sum"] == 13
    assert s["tuili:request_max_num_generation_tokens_sum"] == 5 + 3  # the most one choice generated
    assert s["tuili:request_queue_time_seconds_count"] == requests
    assert s["tuili:time_to_first_token_seconds_count"] == 2  # the embeddings have no first token
    assert s["tuili:request_prefill_time_seconds_count"] == requests
    assert s["tuili:request_decode_time_seconds_count"] == requests
    assert s["tuili:request_prefill_time_seconds_sum"] > 0 and s["tuili:request_decode_time_seconds_sum"] > 0
    phases = s["tuili:request_prefill_time_seconds_sum"] + s["tuili:request_decode_time_seconds_sum"]
    assert phases <= s["tuili:e2e_request_latency_seconds_sum"]
    # buckets: every request under +Inf, none of the embeddings' generation above 0 tokens
    assert s["tuili:request_generation_tokens_bucket{le=+Inf}"] == requests
    assert s["tuili:request_generation_tokens_bucket{le=1.0}"] == 2
    assert s["tuili:sequences_finished_total{finish_reason=length}"] == 3
    assert s["tuili:sequences_finished_total{finish_reason=stop}"] == 2  # the embeddings

    # the same counts under vLLM's names and label names
    for name in DASHBOARD:
        assert any(key.split("{")[0] == name for key in s), name
    assert s["vllm:request_success_total{finished_reason=length}"] == 3
    assert s["vllm:request_success_total{finished_reason=stop}"] == 2
    for tuili_name, vllm_name in [("tuili:request_prompt_tokens_sum", "vllm:request_prompt_tokens_sum"),
                                  ("tuili:request_generation_tokens_sum", "vllm:request_generation_tokens_sum"),
                                  ("tuili:request_max_num_generation_tokens_sum",
                                   "vllm:request_max_num_generation_tokens_sum"),
                                  ("tuili:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_sum"),
                                  ("tuili:request_decode_time_seconds_sum", "vllm:request_decode_time_seconds_sum"),
                                  ("tuili:prompt_tokens_total", "vllm:prompt_tokens_total"),
                                  ("tuili:generation_tokens_total", "vllm:generation_tokens_total"),
                                  ("tuili:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
                                  ("tuili:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
                                  ("tuili:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                                  ("tuili:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                                  ("tuili:kv_cache_usage", "vllm:kv_cache_usage_perc"),
                                  ("tuili:num_sequences_running", "vllm:num_requests_running")]:
        assert s[vllm_name] == s[tuili_name], (vllm_name, tuili_name)
    assert s["tuili:generation_tokens_total"] == 13
    assert s["vllm:num_requests_running"] == 0 and s["vllm:num_requests_waiting"] == 0


def test_without_the_flag_no_vllm_names(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert "tuili:request_prompt_tokens_count" in text
    assert "vllm:" not in text
