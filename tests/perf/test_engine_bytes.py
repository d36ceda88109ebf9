"""One decode step of the engine on CPU: the bytes the cost model says it reads are the engine's
own weight tensors plus the KV blocks the sequence holds."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tuili import LLM
from tuili.engine.pool import kv_bytes_per_block
from tuili.perf.cost import ModelCost
from tuili.perf.hardware import HardwareSpec
from tuili.perf.meter import UtilizationMeter
from tuili.sampling import SamplingParams

BLOCK = 16


def checkpoint(path, tied: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
    )
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def engine_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the engine's parameter tensors, a shared (tied) one counted once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


class _Recorder:
    """An engine observer appending each StepRecord to `steps`."""

    wants_device_time = False

    def __init__(self, steps: list) -> None:
        self.steps = steps

    def on_step(self, record) -> None:
        self.steps.append(record)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_decode_step_bytes_are_engine_weights_plus_kv_blocks(tmp_path, tied):
    path = checkpoint(tmp_path / "model", tied)
    engine = LLM(model=str(path), device="cpu", dtype="float32", block_size=BLOCK, max_model_len=128,
                 kv_cache_memory=1 << 20).engine
    steps = []
    engine.add_observer(_Recorder(steps))
    prompt_len = 2 * BLOCK - 1  # the decoded token fills the second block exactly
    engine.add_request({"prompt_token_ids": list(range(1, prompt_len + 1))},
                       SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    engine.step()  # the prefill
    engine.step()  # one decode step
    decode = steps[-1]
    assert (decode.prefill_chunks, decode.decode_context_lens) == ([], [prompt_len + 1])
    context = prompt_len + 1
    stats = engine.stats()
    blocks = stats.num_blocks - stats.num_free_blocks  # the one sequence's
    assert blocks * BLOCK == context

    model = engine.model
    weights = engine_weight_bytes(model)
    kv_blocks = blocks * kv_bytes_per_block(engine.model_config, BLOCK, engine.dtype)
    # an untied input embedding is read only for the one row looked up
    embedding = model.model.embed_tokens.weight
    skipped = 0 if tied else embedding.nbytes - embedding[0].nbytes

    cost = ModelCost.from_config(json.loads((path / "config.json").read_text()))
    assert cost.decode_step_bytes("fp32", [context], kv_dtype="fp32") == weights - skipped + kv_blocks

    card = HardwareSpec(name="cpu", peak_flops={"fp32": 1e11}, memory_bandwidth=1e10, memory_bytes=2**33)
    meter = UtilizationMeter(cost, card, weights, kv_bytes_per_block(engine.model_config, 1, engine.dtype),
                             compute_dtype="fp32")
    assert meter.step_decode_bytes([context]) == weights - skipped + kv_blocks


def test_moe_engine_holds_and_reads_what_the_cost_model_counts(tmp_path):
    """A Qwen3-MoE checkpoint as transformers writes it (num_local_experts; layer 1 dense by
    mlp_only_layers): the engine's parameters and bytes per kind (experts and router apart from the
    dense MLP) are the cost model's, and one sequence's decode step reads k of the E experts."""
    from tuili.layers.moe import SparseMoE
    from tuili.perf.measure import engine_storage

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )
    path = tmp_path / "moe"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    engine = LLM(model=str(path), device="cpu", dtype="float32", block_size=BLOCK, max_model_len=128,
                 kv_cache_memory=1 << 20).engine
    model = engine.model
    assert sum(isinstance(m, SparseMoE) for m in model.modules()) == 2
    cost = ModelCost.from_config(json.loads((path / "config.json").read_text()))

    assert sum(p.numel() for p in model.parameters()) == cost.params_total
    by_kind = {kind: n for kind, n in cost.weight_bytes_by_kind("fp32").items() if n}
    assert engine_storage(model).bytes_by_kind == by_kind
    assert by_kind["experts"] == 2 * 8 * 3 * 64 * 32 * 4 and by_kind["router"] == 2 * 8 * 64 * 4
    assert engine.weight_bytes() == engine_weight_bytes(model) == cost.weight_bytes("fp32")

    # One sequence's decode step: 2 of the 8 experts in each sparse layer; the untied input
    # embedding is left out by the engine, one row of it counted by the cost model.
    experts_unread = by_kind["experts"] * (8 - 2) // 8
    assert engine.decode_weight_bytes() == engine.weight_bytes() - experts_unread - by_kind["embedding"]
    assert cost.decode_weight_bytes("fp32", 1) == engine.decode_weight_bytes() + 64 * 4


def test_plan_measure_runs_the_engine_and_compares(tmp_path, capsys, monkeypatch):
    from tuili.cli import main

    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    path = checkpoint(tmp_path / "model", tied=True)
    spec = tmp_path / "cpu.json"
    host = {"decode_step": 3e-4, "decode_layer": 2e-4, "prefill_step": 5e-4, "prefill_layer": 4e-4}
    spec.write_text(json.dumps({"name": "cpu", "peak_flops": {"fp32": 5e10}, "memory_bandwidth": 5e9,
                                "memory_bytes": 2**33, "host_overhead_seconds": host}))
    assert main(["plan", "--model", str(path), "--hardware", str(spec), "--device", "cpu", "--measure",
                 "--prompt", "24", "--output", "6", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["comparisons"]}
    assert {"TTFT", "TTFT, roofline alone", "prefill MFU", "decode step", "decode step, roofline alone",
            "decode MBU"} <= set(rows)
    assert report["decode_steps"] == 5  # output tokens after the first, both sequences in each step
    for row in rows.values():
        assert row["predicted"] > 0 and row["measured"] > 0
        assert row["error"] == pytest.approx((row["measured"] - row["predicted"]) / row["predicted"])
    # the prediction is the roofline plus the host cost of a step and of each of the 2 layers
    assert rows["decode step"]["predicted"] == pytest.approx(rows["decode step, roofline alone"]["predicted"]
                                                             + 3e-4 + 2 * 2e-4)
    assert rows["TTFT"]["predicted"] == pytest.approx(rows["TTFT, roofline alone"]["predicted"] + 5e-4 + 2 * 4e-4)
    assert any("host overhead" in note for note in report["notes"])


def test_plan_measure_takes_this_machines_rates_again_around_the_runs(tmp_path, capsys, monkeypatch):
    """Against this machine's saved probe, --measure measures the drifting rates before and after
    the runs and predicts with their mean; the probe's host overheads are kept."""
    from tuili.cli import main
    from tuili.perf.hardware import save_probe

    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    path = checkpoint(tmp_path / "model", tied=True)
    host = {"decode_step": 3e-4, "decode_layer": 2e-4, "prefill_step": 5e-4, "prefill_layer": 4e-4}
    # rates far from any real machine's: the refreshed ones must replace them (bf16's, below
    # fp32's, is never used and stays unmeasured: tests/perf/test_hardware.py)
    save_probe(HardwareSpec(name="this cpu (probed)", peak_flops={"fp32": 1e9, "bf16": 1e8}, memory_bandwidth=1e6,
                            memory_bytes=2**33, origin="probe", host_overhead_seconds=host), "cpu")
    assert main(["plan", "--model", str(path), "--device", "cpu", "--measure", "--dtype", "float32",
                 "--prompt", "24", "--output", "4", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["comparisons"]}
    drift = next(note for note in report["notes"] if note.startswith("rates measured again"))
    assert "memory read 0.0 GB/s at the probe" in drift
    # at a real machine's bandwidth the tiny model's roofline is microseconds, not the ~seconds of
    # 1 MB/s; the host overheads are still added
    roofline = rows["decode step, roofline alone"]["predicted"]
    assert 0 < roofline < 1e-2
    assert rows["decode step"]["predicted"] == pytest.approx(roofline + 3e-4 + 2 * 2e-4)


def test_a_packed_copy_of_the_output_matrix_stands_for_it():
    # The embedded GGUF runs packed, and its tied embedding (Q8_0 in the file) is held once, as
    # the file's codes: the logits and the token lookup both read the packed copy, no float table
    # is held beside it, and the bytes the planner and the runner count for it are the copy's.
    from tuili.layers.quant import PackedEmbedding
    from tuili.perf.measure import engine_storage, head_format, packed_formats

    llm = LLM(max_model_len=64, kv_cache_memory=16 << 20)
    engine = llm.engine
    model = engine.model
    copy = model.lm_head.decode_copy
    assert copy is not None and model.config.tie_word_embeddings and model.lm_head.projection is None
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert engine_storage(model).bytes_by_kind["embedding"] == copy.weight_bytes
    table = model.config.vocab_size * model.config.hidden_size
    held = [*model.parameters(), *model.buffers()]
    assert not [t for t in held if t.is_floating_point() and t.numel() >= table]  # no float table
    # A decode step reads every byte held: the layers, the norms, the copy (the lookup a few rows).
    assert engine.decode_weight_bytes() == engine.weight_bytes()
    # the plan charges the logits at the copy's kernel: the file's Q8_0 codes, and the layers' Q4_1
    assert head_format(model) == "int8" and packed_formats(model) == {"int4+zeros": 1.0}
    assert head_format(torch.nn.Module()) == ""


def test_a_float_gguf_with_a_packed_output_copy_is_planned_with_float_layers(tmp_path, capsys, monkeypatch):
    """A GGUF file of F16 weights runs its layers as float linears; only its logits read a packed
    int8 copy of the output matrix (whose bytes stand for that matrix). `plan --measure` plans the
    layers as float: a packed kernel's rate (here absurdly slow) is not charged to them, only to
    the logits that read the copy."""
    from tests.models.test_gguf import hf_checkpoint, write_gguf
    from tuili.cli import main
    from tuili.layers.quant import QuantizedLinear

    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    config, state = hf_checkpoint("llama")
    path = write_gguf(tmp_path / "f16.gguf", "llama", config, state)
    model = LLM(model=str(path), dtype="bfloat16", kv_cache_memory=1 << 20).engine.model
    assert isinstance(model.lm_head.decode_copy, QuantizedLinear)
    assert not [name for name, m in model.model.named_modules() if isinstance(m, QuantizedLinear)]
    spec = tmp_path / "cpu.json"
    spec.write_text(json.dumps({"name": "cpu", "peak_flops": {"bf16": 1e11, "fp32": 1e11}, "memory_bandwidth": 1e10,
                                "memory_bytes": 2**33, "packed_kernel_seconds_per_value": {"int4": 1e-6, "int8": 1e-6}}))  # fmt: skip
    assert main(["plan", "--model", str(path), "--hardware", str(spec), "--device", "cpu", "--dtype", "bfloat16",
                 "--measure", "--prompt", "12", "--output", "4", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["comparisons"]}
    # the layers' ~100k values at 1 µs each would be 0.1 s a step, their bytes at 10 GB/s are µs;
    # the logits read the int8 copy, whose 96 x 64 values take the kernel's time
    head = config.vocab_size * config.hidden_size * 1e-6
    assert head <= rows["decode step"]["predicted"] < head + 1e-3
    assert not any("packed linears" in note or "quantized" in note for note in report["notes"])


def test_plan_measure_reads_the_packed_formats_and_their_shares_off_the_model():
    """The planner charges each packed format at its own rate by its share of the layers' packed
    values: a model holding a Q4_0-like linear (scales alone where tuili's kernels read them), an
    int4 one with zeros and an int8 one (Q8_0), stacked or not, is read as those shares; the
    output head, which the plan counts apart, is not."""
    from torch import nn

    from tuili.layers.quant import Int4Weight, Int8GroupWeight, StackedLinear, make_linear, quantize_int4
    from tuili.perf.measure import packed_formats
    from tuili.platform import Platform

    here = Platform.detect()
    torch.manual_seed(0)
    scales_alone = Int4Weight(torch.randint(0, 16, (128, 64), dtype=torch.uint8), torch.rand(128, 2), torch.zeros(128, 2), 32)
    with_zeros = quantize_int4(torch.randn(64, 64), 32)
    int8 = Int8GroupWeight(torch.randint(-128, 128, (192, 64), dtype=torch.int16).to(torch.int8), torch.rand(192, 2), 32)
    model = nn.Module()
    model.model = nn.Module()
    model.model.qkv = StackedLinear([make_linear(w, platform=here) for w in (scales_alone, with_zeros)], None,
                                    platform=here)
    model.model.down = make_linear(int8, platform=here)
    model.lm_head = nn.Module()
    model.lm_head.decode_copy = make_linear(quantize_int4(torch.randn(640, 64), 32), platform=here)
    first = "int4" if here.native_kernels else "int4+zeros"  # PyTorch's op reads (scale, zero) pairs
    expected = {"int4+zeros": 64 / 384, "int8": 192 / 384}
    expected[first] = expected.get(first, 0) + 128 / 384
    assert packed_formats(model) == pytest.approx(expected)
    assert packed_formats(nn.Linear(4, 4)) == {}
