"""Hardware presets, spec files, the probe cache and `tuili probe`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tuili import kernels
from tuili.cli import main
from tuili.errors import TuiliError
from tuili.layers.quant import make_linear, quantize_int4
from tuili.perf.hardware import (
    ELEMENTWISE_KINDS,
    ENGINE_ATTENTION_TOKENS,
    LINKS,
    PACKED_CALL_ROWS,
    PRESETS,
    HardwareSpec,
    load_spec_file,
    preset,
    preset_for_device_name,
    probe_path,
    save_probe,
)
from tuili.perf.overhead import PACKED_OP_MAX_ROWS
from tuili.perf.resolve import current_hardware
from tuili.platform import Platform


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own probe cache, so none sees a real probe of this machine."""
    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))


def test_presets_cover_the_cards_and_links_the_ruler_promises():
    cards = [
        "v100-sxm2-16gb", "v100-sxm2-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "v100s", "t4", "a10",
        "a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "l40s", "h100-sxm", "h100-pcie",
        "h800", "h20", "h200", "b200", "rtx3090", "rtx4090", "rtx5090",
    ]
    assert set(cards) <= set(PRESETS)
    assert {"pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4", "nvlink5", "100gbe", "200gbe", "400gbe",
            "ib-hdr", "ib-ndr"} <= set(LINKS)
    for spec in PRESETS.values():
        assert spec.source and spec.origin == "preset"
        assert spec.interconnect in LINKS


@pytest.mark.parametrize(
    "name, sms, clock_hz, flop_per_clock_per_sm",
    [
        ("a100-sxm-80gb", 108, 1.41e9, 2048),  # Ampere: 4 tensor cores x 256 dense FP16 FMA per clock
        ("h100-sxm", 132, 1.83e9, 4096),  # Hopper: 4 tensor cores x 512 dense FP16 FMA per clock
    ],
)
def test_presets_are_dense_not_sparse_figures(name, sms, clock_hz, flop_per_clock_per_sm):
    """SMs x boost clock x FLOPs per SM per clock gives the dense rate; the sparse one is twice it."""
    assert preset(name).flops("bf16") == pytest.approx(sms * clock_hz * flop_per_clock_per_sm, rel=0.01)


@pytest.mark.parametrize(
    "name, bus_bits, gbit_per_pin",
    [("a100-sxm-80gb", 5120, 3.186), ("h100-sxm", 5120, 5.23), ("rtx3090", 384, 19.5), ("rtx4090", 384, 21),
     ("rtx5090", 512, 28), ("t4", 256, 10)],
)
def test_memory_bandwidth_is_bus_width_times_data_rate(name, bus_bits, gbit_per_pin):
    assert preset(name).memory_bandwidth == pytest.approx(bus_bits * gbit_per_pin * 1e9 / 8, rel=0.01)


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(TuiliError) as e:
        current_hardware("cpu", "h100-super")
    assert "h100-super" in str(e.value) and "h100-sxm" in str(e.value) and "rtx5090" in str(e.value)


def test_preset_names_are_forgiving_and_device_names_map_to_presets():
    assert preset("H100") is PRESETS["h100-sxm"]
    assert preset("RTX 4090") is PRESETS["rtx4090"]
    assert preset_for_device_name("NVIDIA H100 80GB HBM3") is PRESETS["h100-sxm"]
    assert preset_for_device_name("NVIDIA A100-SXM4-40GB") is PRESETS["a100-sxm-40gb"]
    assert preset_for_device_name("Tesla V100-PCIE-16GB") is PRESETS["v100-pcie-16gb"]
    assert preset_for_device_name("NVIDIA H200") is PRESETS["h200"]
    assert preset_for_device_name("NVIDIA H20") is PRESETS["h20"]
    assert preset_for_device_name("NVIDIA H100 MIG 1g.10gb") is None  # a slice: its own figures
    assert preset_for_device_name("AMD Instinct MI300X") is None


