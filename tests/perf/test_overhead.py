"""What the planner adds to the roofline: the engine's host overhead per step and per layer, and
packed int4 linears' unpacking and dequantization, from the spec's measured figures and the
config's counts; and the spec fields that carry them."""

from __future__ import annotations

import json

import pytest

from tuili.errors import TuiliError
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import HardwareSpec, load_spec_file, preset, save_probe
from tuili.perf.overhead import HOST_KEYS, Step, packed_work
from tuili.perf.plan import PlanInputs, Roofline, make_plan
from tuili.perf.resolve import current_hardware

# SmolLM2-135M's shape (its config.json): 30 Llama layers, 9 heads over 3 KV heads, tied embeddings
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": True,
}
CPU = HardwareSpec(name="cpu", peak_flops={"fp32": 1e11}, memory_bandwidth=1e10, memory_bytes=2**34)
INT4 = {"int4+zeros": 1.0}  # every packed value in the format of `--quantization int4`


def with_host(**seconds: float) -> HardwareSpec:
    return HardwareSpec(**{**CPU.to_dict(), "host_overhead_seconds": seconds})


def plan(config: dict, spec: HardwareSpec, **kw) -> dict:
    options = dict(weights=weight_format("fp32"), kv_dtype="fp32", compute_dtype="fp32", prompt=256, output=32,
                   context=288)
    inputs = PlanInputs(**{**options, **kw})
    return make_plan(ModelCost.from_config(config), spec, inputs)


@pytest.mark.parametrize(
    "key, config, decode, prefill",
    [
        # SmolLM2: 30 Llama layers; Qwen3-0.6B: 28 layers with q/k norms
        ("decode_layer", SMOLLM2, 30, 0),
        ("prefill_layer", SMOLLM2, 0, 30),
        ("decode_step", SMOLLM2, 1, 0),
        ("prefill_step", SMOLLM2, 0, 1),
        ("qk_norm_layer", SMOLLM2, 0, 0),
        ("qk_norm_layer", QWEN3_06B, 28, 28),
        ("decode_layer", QWEN3_06B, 28, 0),
        ("packed_decode_layer", SMOLLM2, 0, 0),  # float linears: not theirs
    ],
)
def test_a_host_figure_moves_every_time_by_its_count(key, config, decode, prefill):
    base, delta = 2e-5, 7e-6
    figures = dict.fromkeys(HOST_KEYS, base)
    before = plan(config, with_host(**figures))
    after = plan(config, with_host(**{**figures, key: base + delta}))
    assert after["decode_step_seconds"] - before["decode_step_seconds"] == pytest.approx(decode * delta, abs=1e-12)
    assert after["decode_step_overhead_seconds"] - before["decode_step_overhead_seconds"] == pytest.approx(
        decode * delta, abs=1e-12)
    assert after["ttft_seconds"] - before["ttft_seconds"] == pytest.approx(prefill * delta, abs=1e-12)
    # the first token is the prefill's; each of the other 31 takes a decode step
    assert after["e2e_seconds"] - before["e2e_seconds"] == pytest.approx((prefill + 31 * decode) * delta, abs=1e-11)
    assert after["e2e_overhead_seconds"] == pytest.approx(after["prefill_overhead_seconds"]
                                                          + 31 * after["decode_step_overhead_seconds"])


def test_packed_layers_take_their_own_figure_else_the_float_one():
    float_only = with_host(decode_step=1e-4, decode_layer=2e-4)
    both = with_host(decode_step=1e-4, decode_layer=2e-4, packed_decode_layer=3e-4)
    assert plan(SMOLLM2, float_only, packed_formats=INT4)["decode_step_overhead_seconds"] == pytest.approx(
        1e-4 + 30 * 2e-4)
    assert plan(SMOLLM2, both, packed_formats=INT4)["decode_step_overhead_seconds"] == pytest.approx(1e-4 + 30 * 3e-4)
    assert plan(SMOLLM2, both)["decode_step_overhead_seconds"] == pytest.approx(1e-4 + 30 * 2e-4)


