"""The worked figures of the seed articles (shared/seeds 000, 002, 004), recomputed by the ruler.

Each figure comes out of the cost model, the hardware presets or the planning functions; the
seeds' printed numbers appear only as the expected values, with the rounding the seeds used.
"""

from __future__ import annotations

import pytest

from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import GiB, HardwareSpec, link, preset
from tuili.perf.meter import UtilizationMeter
from tuili.perf.plan import PlanInputs, compute_bound_batch, make_plan, max_concurrent_requests

LLAMA_2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
}
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# Seed 000's model: 64 layers, 16 of them full attention with 4 KV heads of 256 dims, FFN
# 5120 -> 17408, the other 48 Gated DeltaNet layers (16 key heads, 48 value heads of 128).
QWEN3_5_27B = {
    "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    },
}
# Seed 002's "H800-class" card, with the round figures its formula card uses.
SEED_002_CARD = HardwareSpec(
    name="seed 002 card", peak_flops={"fp8": 2000e12, "bf16": 1000e12, "fp16": 1000e12},
    memory_bandwidth=3e12, memory_bytes=80 * GiB, interconnect="nvlink-h800", source="seed 002 formula card",
)
NOMINAL_70B = 70e9  # "70B parameters"


def bytes_per_weight(name: str) -> float:
    """Bytes per value of a format, scales left out (as the seeds count)."""
    fmt = weight_format(name)
    return fmt.block_bytes / fmt.block if name != "int4" else 0.5


def test_decode_floor_of_a_70b_model_on_3_tb_per_s():
    bandwidth = SEED_002_CARD.memory_bandwidth
    assert NOMINAL_70B * bytes_per_weight("fp8") / bandwidth == pytest.approx(23.3e-3, abs=0.05e-3)
    assert NOMINAL_70B * bytes_per_weight("fp16") / bandwidth == pytest.approx(46.7e-3, abs=0.05e-3)
    assert NOMINAL_70B * bytes_per_weight("int4") / bandwidth == pytest.approx(11.7e-3, abs=0.05e-3)
    # FLOPs per token ~ 2 x parameters, at 2000 TFLOP/s of FP8
    assert 2 * NOMINAL_70B / SEED_002_CARD.flops("fp8") == pytest.approx(0.07e-3, rel=1e-9)
    # tuili's int4 stores an fp16 scale per group of 128 weights, which the seed leaves out
    int4 = weight_format("int4")
    assert int4.matrix_bytes(8192, 8192) == 8192 * 8192 // 2 * 66 / 64


def test_llama_2_70b_plan_reproduces_the_70b_figures():
    """Llama-2-70B has 69.0 B parameters, so its figures sit ~1.5% under the seed's nominal 70B."""
    plan = make_plan(ModelCost.from_config(LLAMA_2_70B), SEED_002_CARD, PlanInputs(
        weights=weight_format("fp8"), kv_dtype="fp8", context=1001, prompt=1000, output=500, batch=1,
    ))
    assert plan["decode_step_seconds"] == pytest.approx(23.3e-3, rel=0.03)
    assert plan["ttft_seconds"] == pytest.approx(70e-3, rel=0.03)  # 1000 tokens x 1.4e11 FLOPs / 2e15
    assert plan["e2e_seconds"] == pytest.approx(11.7, rel=0.03)  # 70 ms + 23.3 ms x 500
    # The seed's batch 333 leaves the KV cache out; so does a plan at a context of one token.
    # At 1000 tokens each sequence also reads 160 MB of KV per step, and the crossover moves far out.
    short = make_plan(ModelCost.from_config(LLAMA_2_70B), SEED_002_CARD, PlanInputs(
        weights=weight_format("fp8"), kv_dtype="fp8", context=1, prompt=1, output=1,
    ))
    assert short["compute_bound_batch"] == pytest.approx(333, rel=0.03)
    assert plan["compute_bound_batch"] > 4 * short["compute_bound_batch"]


def test_kv_cache_of_llama_2_70b():
    cost = ModelCost.from_config(LLAMA_2_70B)
    assert cost.kv_bytes_per_token("fp16") == 320 * 1024
    assert cost.kv_bytes_per_token("fp8") == 160 * 1024
    assert cost.kv_bytes_per_token("fp16") * 32768 == pytest.approx(10e9, rel=0.08)  # "about 10 GB" (10 GiB)