def test_user_spec_files_json_and_yaml(tmp_path):
    spec = {"name": "my-card", "peak_flops": {"bf16": 100e12, "fp8": 200e12}, "memory_bandwidth": 1e12,
            "memory_bytes": 48 * 2**30, "interconnect": "pcie4", "source": "our lab"}
    path = tmp_path / "card.json"
    path.write_text(json.dumps(spec))
    loaded = current_hardware("cpu", str(path))
    assert loaded.name == "my-card" and loaded.origin == "file" and loaded.flops("fp8") == 200e12
    assert loaded.flops("int4") == 100e12  # a dtype the card lacks runs at its 16-bit rate
    # an AVX2 CPU: PyTorch's bf16 matmul far below its fp32 one, which tuili's kernels widen to
    avx2 = replace(loaded, peak_flops={"fp32": 77e9, "bf16": 0.7e9})
    assert avx2.flops("bf16") == 77e9 and avx2.dtype_used("bf16") == "fp32" and avx2.dtype_used("int4") == "fp32"
    assert loaded.dtype_used("bf16") == "bf16" and replace(loaded, peak_flops={"fp32": 1e12}).flops("bf16") == 1e12
    yaml_path = tmp_path / "card.yaml"
    yaml_path.write_text("name: yaml-card\npeak_flops: {bf16: 5.0e13}\nmemory_bandwidth: 4.0e11\nmemory_bytes: 17179869184\n")
    assert load_spec_file(yaml_path).memory_bandwidth == 4e11


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"name": "x", "peak_flops": {"bf16": 1e12}}', "memory_bandwidth"),
        ('{"name": "x", "peak_flops": {"bf17": 1e12}, "memory_bandwidth": 1e9, "memory_bytes": 1}', "bf17"),
        ('{"name": "x", "peak_flops": {"bf16": -1}, "memory_bandwidth": 1e9, "memory_bytes": 1}', "positive"),
        ('{"name": "x", "peak_flops": {"bf16": 1e12}, "memory_bandwidth": "fast", "memory_bytes": 1}', "fast"),
        ('{"name": "x", "peak_flops": {"bf16": 1e12}, "memory_bandwidth": 1e9, "memory_bytes": 1, "color": 1}',
         "color"),
    ],
)
def test_bad_spec_files_are_named_clearly(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TuiliError, match=message):
        load_spec_file(path)


def test_never_probed_machine_gets_a_marked_estimate_then_its_probe():
    estimate = current_hardware("cpu")
    assert estimate.origin == "estimate" and estimate.estimated
    assert estimate.memory_bandwidth > 0 and estimate.flops("fp32") > 0
    probed = HardwareSpec(name="this box (probed)", peak_flops={"fp32": 1e11}, memory_bandwidth=2e10,
                          memory_bytes=2**34, origin="probe")
    path = save_probe(probed, "cpu")
    assert path == probe_path("cpu") and path.is_file()
    assert current_hardware("cpu") == probed