def test_overhead_adds_to_the_roofline_and_lowers_throughput():
    p = plan(SMOLLM2, with_host(decode_step=3e-4, decode_layer=2.5e-4, prefill_step=7e-4, prefill_layer=6e-4),
             batch=4)
    assert p["decode_step_overhead_seconds"] == pytest.approx(3e-4 + 30 * 2.5e-4)
    assert p["decode_step_seconds"] == pytest.approx(p["decode_step_roofline_seconds"]
                                                     + p["decode_step_overhead_seconds"])
    assert p["decode_tokens_per_second"] == pytest.approx(4 / p["decode_step_seconds"])
    assert p["ttft_seconds"] == pytest.approx(p["prefill_roofline_seconds"] + 7e-4 + 30 * 6e-4)


# SmolLM2's layers hold 30 x 576 x (960 + 576 + 3072 + 1536) weights in their qkv, o, gate/up
# and down linears, every dimension a multiple of the 64-row blocks
SMOLLM2_LAYER_VALUES = 30 * 576 * (960 + 576 + 3072 + 1536)


def packed_plan(hardware: HardwareSpec, batch: int) -> dict:
    return plan(SMOLLM2, hardware, batch=batch, packed_formats=INT4)


def test_packed_prefills_dequantize_every_layer_weight_once():
    per_value = 2e-9
    spec = HardwareSpec(**{**CPU.to_dict(), "packed_dequant_seconds_per_value": {"int4+zeros": per_value}})
    # a 256-token prompt is past the weight-only kernel's 48 rows: it dequantizes
    assert packed_plan(spec, 1)["prefill_dequant_seconds"] == pytest.approx(SMOLLM2_LAYER_VALUES * per_value,
                                                                            rel=1e-12)
    assert packed_plan(spec, 1)["ttft_seconds"] - packed_plan(CPU, 1)["ttft_seconds"] == pytest.approx(
        SMOLLM2_LAYER_VALUES * per_value, rel=1e-9)
    # a decode step of one sequence runs the kernel, of 64 dequantizes too
    assert packed_plan(spec, 1)["decode_step_dequant_seconds"] == 0
    assert packed_plan(spec, 64)["decode_step_dequant_seconds"] == pytest.approx(
        SMOLLM2_LAYER_VALUES * per_value, rel=1e-12)
    # float linears never dequantize
    assert plan(SMOLLM2, spec)["prefill_dequant_seconds"] == 0


def test_where_many_rows_run_the_int4_kernel_a_prefill_pays_it_per_row_and_dequantizes_nothing():
    """A machine whose probe found many rows going through the weight-only kernel (the
    batch-invariant mode with native kernels): a packed prompt of T tokens takes values x T x the
    many-row rate when that is the ceiling, grows with T, and has no dequantization or tiled-matmul
    term; the decode step keeps the one-row rate."""
    rate = 4e-10  # slow enough to be the packed linears' ceiling
    spec = HardwareSpec(**{**CPU.to_dict(), "packed_rows_seconds_per_value": {"int4+zeros": rate},
                           "packed_dequant_seconds_per_value": {"int4+zeros": 2e-9}})
    doubled = HardwareSpec(**{**spec.to_dict(), "packed_rows_seconds_per_value": {"int4+zeros": 2 * rate}})
    for prompt in (256, 512):
        p, q = (plan(SMOLLM2, s, prompt=prompt, packed_formats=INT4) for s in (spec, doubled))
        assert p["prefill_dequant_seconds"] == 0 == p["prefill_kernels_seconds"]
        assert q["ttft_seconds"] - p["ttft_seconds"] == pytest.approx(SMOLLM2_LAYER_VALUES * prompt * rate, rel=1e-9)
    assert packed_plan(spec, 1)["decode_step_seconds"] == packed_plan(doubled, 1)["decode_step_seconds"]
    assert packed_plan(spec, 1)["decode_step_seconds"] == packed_plan(CPU, 1)["decode_step_seconds"]


