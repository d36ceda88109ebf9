"""UtilizationMeter: MFU and MBU of recorded steps, and how a mixed step's time is split."""

from __future__ import annotations

import pytest

from tuili.errors import TuiliError
from tuili.perf.cost import ModelCost
from tuili.perf.hardware import HardwareSpec
from tuili.perf.meter import UtilizationMeter

TIED = {
    "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 5000, "tie_word_embeddings": True,
}
UNTIED = {**TIED, "tie_word_embeddings": False}
MOE = {**UNTIED, "model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
CARD = HardwareSpec(name="test card", peak_flops={"fp32": 1e12, "bf16": 4e12}, memory_bandwidth=1e10,
                    memory_bytes=2**34, origin="file")
FP32 = 4


def params(config: dict) -> int:
    return ModelCost.from_config(config).params_total


def kv_per_token(config: dict) -> int:
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * FP32


def meter_for(config: dict) -> UtilizationMeter:
    cost = ModelCost.from_config(config)
    return UtilizationMeter(cost, CARD, params(config) * FP32, kv_per_token(config), compute_dtype="fp32")


def test_decode_mbu_counts_all_weights_and_each_sequence_kv():
    meter = meter_for(TIED)
    meter.record_step([], [10, 20], seconds=0.5)
    expected = params(TIED) * FP32 + kv_per_token(TIED) * (10 + 20)
    assert meter.decode_bytes == expected
    assert meter.decode_mbu == pytest.approx(expected / 0.5 / 1e10)
    assert meter.prefill_mfu is None and meter.decode_tokens == 2


def test_untied_embedding_is_read_only_for_the_looked_up_rows():
    meter = meter_for(UNTIED)
    meter.record_step([], [7, 7, 7], seconds=1.0)
    table = 5000 * 256 * FP32
    assert meter.decode_bytes == params(UNTIED) * FP32 - table + 3 * 256 * FP32 + 3 * 7 * kv_per_token(UNTIED)


def test_moe_decode_reads_the_experts_its_tokens_chose():
    meter = meter_for(MOE)
    meter.record_step([], [5], seconds=1.0)
    kinds = ModelCost.from_config(MOE).params_by_kind()
    expected_params = params(MOE) - kinds["embedding"] + 1 * 256 - kinds["experts"] + kinds["experts"] * 2 / 16
    assert meter.decode_bytes == pytest.approx(expected_params * FP32 + 5 * kv_per_token(MOE), abs=4)


def test_prefill_mfu_uses_the_compute_dtype_peak():
    meter = meter_for(TIED)
    meter.record_step([(0, 300)], [], seconds=2.0)
    flops = ModelCost.from_config(TIED).prefill_flops(0, 300)
    assert meter.prefill_flops == flops
    assert meter.prefill_mfu == pytest.approx(flops / 2.0 / 1e12)


def test_a_mixed_step_is_split_by_roofline_time():
    meter = meter_for(TIED)
    meter.record_step([(0, 200)], [40], seconds=1.0)
    t_prefill = ModelCost.from_config(TIED).prefill_flops(0, 200) / 1e12
    t_decode = (params(TIED) * FP32 + 40 * kv_per_token(TIED)) / 1e10
    assert meter.prefill_seconds == pytest.approx(t_prefill / (t_prefill + t_decode))
    assert meter.prefill_seconds + meter.decode_seconds == pytest.approx(1.0)
    assert meter.prefill_tokens == 200 and meter.decode_tokens == 1


def test_summary_and_prometheus_samples():
    meter = meter_for(TIED)
    meter.record_step([(0, 64)], [], 0.1)
    meter.record_step([], [65], 0.05)
    summary = meter.summary()
    samples = summary.prometheus()
    assert samples["tuili:prefill_mfu"] == pytest.approx(summary.prefill_mfu)
    assert samples["tuili:decode_mbu"] == pytest.approx(summary.decode_mbu)
    assert samples["tuili:prefill_flops_total"] == meter.prefill_flops
    assert samples["tuili:decode_bytes_total"] == meter.decode_bytes
    text = summary.format()
    assert "MFU" in text and "MBU" in text and "test card" in text


def test_devices_scale_the_peaks_and_bad_sizes_are_refused():
    cost = ModelCost.from_config(TIED)
    two = UtilizationMeter(cost, CARD, 10**6, 100, devices=2)
    assert two.memory_bandwidth == 2e10 and two.peak_flops == 8e12
    with pytest.raises(TuiliError, match="weight_bytes"):
        UtilizationMeter(cost, CARD, 0, 100)


def test_a_utilization_above_100_percent_is_unknown_not_printed():
    """Issue 20.9: a quick peak estimate made on a busy machine gave /metrics an MFU of 855%.
    Work done faster than the peak allows means the peak is wrong: the figure is unknown."""
    meter = meter_for(TIED)
    flops = ModelCost.from_config(TIED).prefill_flops(0, 300)
    meter.record_step([(0, 300)], [], seconds=flops / 1e12 / 8.55)  # 855% of the card's fp32 peak
    meter.record_step([], [301], seconds=1.0)  # a plausible decode
    assert meter.prefill_mfu is None and 0 < meter.decode_mbu <= 1
    summary = meter.summary()
    samples = summary.prometheus()
    assert "tuili:prefill_mfu" not in samples and samples["tuili:decode_mbu"] == pytest.approx(meter.decode_mbu)
    assert samples["tuili:prefill_flops_total"] == flops  # the totals stay, for a better peak
    text = summary.format()
    assert "MFU unknown" in text and "855" not in text and "%" in text.splitlines()[1]


def test_a_verification_chunk_is_decode_work_with_every_position_computed():
    """Speculative decoding: a chunk verifying 3 proposals after 40 cached tokens reads the weights
    once (with the step's decode), its 44 tokens of KV once, and computes 4 positions with their
    logits; it yields its 2 kept proposals plus the target's token. A draft forward adds the
    draft's weights."""
    meter = meter_for(TIED)
    cost = ModelCost.from_config(TIED)
    meter.draft_weight_bytes = 1000
    meter.record_step([], [10], seconds=0.5, verify_chunks=[(40, 4)], num_accepted=2, draft_forwards=3)
    assert meter.decode_bytes == params(TIED) * FP32 + kv_per_token(TIED) * (10 + 44) + 3 * 1000
    assert meter.decode_flops == cost.decode_flops([10]) + cost.decode_flops([41, 42, 43, 44])
    assert meter.decode_tokens == 1 + 1 + 2
    assert meter.prefill_tokens == 0 and meter.prefill_seconds == 0
