"""The ruler on the hybrid family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): the cost model's DeltaNet
state bytes, DeltaNet FLOPs and active MoE parameters against a count by hand from the config,
against transformers' own parameter count, and against what the engine itself holds (its pool
plan's state slot, its weight tensors by kind); `tuili plan` and `tuili plan --measure` on a
hybrid checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tuili import LLM
from tuili.cli import main
from tuili.config import ModelConfig
from tuili.engine.pool import kv_bytes_per_block, state_bytes_per_slot
from tuili.errors import TuiliError
from tuili.layers.quant import Int4Linear
from tuili.perf.cost import ModelCost
from tuili.perf.hardware import HardwareSpec
from tuili.perf.measure import engine_storage
from tuili.perf.overhead import PACKED_BLOCK_ROWS, Step, packed_work
from tuili.perf.plan import PlanInputs, Roofline

COMMON = dict(
    vocab_size=320, hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, max_position_embeddings=256,
)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
CASES = {
    "qwen3_next": (transformers.Qwen3NextConfig, "Qwen3NextForCausalLM", dict(intermediate_size=96, **MOE)),
    "qwen3_5": (transformers.Qwen3_5TextConfig, "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM", MOE),
}


def _config(family: str) -> dict:
    config_class, architecture, fields = CASES[family]
    return json.loads(json.dumps(config_class(**COMMON, **fields).to_dict() | {"architectures": [architecture]}))


def _hand_counts(family: str, context: int) -> dict[str, int]:
    """State bytes (float32 recurrent state, conv state in bf16), active matmul parameters and
    the FLOPs of one decoded token at `context`, counted from the config's numbers by hand."""
    h, v, heads, kv, d = 48, 320, 6, 2, 16
    hk, hv, dk, dv, kernel = 2, 6, 16, 8, 4
    linear_layers, full_layers = 3, 1
    channels = 2 * hk * dk + hv * dv  # q, k, v through the conv
    state = linear_layers * (hv * dk * dv * 4 + channels * (kernel - 1) * 2)
    attention = 2 * heads * d * h + 2 * kv * d * h + heads * d * h  # q_proj with its gate, k, v, o
    deltanet = (channels + hv * dv) * h + 2 * hv * h + hv * dv * h  # in_proj_qkvz, in_proj_ba, out_proj
    if family == "qwen3_5":
        mlp = 3 * h * 96
    else:  # router, top-2 of the 8 experts, the shared expert and its gate
        mlp = 8 * h + 2 * 3 * h * 16 + 3 * h * 24 + h
    active = full_layers * attention + linear_layers * deltanet + 4 * mlp + v * h  # + lm_head
    flops = (2 * active
             + linear_layers * (2 * channels * kernel + 7 * hv * dk * dv)  # conv; decay, k^T S, write, q^T S
             + full_layers * 4 * heads * d * context)  # QK^T and PV over the context  # fmt: skip
    return {"state": state, "active": active, "flops": flops}


def transformers_params(config: dict) -> int:
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", list(CASES))
def test_cost_model_counts_state_flops_and_active_params_as_by_hand(family):
    config = _config(family)
    cost = ModelCost.from_config(config)
    hand = _hand_counts(family, context=37)
    assert cost.state_bytes_per_sequence() == hand["state"]
    assert cost.params_active == hand["active"]
    assert cost.decode_flops([37]) == hand["flops"]
    assert cost.params_total == transformers_params(config)
    # the engine's own accounting of a slot, in its working dtype (here bf16, the plan's default)
    assert state_bytes_per_slot(ModelConfig.from_hf_config(config), torch.bfloat16) == hand["state"]


@pytest.mark.parametrize("family", list(CASES))
def test_plan_reports_state_bytes_and_capacity(family, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(family)))
    assert main(["plan", "--config", str(path), "--hardware", "h100-sxm", "--context", "1000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    hand = _hand_counts(family, context=1000)
    assert plan["state_bytes_per_request"] == hand["state"]
    kv_per_token = 2 * 1 * 2 * 16 * 2  # one full-attention layer, 2 KV heads of 16, bf16
    assert plan["kv_bytes_per_token"] == kv_per_token
    assert plan["kv_bytes_per_request"] == 1000 * kv_per_token


@pytest.mark.parametrize("family", list(CASES))
def test_engine_holds_what_the_cost_model_counts(family, tmp_path):
    """float32 engine: its pool's state slot is the cost model's state with the conv state in
    float32; its weights by kind (linear attention apart) and in all are the cost model's; a
    decode step of one sequence reads k of the E experts."""
    config_class, _, fields = CASES[family]
    torch.manual_seed(0)
    path = tmp_path / family
    transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **fields)).float().save_pretrained(path)
    engine = LLM(model=str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
                 kv_cache_memory=1 << 20).engine  # fmt: skip
    cost = ModelCost.from_config(json.loads((path / "config.json").read_text()))
    assert engine.pool.state_bytes_per_slot == cost.state_bytes_per_sequence(conv_dtype="fp32")
    # what --measure predicts a decoding sequence's state to be, as it plans for this engine
    card = HardwareSpec(name="cpu", peak_flops={"fp32": 1e11}, memory_bandwidth=1e10, memory_bytes=2**33)
    inputs = PlanInputs(weights=engine_storage(engine.model), kv_dtype="fp32", conv_state_dtype="fp32")
    assert Roofline(cost, card, inputs).state_device == engine.pool.state_bytes_per_slot
    assert engine.pool.bytes_per_block == 4 * cost.kv_bytes_per_token("fp32")
    assert engine.pool.bytes_per_block == kv_bytes_per_block(engine.model_config, 4, torch.float32)
    by_kind = {kind: n for kind, n in cost.weight_bytes_by_kind("fp32").items() if n}
    assert engine_storage(engine.model).bytes_by_kind == by_kind
    assert by_kind["linear_attention"] > 0
    assert engine.weight_bytes() == cost.weight_bytes("fp32")
    if cost.shape.moe is not None:
        experts_unread = by_kind["experts"] * (8 - 2) // 8
        assert engine.decode_weight_bytes() == engine.weight_bytes() - experts_unread - by_kind["embedding"]
        assert cost.decode_weight_bytes("fp32", 1) == engine.decode_weight_bytes() + 48 * 4  # one embedding row