def curve_spec(curve: dict[int, float], **fields) -> HardwareSpec:
    return HardwareSpec(**{**CPU.to_dict(), "packed_call_seconds_by_rows": {"int4+zeros": curve}, **fields})


@pytest.mark.parametrize("batch, per_value", [(1, 1e-9), (4, 2e-9), (8, 2e-9 + 3.5e-9 * 4 / 12), (16, 5.5e-9)])
def test_a_decode_step_takes_one_kernel_call_on_the_measured_curve(batch, per_value):
    """A probe's curve (a call reads and unpacks the codes once for all its rows): a decode step of
    B sequences is one call per linear, charged the curve's time at B rows (interpolated between
    the measured 4 and 16), not B times one row's; the one-row figures of older specs do not count
    where a curve stands."""
    curve = {1: 1e-9, 4: 2e-9, 16: 5.5e-9, 64: 1.5e-8, 256: 5e-8}
    spec, slower = curve_spec(curve), curve_spec({rows: 3 * s for rows, s in curve.items()},
                                                 packed_kernel_seconds_per_value={"int4+zeros": 1.0e-6})
    step = packed_plan(slower, batch)["decode_step_seconds"] - packed_plan(spec, batch)["decode_step_seconds"]
    assert step == pytest.approx(SMOLLM2_LAYER_VALUES * 2 * per_value, rel=1e-9)


def test_a_prompt_past_the_kernel_rows_is_charged_its_blocks_on_the_curve():
    """The batch-invariant mode: a 300-token prompt runs each linear as calls of 256 and 44 rows,
    charged the curve at each (the probe's 256-row block, and 44 rows between 16 and 64), with no
    dequantization."""
    curve = {1: 1e-9, 4: 2e-9, 16: 5.5e-9, 64: 1.5e-8, 256: 5e-8}
    spec, slower = curve_spec(curve), curve_spec({rows: 3 * s for rows, s in curve.items()})
    p, q = (plan(SMOLLM2, s, prompt=300, context=332, packed_formats=INT4) for s in (spec, slower))
    assert p["prefill_dequant_seconds"] == 0
    at_44 = 5.5e-9 + (1.5e-8 - 5.5e-9) * (44 - 16) / 48
    assert q["ttft_seconds"] - p["ttft_seconds"] == pytest.approx(SMOLLM2_LAYER_VALUES * 2 * (5e-8 + at_44), rel=1e-9)


@pytest.mark.parametrize("config, rope", [(SMOLLM2, "rope"), (QWEN3_06B, "qk_rope")])
def test_the_elementwise_work_is_charged_per_token_at_its_measured_rates(config, rope):
    """Every layer's two norms (and the final one) over the hidden size, each attention layer's
    rotation of its q and k heads (with the per-head norms where the model has them: Qwen3), each
    dense MLP's SiLU over the intermediate size: the prompt's tokens and a decode step's sequences
    times those values at the spec's seconds per value."""
    rates = {"norm": 3e-10, "rope": 1e-10, "qk_rope": 4e-10, "silu": 5e-10}
    spec = HardwareSpec(**{**CPU.to_dict(), "elementwise_seconds_per_value": {"fp32": rates}})
    layers, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    per_token = ((2 * layers + 1) * hidden * rates["norm"] + layers * inter * rates["silu"]
                 + layers * (config["num_attention_heads"] + config["num_key_value_heads"]) * head_dim * rates[rope])
    for batch in (1, 4):
        with_rates, without = plan(config, spec, batch=batch), plan(config, CPU, batch=batch)
        assert with_rates["ttft_seconds"] - without["ttft_seconds"] == pytest.approx(256 * per_token, rel=1e-9)
        assert with_rates["decode_step_seconds"] - without["decode_step_seconds"] == pytest.approx(
            batch * per_token, rel=1e-9)
    # rates measured for another dtype charge nothing
    bf16_only = HardwareSpec(**{**CPU.to_dict(), "elementwise_seconds_per_value": {"bf16": rates}})
    assert plan(config, bf16_only)["ttft_seconds"] == plan(config, CPU)["ttft_seconds"]