def test_users_that_fit_on_eight_80_gb_cards():
    cost = ModelCost.from_config(LLAMA_2_70B)
    memory = 8 * preset("h800").memory_bytes
    fp16_kv = cost.kv_bytes_per_token("fp16") * 32768
    fp8_kv = cost.kv_bytes_per_token("fp8") * 32768
    assert max_concurrent_requests(memory, NOMINAL_70B * bytes_per_weight("fp8"), fp16_kv) == 57
    assert max_concurrent_requests(memory, NOMINAL_70B * bytes_per_weight("fp8"), fp8_kv) == 114
    # the same through a TP=8 plan with no reserve, from Llama-2-70B's own FP8 weights
    plan = make_plan(cost, preset("h800"), PlanInputs(
        weights=weight_format("fp8"), kv_dtype="fp16", gpus=8, tp=8, context=32768, reserve_fraction=0.0,
    ))
    assert plan["max_concurrent_requests"] == 57


def test_kv_transfer_over_ethernet_and_infiniband():
    assert 10e9 / link("100gbe").bandwidth == pytest.approx(0.8)
    assert 10e9 / link("ib-ndr").bandwidth == pytest.approx(0.2)


def test_fp8_decode_turns_compute_bound_near_batch_333():
    batch = compute_bound_batch(
        SEED_002_CARD.flops("fp8"), SEED_002_CARD.memory_bandwidth,
        flops_per_token=2 * NOMINAL_70B, weight_bytes=NOMINAL_70B * bytes_per_weight("fp8"),
    )
    assert batch == pytest.approx(333.3, abs=0.1)


def test_v100_does_62_fma_per_byte():
    v100 = preset("v100-pcie-32gb")
    # 640 tensor cores x 64 FMA per clock at the 1.38 GHz boost clock = 56.5 T FMA/s (the preset's 112 TFLOP/s)
    assert 640 * 64 * 1.38e9 * 2 == pytest.approx(v100.flops("fp16"), rel=0.01)
    assert preset("v100-sxm2-32gb").flops("fp16") == pytest.approx(640 * 64 * 1.53e9 * 2, rel=0.01)
    assert v100.flops("fp16") / 2 / v100.memory_bandwidth == pytest.approx(62, abs=0.5)


def test_llama_2_7b_kv_cache_in_seed_004():
    kv = ModelCost.from_config(LLAMA_2_7B).kv_bytes_per_token("fp16")
    assert kv * 2048 == 1 * GiB  # "2048 tokens, batch 1: 1 GB"
    assert kv * 32768 == 16 * GiB  # "32768: 16 GB"


def test_the_27b_hybrid_of_seed_000():
    cost = ModelCost.from_config(QWEN3_5_27B)
    kinds = cost.params_by_kind()
    assert cost.params_matmul - kinds["lm_head"] == pytest.approx(243.5e8, abs=0.05e8)  # in the projections
    assert kinds["mlp"] == pytest.approx(171e8, abs=0.5e8)  # "FFN alone 17.1 B"
    assert cost.params_total == pytest.approx(27e9, rel=0.01)
    assert cost.kv_bytes_per_token("fp16") == 64 * 1024  # 16 x 4 x 256 x 2 values x 2 bytes
    assert cost.kv_bytes_per_token("fp16") * 256 * 1024 == 16 * GiB  # "260k tokens: 16 GB"
    assert cost.state_bytes_per_sequence() == pytest.approx(150e6, rel=0.05)  # "about 150 MB per request"
    # "40,960 tokens of prefill need about 2336 T FLOPs (1168 T FMA)"
    assert cost.prefill_flops(0, 40960) == pytest.approx(2336e12, rel=0.001)


def test_prefill_mfu_of_seed_000_through_the_meter():
    """40,960 tokens prefilled in 15.41 s on three V100s of 112.58 TFLOP/s each: MFU 44.9%."""
    cost = ModelCost.from_config(QWEN3_5_27B)
    v100 = HardwareSpec(name="V100 (seed 000)", peak_flops={"fp16": 112.58e12}, memory_bandwidth=900e9,
                        memory_bytes=32 * GiB)
    meter = UtilizationMeter(cost, v100, weight_bytes=cost.weight_bytes("int8"),
                             kv_bytes_per_token=cost.kv_bytes_per_token("fp8"), compute_dtype="fp16", devices=3)
    chunk = 8192  # a chunked prefill counts the same FLOPs as one piece
    for start in range(0, 40960, chunk):
        meter.record_step([(start, chunk)], [], 15.41 * chunk / 40960)
    assert meter.summary().prefill_mfu == pytest.approx(0.449, abs=0.001)