def test_probe_quick_measures_saves_and_is_used():
    # In a process of its own, without the suite's OMP_WAIT_POLICY=PASSIVE (tests/conftest.py,
    # read once when OpenMP loads): the host overheads are a user's process's. With sleeping
    # threads each parallel region's wake-up took 0.3-1 ms on machine A, the toy steps 1.5-5 ms,
    # and the layer's ~30 us slope came out 0 in half the runs.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", "from tuili.cli import main; raise SystemExit(main())",
                           "probe", "--device", "cpu", "--quick"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "memory read" in out and "matmul fp32 large" in out and "skinny" in out
    spec = current_hardware("cpu")
    assert spec.origin == "probe"
    assert spec.memory_bandwidth > 1e8  # any machine reads more than 100 MB/s
    assert spec.flops("fp32") > 1e8
    assert any("skinny" in name for name in spec.measurements)
    # --quick: the engine's host cost per step and per float layer, measured on toy models
    assert {"decode_step", "decode_layer", "prefill_step", "prefill_layer"} <= set(spec.host_overhead_seconds)
    assert all(0 <= s < 1 for s in spec.host_overhead_seconds.values()) and spec.host_overhead_seconds["decode_layer"]
    assert "host overhead decode_layer" in out
    # this CPU runs packed linears: each format its modules hold here is timed (int4 with scales
    # alone where tuili's kernels read them, 6-bit codes where they read those); many rows either
    # go through their kernel too or are dequantized, as the engine's module chooses here: exactly
    # that one is measured
    here = Platform.detect("cpu")
    formats = {"int4+zeros", "int8"} | ({"int4"} if here.native_kernels else set())
    formats |= {"int6", "int6+zeros"} if here.native_kernels and kernels.linear_int6_available() else set()
    assert set(spec.packed_kernel_seconds_per_value) == formats == set(spec.packed_call_seconds_by_rows)
    assert all(f"packed {fmt} call 1 seconds per value" in out for fmt in formats)
    module = make_linear(quantize_int4(torch.randn(64, 64), 32), platform=here)
    kernel_rows = module.kernel_for(PACKED_OP_MAX_ROWS + 1, torch.device("cpu")) == "gemv"
    many, dequantized = spec.packed_rows_seconds_per_value, spec.packed_dequant_seconds_per_value
    assert all((fmt in many) != (fmt in dequantized) for fmt in formats) and set(many) | set(dequantized) == formats
    assert ("int4+zeros" in many) == kernel_rows
    # each call curve: the rows the kernel takes, up to its blocks where many rows run it; one row's
    # point is the one-row figure, and the most rows' the many-row figure per row
    for fmt, curve in spec.packed_call_seconds_by_rows.items():
        taken = [rows for rows in PACKED_CALL_ROWS if rows <= PACKED_OP_MAX_ROWS or fmt in many]
        assert sorted(curve) == taken, (fmt, curve)
        assert curve[1] == spec.packed_kernel_seconds_per_value[fmt]
        if fmt in many:
            assert many[fmt] == pytest.approx(curve[max(curve)] / max(curve))
    # the engine's causal prompt attention, per prompt length, in the dtype --quick measures
    assert set(spec.attention_flops_by_tokens["fp32"]) == set(ENGINE_ATTENTION_TOKENS)
    assert "engine attention fp32 1024 tokens" in out
    # the decode attention's cache reads, where the native kernel reads the cache in place
    if here.native_kernels:
        assert spec.decode_attention_bandwidth["fp32"] > 0 and "engine decode attention fp32 1024 keys read" in out
    else:
        assert spec.decode_attention_bandwidth == {}
    # the DeltaNet prompt kernel, where the native kernels run
    assert spec.deltanet_prefill_flops["fp32"] > 0 and "engine deltanet fp32 256 tokens" in out
    # a layer's elementwise work, per kind, in the dtype --quick measures
    assert set(spec.elementwise_seconds_per_value["fp32"]) == set(ELEMENTWISE_KINDS)
    assert all(0 < s < 1e-6 for s in spec.elementwise_seconds_per_value["fp32"].values())
    assert "engine elementwise fp32 silu seconds per value" in out