@pytest.mark.parametrize("batch", [1, 4])
def test_the_int4_kernel_unpacks_every_weight_for_every_row(batch):
    """A kernel slow enough to be the packed linears' ceiling: the decode step takes their
    values x rows x its time per value, and the prefill (tiled) none of it."""
    slow, slower = (HardwareSpec(**{**CPU.to_dict(), "packed_kernel_seconds_per_value": {"int4+zeros": s}})
                    for s in (1e-9, 3e-9))
    step = packed_plan(slower, batch)["decode_step_seconds"] - packed_plan(slow, batch)["decode_step_seconds"]
    assert step == pytest.approx(batch * SMOLLM2_LAYER_VALUES * 2e-9, rel=1e-9)
    assert packed_plan(slower, batch)["ttft_seconds"] == packed_plan(slow, batch)["ttft_seconds"]


def test_each_packed_format_is_charged_at_its_own_rate_by_its_share_of_the_values():
    """A model whose packed values are a quarter int4 and three quarters int8 (a Q8_0 file with
    some Q4_0 layers): the kernel takes each format's share at that format's rate; a format the
    spec has no figure for takes the mean of those it has, so a spec saved with one format's figure
    (before formats were told apart) charges every format at it."""
    rates = {"int4": 1e-9, "int8": 3e-9, "int6": 8e-9}
    spec = HardwareSpec(**{**CPU.to_dict(), "packed_kernel_seconds_per_value": rates})
    mixed = plan(SMOLLM2, spec, packed_formats={"int4": 0.25, "int8": 0.75})["decode_step_seconds"]
    int4 = plan(SMOLLM2, spec, packed_formats={"int4": 1.0})["decode_step_seconds"]
    assert mixed - int4 == pytest.approx(SMOLLM2_LAYER_VALUES * 0.75 * (3e-9 - 1e-9), rel=1e-9)
    unmeasured = plan(SMOLLM2, spec, packed_formats={"int4+zeros": 1.0})["decode_step_seconds"]
    assert unmeasured - int4 == pytest.approx(SMOLLM2_LAYER_VALUES * (4e-9 - 1e-9), rel=1e-9)
    with pytest.raises(TuiliError, match="packed format 'int5'"):
        plan(SMOLLM2, spec, packed_formats={"int5": 1.0})


def test_a_spec_saved_with_one_int4_figure_loads_as_that_formats(tmp_path):
    path = tmp_path / "before.json"
    fields = {k: v for k, v in CPU.to_dict().items() if not k.startswith("packed_")}
    path.write_text(json.dumps({**fields, "int4_kernel_seconds_per_value": 2e-10, "int4_dequant_seconds_per_value": 0.0,
                                "int4_rows_seconds_per_value": 5e-11}))
    before = load_spec_file(path)
    assert before.packed_kernel_seconds_per_value == {"int4+zeros": 2e-10}
    assert before.packed_rows_seconds_per_value == {"int4+zeros": 5e-11} and before.packed_dequant_seconds_per_value == {}


def test_presets_have_no_overhead_and_predict_the_roofline():
    p = plan(QWEN3_06B, preset("h100-sxm"))
    assert p["decode_step_overhead_seconds"] == 0 == p["prefill_overhead_seconds"]
    assert p["decode_step_seconds"] == p["decode_step_roofline_seconds"]


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))


