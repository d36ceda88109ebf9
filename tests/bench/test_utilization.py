"""Client-side MFU and MBU: the aggregation over requests, checked on hand-made timings, and the
plumbing from --hardware / --model-config to the report against the fake server."""

import json

import pytest

from tuili.bench.metrics import RequestRecord
from tuili.bench.runner import BenchConfig, run_benchmark
from tuili.bench.utilization import estimate, load_cost_model, union_length
from tuili.cli import main

# A tiny Llama: 2 layers, 2 KV heads of 16 dims -> K and V of one token = 2 * 2 * 2 * 16 values.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 1000, "tie_word_embeddings": True, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 2  # bf16
PEAK, BANDWIDTH = 2e12, 1e11
SPEC = {"name": "test-card", "peak_flops": {"bf16": PEAK}, "memory_bandwidth": BANDWIDTH, "memory_bytes": 2**34}


@pytest.fixture
def model_files(tmp_path):
    config, spec = tmp_path / "config.json", tmp_path / "card.json"
    config.write_text(json.dumps(CONFIG))
    spec.write_text(json.dumps(SPEC))
    return str(config), str(spec)


def record(start, ttft, e2el, prompt, out, cached=None):
    return RequestRecord(index=0, session=0, turn=0, start_s=start, max_tokens=out, ok=True, ttft_s=ttft,
                         e2el_s=e2el, chunk_times_s=[ttft], prompt_tokens=prompt, output_tokens=out,
                         cached_tokens=cached, token_source="usage")


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 1), (2, 3)]) == 2
    assert union_length([(0, 1), (0.5, 1.5), (1.2, 1.3)]) == pytest.approx(1.5)
    assert union_length([(1, 4), (0, 2), (2.5, 3)]) == 4


def test_sequential_requests_give_the_exact_mfu_and_mbu(model_files):
    setup = load_cost_model(*model_files)
    assert setup.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert setup.peak_flops == PEAK and setup.memory_bandwidth == BANDWIDTH
    cost, weights = setup.cost, setup.weight_bytes
    records = [record(0.0, 0.1, 0.5, prompt=100, out=5), record(1.0, 0.2, 0.6, prompt=50, out=3, cached=20)]
    u = estimate(records, setup)
    flops = cost.prefill_flops(0, 100) + cost.prefill_flops(20, 30)  # cached tokens are not recomputed
    assert u["prefill_seconds"] == pytest.approx(0.3)
    assert u["prefill_mfu"] == pytest.approx(flops / 0.3 / PEAK)
    # Decode: 4 + 2 steps, each reading the weights and the sequence's KV at its context length.
    kv = KV_BYTES_PER_TOKEN * (101 + 102 + 103 + 104 + 51 + 52)
    assert u["mean_decode_batch"] == pytest.approx(1.0) and u["decode_steps"] == pytest.approx(6)
    assert u["decode_bytes"] == pytest.approx(6 * weights + kv)
    assert u["decode_mbu"] == pytest.approx((6 * weights + kv) / 0.8 / BANDWIDTH)


def test_overlapping_requests_share_decode_steps(model_files):
    setup = load_cost_model(*model_files)
    records = [record(0.0, 0.1, 1.1, prompt=10, out=11), record(0.05, 0.1, 1.1, prompt=10, out=11)]
    u = estimate(records, setup)
    assert u["prefill_seconds"] == pytest.approx(0.15)
    decode_seconds = 1.15 - 0.1
    batch = 2 * 1.0 / decode_seconds  # 2 request-seconds of decoding over 1.05 s
    steps = 20 / batch
    kv = 2 * KV_BYTES_PER_TOKEN * sum(range(11, 21))
    assert u["decode_seconds"] == pytest.approx(decode_seconds)
    assert u["mean_decode_batch"] == pytest.approx(batch) and u["decode_steps"] == pytest.approx(steps)
    assert u["decode_mbu"] == pytest.approx((steps * setup.weight_bytes + kv) / decode_seconds / BANDWIDTH)


def test_weights_option_overrides_storage_and_devices_scale_peaks(model_files):
    bf16, int4 = load_cost_model(*model_files), load_cost_model(*model_files, weights="int4", devices=2)
    assert bf16.weight_bytes == 2 * bf16.cost.params_total  # a bare config.json: bf16 by default
    assert int4.weights == "int4" and int4.weight_bytes == int4.cost.weight_bytes("int4") < bf16.weight_bytes
    assert (int4.peak_flops, int4.memory_bandwidth) == (2 * PEAK, 2 * BANDWIDTH)


def test_the_report_shows_utilization_against_a_fake_server(server, model_files, capsys, tmp_path):
    server.configure(ttft_s=0.05, itl_s=0.005)
    out_file = tmp_path / "r.json"
    config, spec = model_files
    assert main(["bench", "--base-url", server.url, "--num-requests", "3", "--input-len", "30", "--output-len",
                 "4", "--hardware", spec, "--model-config", config, "--output", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "Prefill MFU" in text and "Decode MBU" in text and "test-card" in text
    run = json.loads(out_file.read_text())["runs"][0]
    u, records = run["utilization"], run["requests"]
    cost = load_cost_model(config, spec).cost
    assert u["prefill_flops"] == sum(cost.prefill_flops(0, r["prompt_tokens"]) for r in records)
    assert u["prefill_seconds"] == pytest.approx(sum(r["ttft_s"] for r in records))  # one at a time
    assert u["decode_steps"] == pytest.approx(3 * 3)


def test_without_model_config_the_servers_model_path_is_used(server, model_files, capsys):
    config, spec = model_files
    server.configure(ttft_s=0.01, itl_s=0.002, root=config)
    result = run_benchmark(BenchConfig(server.url, num_requests=2, output_len=3, hardware=spec))
    assert result["runs"][0]["utilization"]["prefill_flops"] > 0
    server.configure(ttft_s=0.01, itl_s=0.002)  # no path given
    assert main(["bench", "--base-url", server.url, "--num-requests", "1", "--hardware", spec]) == 2
    assert "pass --model-config" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--hardware", "no-such-card"], "unknown hardware 'no-such-card'"),
    (["--model-config", "/nonexistent/config.json"], "cannot read config"),
    (["--devices", "0"], "--devices 0 is invalid"),
])
def test_bad_utilization_input(server, model_files, capsys, args, message):
    config, spec = model_files
    base = {"--hardware": spec, "--model-config": config}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert main(["bench", "--base-url", server.url, *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err