def test_probe_of_a_missing_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the error is for machines without one")
    assert main(["probe", "--device", "cuda", "--quick", "--no-save"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_decode_matmul_overhead_and_rate_fit_the_probe_points():
    from tuili.perf.probe import fit_gemv

    small, large = 512 * 512 * 4, 2048 * 2048 * 4  # fp32 weight bytes
    overhead, rate = 50e-6, 6.5e9
    measured = {"matmul fp32 skinny 1x512x512 seconds per matmul": overhead + small / rate,
                "matmul fp32 skinny 1x2048x2048 seconds per matmul": overhead + large / rate}
    assert fit_gemv(measured, "fp32") == pytest.approx((overhead, rate))
    assert fit_gemv(measured, "bf16") is None


def test_refreshing_rates_times_only_the_peaks_a_prediction_can_use():
    """`plan --measure` refreshes memory and the fp32 peak (and any dtype at least as fast); a
    dtype whose saved peak is below fp32's is never used (dtype_used takes fp32 instead) and
    keeps its saved peak untimed: bf16 on CPUs without bf16 arithmetic, ~10 s a matmul."""
    from tuili.perf.probe import refresh_rates

    saved = HardwareSpec(name="saved", peak_flops={"fp32": 1e9, "bf16": 1e6}, memory_bandwidth=1e6,
                         memory_bytes=2**33, origin="probe", packed_kernel_seconds_per_value={"int8": 1e-5, "int4": 2e-5})
    fresh = refresh_rates(saved, "cpu", packed_formats={"int8"})
    assert fresh.peak_flops["bf16"] == 1e6 and fresh.dtype_used("bf16") == "fp32"
    assert fresh.peak_flops["fp32"] > 1e9 and fresh.memory_bandwidth > 1e8  # measured, not the saved ones
    if kernels.available():  # the packed kernels' rates are taken again too (they need a peak for bf16)...
        assert 0 < fresh.packed_kernel_seconds_per_value["int8"] < 1e-7 and 1 in fresh.packed_call_seconds_by_rows["int8"]
    # ... in the formats asked for (a model's): the others keep their saved figures
    assert fresh.packed_kernel_seconds_per_value["int4"] == 2e-5 and "int4" not in fresh.packed_call_seconds_by_rows


def test_gauge_reads_memory_beyond_the_caches_and_the_matmul_peak():
    from tuili.perf.probe import Gauge, _last_level_cache_bytes

    gauge = Gauge("cpu", budget_s=0.02)
    # bf16 where the CPU multiplies it in hardware; fp32 on AVX2 CPUs (bf16 there: ~1% of fp32)
    if Platform.detect("cpu").bf16_arithmetic:
        assert gauge.dtype == "bf16"
    elif torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        assert gauge.dtype == "fp32"
    # the probe's buffer: at least twice the last-level cache, so DRAM is what it reads
    assert gauge.buffer.numel() * 4 >= min(2 * _last_level_cache_bytes(), 256 << 20)
    first, second = gauge(), gauge()
    for reading in (first, second):
        assert 1e8 < reading.read_bandwidth < 1e13  # 100 MB/s .. 10 TB/s
        assert 1e8 < reading.matmul_flops < 1e16

    if not torch.cuda.is_available():
        with pytest.raises(TuiliError, match="no CUDA GPU"):
            Gauge("cuda")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probed_prompt_attention_runs_the_path_a_prefill_takes(monkeypatch, native, dtype):
    """The engine's default mode gives each prompt token the bits of a decode of it over the same
    keys (batch invariance), so a prefill's attention is the decodes' paged kernel: the probe must
    time that, not the causal kernel the mode bypasses (on AMX 3-8x faster, other bits)."""
    from tuili.layers.attention import KVCache, PagedBatch, attention_backend
    from tuili.perf.probe import _prompt_attention

    if not native:
        monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    backend = attention_backend(Platform.detect("cpu"), dtype)
    assert backend.reads_paged_prompts
    tokens, (heads, kv_heads, head_dim) = 40, (4, 2, 64)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    prompt = _prompt_attention(backend, q, k, v)()
    cache = KVCache.allocate((3, 16, kv_heads, head_dim), dtype, torch.device("cpu"))
    backend.store(cache, k, v, torch.arange(tokens))
    tables = torch.arange(3, dtype=torch.int32)[None]
    for position in (0, 17, tokens - 1):
        paged = PagedBatch(tables, torch.tensor([[0, 1, position]], dtype=torch.int32))
        decode = backend.attend_paged(q[position : position + 1], cache, paged, head_dim**-0.5, torch.empty_like(q[:1]))
        assert torch.equal(prompt[position], decode[0]), position