def test_a_saved_spec_round_trips_its_overheads(private_cache):
    spec = HardwareSpec(name="box (probed)", peak_flops={"fp32": 1e11}, memory_bandwidth=2e10, memory_bytes=2**34,
                        origin="probe", host_overhead_seconds={"decode_layer": 2.5e-4, "decode_step": 1.25e-4},
                        packed_kernel_seconds_per_value={"int4": 1.5e-10, "int8": 2.5e-10},
                        packed_dequant_seconds_per_value={"int4": 2.5e-9}, packed_rows_seconds_per_value={"int8": 3.5e-11},
                        packed_call_seconds_by_rows={"int8": {1: 2.5e-10, 16: 1.5e-9, 256: 9e-9}},
                        elementwise_seconds_per_value={"bf16": {"norm": 3e-10, "silu": 4e-10}})
    save_probe(spec, "cpu")
    loaded = current_hardware("cpu")
    assert loaded == spec and loaded.host_overhead_seconds == {"decode_layer": 2.5e-4, "decode_step": 1.25e-4}
    assert (loaded.packed_kernel_seconds_per_value, loaded.packed_dequant_seconds_per_value,
            loaded.packed_rows_seconds_per_value) == ({"int4": 1.5e-10, "int8": 2.5e-10}, {"int4": 2.5e-9},
                                                      {"int8": 3.5e-11})


def test_a_spec_saved_before_overheads_still_loads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({
        "name": "old probe", "peak_flops": {"fp32": 1e11}, "memory_bandwidth": 2e10, "memory_bytes": 2**34,
        "origin": "probe", "measurements": {"memory read": 2e10},
    }))
    old = load_spec_file(path)
    assert old.host_overhead_seconds == {} and old.packed_dequant_seconds_per_value == {} == old.packed_rows_seconds_per_value
    p = plan(SMOLLM2, old)
    assert p["decode_step_overhead_seconds"] == 0 and p["decode_step_seconds"] == p["decode_step_roofline_seconds"]


@pytest.mark.parametrize(
    "fields, message",
    [({"host_overhead_seconds": {"kernel": 1e-6}}, "'kernel'"),
     ({"host_overhead_seconds": {"decode_layer": -1e-6}}, "decode_layer"),
     ({"host_overhead_seconds": {"decode_layer": "slow"}}, "slow"), ({"host_overhead_seconds": [1e-6]}, "map"),
     ({"int4_dequant_seconds_per_value": 2.0}, "int4_dequant_seconds_per_value"),
     ({"int4_kernel_seconds_per_value": -1e-9}, "int4_kernel_seconds_per_value"),
     ({"packed_kernel_seconds_per_value": {"int4": 0.0}}, r"packed_kernel_seconds_per_value\['int4'\]"),
     ({"packed_rows_seconds_per_value": {"int5": 1e-10}}, "'int5'"),
     ({"packed_call_seconds_by_rows": {"int5": {"1": 1e-10}}}, "'int5'"),
     ({"packed_call_seconds_by_rows": {"int4": {"0": 1e-10}}}, "rows 0"),
     ({"packed_call_seconds_by_rows": {"int4": {"16": 0.5}}}, r"packed_call_seconds_by_rows\['int4'\]\[16\]"),
     ({"packed_call_seconds_by_rows": {"int4": [1e-10]}}, "map"),
     ({"elementwise_seconds_per_value": {"bf16": {"gelu": 1e-10}}}, "'gelu'"),
     ({"elementwise_seconds_per_value": {"bf16": {"silu": -1e-10}}}, r"elementwise_seconds_per_value\['bf16'\]"),
     ({"elementwise_seconds_per_value": {"fp64": {"silu": 1e-10}}}, "'fp64'")],
)
def test_bad_overheads_in_a_spec_are_named(tmp_path, fields, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x", "peak_flops": {"fp32": 1e11}, "memory_bandwidth": 1e10,
                                "memory_bytes": 2**34, **fields}))
    with pytest.raises(TuiliError, match=message):
        load_spec_file(path)


