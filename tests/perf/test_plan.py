"""`tuili plan`: its JSON, its tensor-parallel and capacity arithmetic, and its errors."""

from __future__ import annotations

import json

import pytest

from tuili.cli import main
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import link, preset
from tuili.perf.plan import PlanInputs, allreduce_seconds, make_plan

QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
}
REQUIRED_KEYS = [
    "params_total", "params_matmul", "weights_bytes", "weights_bytes_per_device", "kv_bytes_per_token",
    "kv_bytes_per_request", "state_bytes_per_request", "max_concurrent_requests", "reserve_fraction",
    "reserve_bytes_per_device", "prefill_flops", "prefill_seconds", "decode_step_bytes", "decode_step_seconds",
    "compute_bound_batch", "decode_tokens_per_second", "ttft_seconds", "e2e_seconds", "allreduce_bytes_per_step",
    "allreduce_seconds_per_step", "kv_transfer_seconds",
]


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_5_7B))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_plan_has_every_figure_in_si_units(capsys, config_file):
    code, out, _ = run(capsys, "--config", str(config_file), "--hardware", "h100-sxm", "--tp", "2", "--weights",
                       "fp8", "--kv", "fp8", "--context", "8192", "--prompt", "4096", "--output", "512",
                       "--batch", "16", "--json")
    assert code == 0
    plan = json.loads(out)
    for key in REQUIRED_KEYS:
        assert key in plan, key
    cost = ModelCost.from_config(QWEN2_5_7B)
    assert plan["params_total"] == cost.params_total
    assert plan["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 1  # layers x KV heads x head_dim, K and V, fp8
    assert plan["kv_bytes_per_request"] == plan["kv_bytes_per_token"] * 8192
    assert plan["state_bytes_per_request"] == 0
    assert plan["weights_bytes_per_device"] < plan["weights_bytes"] / 2 * 1.01
    assert plan["allreduce_bytes_per_step"] > 0 and plan["allreduce_seconds_per_step"] > 0
    assert plan["ttft_seconds"] == plan["prefill_seconds"] > 0
    # 511 decode steps at contexts 4097..4607, each cheaper than one at the full 8192 tokens
    assert plan["ttft_seconds"] < plan["e2e_seconds"] < plan["ttft_seconds"] + 511 * plan["decode_step_seconds"]
    assert plan["decode_tokens_per_second"] == pytest.approx(16 / plan["decode_step_seconds"])


def test_table_output_names_the_reserve_and_the_source(capsys, config_file):
    code, out, _ = run(capsys, "--config", str(config_file), "--hardware", "a100-sxm-80gb")
    assert code == 0
    assert "reserved for activations and runtime" in out and "A100 datasheet" in out


def test_capacity_follows_free_memory_and_request_size():
    cost = ModelCost.from_config(QWEN2_5_7B)
    card = preset("l40s")
    inputs = PlanInputs(weights=weight_format("bf16"), kv_dtype="bf16", context=32768, reserve_fraction=0.1)
    plan = make_plan(cost, card, inputs)
    free = card.memory_bytes * 0.9 - cost.weight_bytes("bf16")
    assert plan["max_concurrent_requests"] == int(free // (cost.kv_bytes_per_token("bf16") * 32768))
    # two replicas of TP=1 on two cards hold twice as many
    plan2 = make_plan(cost, card, PlanInputs(weights=weight_format("bf16"), gpus=2, context=32768))
    assert plan2["max_concurrent_requests"] == 2 * plan["max_concurrent_requests"]


def test_tensor_parallel_with_fewer_kv_heads_than_devices_replicates_them():
    cost = ModelCost.from_config(QWEN2_5_7B)  # 4 KV heads
    assert cost.kv_bytes_per_token("bf16", tp=8) == cost.kv_bytes_per_token("bf16") // 4  # 1 head each, not 0.5
    assert cost.kv_bytes_per_token("bf16", tp=3) == cost.kv_bytes_per_token("bf16") // 2  # ceil(4/3) = 2 heads


def test_ring_allreduce_time():
    nvlink = link("nvlink4")
    one_mb = 1e6
    # 8 devices: 14 steps, each moving 1/8 of the message one hop
    assert allreduce_seconds(one_mb, 8, nvlink) == pytest.approx(14 * (nvlink.latency + one_mb / 8 / nvlink.bandwidth))
    assert allreduce_seconds(one_mb, 1, nvlink) == 0


def test_unknown_hardware_is_a_clear_error(capsys, config_file):
    code, out, err = run(capsys, "--config", str(config_file), "--hardware", "tpu-v9")
    assert code == 2 and not out
    assert "tpu-v9" in err and "h100-sxm" in err and "Traceback" not in err


def test_config_missing_a_field_is_a_clear_error(capsys, tmp_path):
    broken = {k: v for k, v in QWEN2_5_7B.items() if k != "hidden_size"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(broken))
    code, _, err = run(capsys, "--config", str(path), "--hardware", "h100-sxm")
    assert code == 2 and "hidden_size" in err and "Traceback" not in err


def test_unknown_model_type_and_bad_values_are_clear_errors(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN2_5_7B, "model_type": "gpt_bigcode"}))
    code, _, err = run(capsys, "--config", str(path), "--hardware", "h100-sxm")
    assert code == 2 and "gpt_bigcode" in err and "qwen2" in err
    path.write_text(json.dumps({**QWEN2_5_7B, "num_key_value_heads": 5}))
    code, _, err = run(capsys, "--config", str(path), "--hardware", "h100-sxm")
    assert code == 2 and "num_key_value_heads=5" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hardware", "rtx4090", "--weights", "fp32"], "cannot fit"),  # 30 GB of weights on a 24 GB card
        (["--hardware", "t4", "--weights", "int4", "--context", "262144"], "cannot fit one request"),
        (["--hardware", "h100-sxm", "--tp", "3", "--gpus", "4"], "multiple"),
        (["--hardware", "h100-sxm", "--weights", "int3"], "int3"),
        (["--hardware", "h100-sxm", "--kv", "fp6"], "fp6"),
        (["--hardware", "h100-sxm", "--link", "carrier-pigeon"], "carrier-pigeon"),
        (["--hardware", "h100-sxm", "--batch", "0"], "--batch"),
        (["--hardware", "h100-sxm", "--dtype", "bfloat16"], "--measure"),  # sets the engine's dtype
    ],
)
def test_plans_that_cannot_be_made_say_why(capsys, config_file, argv, message):
    code, out, err = run(capsys, "--config", str(config_file), *argv)
    assert code == 2 and not out
    assert message in err and "Traceback" not in err


def test_list_hardware_shows_sources(capsys):
    code, out, _ = run(capsys, "--list-hardware")
    assert code == 0
    assert "h20" in out and "source:" in out and "ib-ndr" in out