def test_plan_measure_runs_on_a_hybrid_moe(tmp_path, capsys, monkeypatch):
    """`tuili plan --measure` on a Qwen3.5-MoE checkpoint: the engine's DeltaNet weights have a
    kind, the predicted decode bytes include the state as the engine holds it (float32 conv)."""
    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    config_class, _, fields = CASES["qwen3_5_moe"]
    torch.manual_seed(0)
    path = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **fields)).float().save_pretrained(path)
    spec = tmp_path / "cpu.json"
    spec.write_text(json.dumps({"name": "cpu", "peak_flops": {"fp32": 5e10}, "memory_bandwidth": 5e9,
                                "memory_bytes": 2**33}))  # fmt: skip
    assert main(["plan", "--model", str(path), "--hardware", str(spec), "--device", "cpu", "--dtype", "float32",
                 "--measure", "--prompt", "12", "--output", "4", "--batch", "2", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["comparisons"]}
    assert report["decode_steps"] == 3
    for row in rows.values():
        assert row["predicted"] > 0 and row["measured"] > 0


@pytest.mark.parametrize("packed", [False, True], ids=["float", "packed"])
def test_a_hybrid_prompts_rule_is_charged_at_its_kernels_measured_rate(packed):
    """The DeltaNet rule's FLOPs of a prompt (7 per state value and token, by hand) take the
    probed rate of the prompt kernel, the rest the linears'; a spec without it, a decode step and
    a model without linear attention are untouched, and a spec saved as JSON keeps it."""
    config = _config("qwen3_5")
    cost = ModelCost.from_config(config)
    assert cost.prefill_state_flops(100) == 100 * 3 * 7 * 6 * 16 * 8
    card = HardwareSpec(name="cpu", peak_flops={"fp32": 1e11}, memory_bandwidth=1e10, memory_bytes=2**33)
    measured = HardwareSpec(**{**card.to_dict(), "deltanet_prefill_flops": {"fp32": 2e9}})
    assert HardwareSpec.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    inputs = PlanInputs(weights="fp32", kv_dtype="fp32", conv_state_dtype="fp32", packed_formats={"int4+zeros": 1.0} if packed else {},
                        compute_dtype="fp32")
    base, slow = Roofline(cost, card, inputs), Roofline(cost, measured, inputs)
    extra = cost.prefill_state_flops(100) * (1 / 2e9 - 1 / 1e11)
    assert slow.prefill(0, 100).seconds - base.prefill(0, 100).seconds == pytest.approx(extra, rel=1e-6)
    assert slow.decode_uniform(100, 1).seconds == base.decode_uniform(100, 1).seconds
    llama = ModelCost.from_config({"model_type": "llama", "vocab_size": 320, "hidden_size": 48,
                                   "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
                                   "num_key_value_heads": 2})  # fmt: skip
    assert llama.prefill_state_flops(100) == 0
    with pytest.raises(TuiliError, match=r"deltanet_prefill_flops\['fp32'\]"):
        HardwareSpec(**{**card.to_dict(), "deltanet_prefill_flops": {"fp32": -1.0}})


@pytest.mark.parametrize("family", list(CASES))
def test_packed_work_counts_every_linear_the_engine_packs(family, tmp_path):
    """The planner's packed kernel work of a step (the weight values its int4 kernel unpacks) is
    what the engine holds packed under `quantization="int4"`: every layer's attention or Gated
    DeltaNet projections, its MLP or shared expert, a MoE layer's router and shared-expert gate,
    each in whole 64-row blocks. Widths that int4's groups divide (the shapes above do not)."""
    config_class, architecture, fields = CASES[family]
    sizes = dict(COMMON, hidden_size=64, num_attention_heads=4, head_dim=32, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32)  # fmt: skip
    fields = fields | ({"intermediate_size": 128} if "intermediate_size" in fields else {})
    if "num_experts" in fields:
        fields = fields | dict(moe_intermediate_size=32, shared_expert_intermediate_size=64)
    hf_config = config_class(**sizes, **fields)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), quantization="int4", dtype="bfloat16", kv_cache_memory=1 << 20)
    held = sum(
        module.packed.shape[0] * PACKED_BLOCK_ROWS * module.in_features
        for name, module in llm.engine.runner.model.named_modules()
        if isinstance(module, Int4Linear) and ".layers." in name
    )
    config = json.loads(json.dumps(hf_config.to_dict() | {"architectures": [architecture]}))
    work = packed_work(ModelCost.from_config(config).shape, Step(prefill=False, tokens=3, packed=True))
    assert work is not None and work.values == held and work.calls == (3,)