def test_plan_table_breaks_the_overhead_out(capsys, tmp_path):
    from tuili.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMOLLM2))
    spec = tmp_path / "cpu.json"
    figures = {"decode_step": 3e-4, "decode_layer": 2e-4}
    spec.write_text(json.dumps({**CPU.to_dict(), "host_overhead_seconds": figures}))
    assert main(["plan", "--config", str(config), "--hardware", str(spec), "--weights", "fp32"]) == 0
    out = capsys.readouterr().out
    # 300 µs + 30 layers x 200 µs
    assert "+ host overhead 6.3 ms" in out and "decode_layer 200 µs" in out
    assert main(["plan", "--config", str(config), "--hardware", "h100-sxm"]) == 0
    assert "none counted" in capsys.readouterr().out


def test_probed_linear_rates_are_a_floor_above_the_roofline():
    """Where the probe timed tuili's own linears below the hardware's figures, a decode step
    streams the weights at their rate (the KV at the memory's) and a prefill computes at their
    prompt-size FLOP/s; the difference is the step's kernels term, the roofline itself unchanged."""
    slow = HardwareSpec(**{**CPU.to_dict(), "linear_stream_bandwidth": {"fp32": 0.5e10},
                           "linear_prefill_flops": {"fp32": 0.25e11}})
    fast = HardwareSpec(**{**CPU.to_dict(), "linear_stream_bandwidth": {"fp32": 2e10},
                           "linear_prefill_flops": {"fp32": 4e11}})
    base, measured, capped = plan(QWEN3_06B, CPU), plan(QWEN3_06B, slow), plan(QWEN3_06B, fast)
    weights = ModelCost.from_config(QWEN3_06B).decode_weight_bytes(weight_format("fp32"), 1)
    for p in (base, measured, capped):
        assert p["decode_step_roofline_seconds"] == base["decode_step_roofline_seconds"]
    # at batch 1 the step is the weights' time: twice as long at half the rate
    assert measured["decode_step_kernels_seconds"] == pytest.approx(weights / 0.5e10 - weights / 1e10, rel=1e-9)
    assert measured["decode_step_seconds"] == pytest.approx(
        base["decode_step_seconds"] + measured["decode_step_kernels_seconds"], rel=1e-12)
    assert measured["prefill_kernels_seconds"] == pytest.approx(3 * base["prefill_roofline_seconds"], rel=1e-6)
    # rates above the hardware's figures are capped by them: the roofline holds
    assert capped["decode_step_kernels_seconds"] == 0 == capped["prefill_kernels_seconds"]
    assert capped["decode_step_seconds"] == base["decode_step_seconds"]
    # a packed-linears plan keeps its own kernel terms
    assert plan(SMOLLM2, slow, packed_formats=INT4)["decode_step_kernels_seconds"] == 0


def test_linear_rates_by_rows_set_the_prefill_floor_at_the_prompts_size():
    """The engine's linears are slower per FLOP on fewer rows (a per-call weight reorder, another
    kernel below 128 rows): a prompt's prefill computes at the rate measured nearest its length,
    interpolated between sizes; a spec saved as JSON keeps the curve."""
    curve = {64: 0.2e11, 512: 0.6e11}
    spec = HardwareSpec(**{**CPU.to_dict(), "linear_flops_by_rows": {"fp32": curve}})
    assert spec.linear_flops("fp32", 1) == spec.linear_flops("fp32", 64) == 0.2e11
    assert spec.linear_flops("fp32", 288) == pytest.approx(0.4e11)
    assert spec.linear_flops("fp32", 4096) == 0.6e11 and spec.linear_flops("bf16", 64) is None
    assert HardwareSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for prompt, rate in ((64, 0.2e11), (288, 0.4e11), (1024, 0.6e11)):
        p = plan(QWEN3_06B, spec, prompt=prompt)
        assert p["prefill_roofline_seconds"] + p["prefill_kernels_seconds"] == pytest.approx(
            plan(QWEN3_06B, CPU, prompt=prompt)["prefill_roofline_seconds"] * 1e11 / rate, rel=1e-9)  # compute bound


def test_bad_linear_rates_in_a_spec_are_named():
    with pytest.raises(TuiliError, match=r"linear_flops_by_rows\['fp32'\] of 'cpu' has the size 0"):
        HardwareSpec(**{**CPU.to_dict(), "linear_flops_by_rows": {"fp32": {0: 1e10}}})
    with pytest.raises(TuiliError, match=r"linear_flops_by_rows\['fp32'\]: 'x' is not a whole number"):
        HardwareSpec.from_dict({**CPU.to_dict(), "linear_flops_by_rows": {"fp32": {"x": 1e10}}})
    with pytest.raises(TuiliError, match=r"linear_stream_bandwidth for 'fp64'"):
        HardwareSpec(**{**CPU.to_dict(), "linear_stream_bandwidth": {"fp64": 1e10}})
    with pytest.raises(TuiliError, match=r"linear_prefill_flops\['fp32'\]"):
        HardwareSpec(**{**CPU.to_dict(), "linear_prefill_flops": {"fp32": -1.0}})


def test_a_prompts_attention_is_charged_at_its_own_measured_rate():
    """Attention runs well below the linears' rate: its FLOPs (the causal half) take their own
    probed rate at the prompt's length, the rest of the prefill the linears'; decode steps and
    specs without the curve are untouched, and a spec saved as JSON keeps it."""
    curve = {64: 0.1e11, 1024: 0.3e11}
    spec = HardwareSpec(**{**CPU.to_dict(), "attention_flops_by_tokens": {"fp32": curve}})
    assert spec.attention_flops("fp32", 544) == pytest.approx(0.2e11) and spec.attention_flops("bf16", 64) is None
    assert HardwareSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    attention = ModelCost.from_config(QWEN3_06B).prefill_attention_flops(0, 544)
    assert 0 < attention < ModelCost.from_config(QWEN3_06B).prefill_flops(0, 544)
    base, measured = plan(QWEN3_06B, CPU, prompt=544), plan(QWEN3_06B, spec, prompt=544)
    assert base["prefill_kernels_seconds"] == 0
    assert measured["prefill_kernels_seconds"] == pytest.approx(attention / 0.2e11 - attention / 1e11, rel=1e-9)
    assert measured["decode_step_seconds"] == base["decode_step_seconds"]
    # packed int4 linears keep their own terms and add the attention's
    packed = plan(QWEN3_06B, spec, prompt=544, packed_formats=INT4)
    assert packed["prefill_kernels_seconds"] == pytest.approx(attention / 0.2e11 - attention / 1e11, rel=1e-9)
    with pytest.raises(TuiliError, match=r"attention_flops_by_tokens\['fp32'\] of 'cpu' has the size 0"):
        HardwareSpec(**{**CPU.to_dict(), "attention_flops_by_tokens": {"fp32": {0: 1e10}}})


def test_a_decodes_cache_reads_are_charged_at_its_attentions_measured_rate():
    """Decode attention reads the KV cache below the memory's rate on some CPUs (a third of it
    on an AVX2 Zen 3): a decode step's cache bytes take the probed rate of that dtype's cache,
    growing with the context and the batch; its weights, the prefill and a rate above the
    memory's are untouched; packed plans add it to their own terms."""
    slow = HardwareSpec(**{**CPU.to_dict(), "decode_attention_bandwidth": {"fp32": 0.25e10}})
    assert HardwareSpec.from_dict(json.loads(json.dumps(slow.to_dict()))) == slow
    cost = ModelCost.from_config(QWEN3_06B)
    for batch, context in ((1, 288), (4, 288), (1, 2048)):
        base = plan(QWEN3_06B, CPU, batch=batch, context=context, prompt=context - 32)
        p = plan(QWEN3_06B, slow, batch=batch, context=context, prompt=context - 32)
        kv = Roofline(cost, CPU, PlanInputs(weights=weight_format("fp32"), kv_dtype="fp32", compute_dtype="fp32"))
        extra = batch * kv.cache_bytes(context) * (1 / 0.25e10 - 1 / 1e10)  # the step at the full context
        assert kv.cache_bytes(context) == 28 * 2 * 8 * 128 * 4 * context  # every layer's k and v, fp32
        assert p["decode_step_seconds"] - base["decode_step_seconds"] == pytest.approx(extra, rel=1e-6)
        assert p["ttft_seconds"] == base["ttft_seconds"]
        packed = plan(QWEN3_06B, slow, batch=batch, context=context, prompt=context - 32, packed_formats=INT4)
        unpacked = plan(QWEN3_06B, CPU, batch=batch, context=context, prompt=context - 32, packed_formats=INT4)
        assert packed["decode_step_kernels_seconds"] - unpacked["decode_step_kernels_seconds"] == pytest.approx(extra, rel=1e-6)
    fast = HardwareSpec(**{**CPU.to_dict(), "decode_attention_bandwidth": {"fp32": 4e10, "bf16": 1e9}})
    assert plan(QWEN3_06B, fast)["decode_step_seconds"] == plan(QWEN3_06B, CPU)["decode_step_seconds"]
    with pytest.raises(TuiliError, match=r"decode_attention_bandwidth\['fp32'\]"):
        HardwareSpec(**{**CPU.to_dict(), "decode_attention_bandwidth": {"fp32": 0.0}})


def test_a_packed_output_head_takes_its_kernels_time_per_row_of_logits():
    """A GGUF file's logits read a packed copy of the output matrix: each row of logits (a decode
    step's sequences, a prompt's last token) takes the head's values at its format's measured
    rate where that is slower than the copy's bytes at the memory's rate; float heads and plans
    without the format are untouched."""
    rate = 1e-9
    spec = HardwareSpec(**{**CPU.to_dict(), "packed_kernel_seconds_per_value": {"int8": rate, "int4": rate / 100}})
    head = 151936 * 1024  # QWEN3_06B's tied table: the embedding's bytes, fp32 in these plans
    for batch in (1, 4):
        base, p = (plan(QWEN3_06B, spec, batch=batch, head_format=f) for f in ("", "int8"))
        extra = batch * head * rate - head * 4 / 1e10
        assert p["decode_step_seconds"] - base["decode_step_seconds"] == pytest.approx(extra, rel=1e-9)
        assert p["ttft_seconds"] - base["ttft_seconds"] == pytest.approx(head * rate - head * 4 / 1e10, rel=1e-9)
    fast = plan(QWEN3_06B, spec, head_format="int4")  # faster than its bytes: the memory's rate holds
    assert fast["decode_step_seconds"] == plan(QWEN3_06B, spec)["decode_step_seconds"]
    with pytest.raises(TuiliError, match="head format 'q4_0'"):
        plan(QWEN3_06B, spec, head_format="q4_0")


def test_a_packed_prefill_multiplies_its_dequantized_tiles_at_the_linears_measured_rate():
    """A many-row step of packed linears dequantizes them into tiles that go through the same
    matmuls as dense linears: those FLOPs take the linears' measured rate, not the peak (and, with
    no attention curve, so does the attention); a decode step's packed kernel keeps its own term."""
    spec = HardwareSpec(**{**CPU.to_dict(), "linear_flops_by_rows": {"fp32": {64: 0.5e11, 1024: 0.5e11}}})
    cost = ModelCost.from_config(QWEN3_06B)
    work = packed_work(cost.shape, Step(prefill=True, tokens=544, packed=True))
    assert work is not None and work.dequantized
    packed_flops = 2 * 544 * work.values
    attention = cost.prefill_attention_flops(0, 544)
    p = plan(QWEN3_06B, spec, prompt=544, packed_formats=INT4)
    slower = 1 / 0.5e11 - 1 / 1e11
    assert p["prefill_kernels_seconds"] == pytest.approx((packed_flops + attention) * slower, rel=1e-9)
    assert p["decode_step_kernels_seconds"] == 0
