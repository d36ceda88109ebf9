"""`tuili plan --measure --tp N --pp M`: the engine runs with its worker ranks on this machine and
rank 0's measured communication is set against the ruler's (Roofline.comm, the stage transfers).

The predictions are recomputed here from the cost model and the link, so a change in how
measure.py chooses the link, the batch or the formula shows; the measured side comes from the
engine's own clock on real worker processes (float32, a tiny random Qwen3 written by
save_pretrained).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tuili.cli import main
from tuili.parallel.pipeline_runner import MIN_MICRO_BATCH_TOKENS
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import HardwareSpec, link
from tuili.perf.measure import shared_by
from tuili.perf.plan import PIPELINE_MICRO_BATCH_TOKENS, PlanInputs, Roofline

QWEN3 = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
SPEC = {"name": "cpu", "peak_flops": {"fp32": 5e10}, "memory_bandwidth": 5e9, "memory_bytes": 2**33}
SHAPE = ["--prompt", "24", "--output", "6", "--batch", "2"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3") / "model"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3)).float().save_pretrained(path)
    return str(path)


@pytest.fixture
def spec_file(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def measure(capsys, model: str, spec: str, *extra: str) -> dict:
    code = main(["plan", "--model", model, "--hardware", spec, "--device", "cpu", "--dtype", "float32", "--measure",
                 *SHAPE, "--json", *extra])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def roofline(model_config: dict, **parallel) -> Roofline:
    inputs = PlanInputs(weights=weight_format("fp32"), kv_dtype="fp32", conv_state_dtype="fp32", compute_dtype="fp32",
                        prompt=24, output=6, batch=2, gpus=parallel["tp"] * parallel["pp"], **parallel)  # fmt: skip
    return Roofline(ModelCost.from_config(model_config), HardwareSpec(**SPEC), inputs)


def test_measure_tp2_compares_rank0s_communication_with_the_rulers(capsys, qwen3, spec_file):
    """Two ranks over the default cpu-shm link: each pure decode step's communication (measured
    around the step) against Roofline.comm at the run's batch, and the lone prompt's against the
    prefill's all-reduces plus its one sampled row's gather."""
    report = measure(capsys, qwen3, spec_file, "--tp", "2")
    rows = {row["name"]: row for row in report["comparisons"]}
    assert report["tp"] == 2 and report["pp"] == 1 and report["link"] == "cpu-shm"
    roof = roofline(transformers.Qwen3Config(**QWEN3).to_dict(), tp=2, pp=1, link=link("cpu-shm"))
    decode, prefill = rows["communication per decode step"], rows["communication in the prefill"]
    assert decode["predicted"] == pytest.approx(roof.comm(2), rel=1e-12)
    assert prefill["predicted"] == pytest.approx(roof.prefill_comm(24) + roof.gather(1), rel=1e-12)
    assert decode["measured"] > 0 and prefill["measured"] > 0
    # the single-device comparisons are still made, every one with both sides
    assert {"TTFT", "prefill MFU", "decode step", "decode MBU"} <= set(rows)
    for row in rows.values():
        assert row["predicted"] > 0 and row["measured"] > 0
    assert report["decode_steps"] == 5
    assert any("2 ranks (--tp 2 --pp 1) share this machine" in note for note in report["notes"])


def test_measure_pp2_compares_the_stage_transfers_over_the_link_given(capsys, qwen3, spec_file):
    """Two stages, --link named: rank 0's sends and receives per decode step against the stage
    transfers of the run's batch over that link (one micro-batch: 2 messages)."""
    report = measure(capsys, qwen3, spec_file, "--pp", "2", "--link", "100gbe")
    rows = {row["name"]: row for row in report["comparisons"]}
    assert report["link"] == "100gbe"
    roof = roofline(transformers.Qwen3Config(**QWEN3).to_dict(), tp=1, pp=2, link=link("100gbe"))
    over = link("100gbe")
    assert rows["communication per decode step"]["predicted"] == pytest.approx(
        2 * over.latency + roof.stage_transfer_bytes(2) / over.bandwidth, rel=1e-12)
    assert rows["communication in the prefill"]["predicted"] == pytest.approx(roof.stage_transfer(1, 24), rel=1e-12)
    assert rows["communication per decode step"]["measured"] > 0
    assert any("waits for the later stages" in note for note in report["notes"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "2", "--gpus", "4"], "--measure runs one replica of --tp 2 x --pp 1 = 2 ranks"),
    (["--tp", "2", "--gpus", "3"], "--gpus 3 is not a multiple of --tp 2 x --pp 1"),
    (["--tp", "0"], "--tp 0 is invalid"),
])  # fmt: skip
def test_measure_refuses_a_layout_it_cannot_run(capsys, qwen3, spec_file, argv, message):
    code = main(["plan", "--model", qwen3, "--hardware", spec_file, "--device", "cpu", "--measure", *SHAPE, *argv])
    captured = capsys.readouterr()
    assert code == 2 and not captured.out
    assert message in captured.err and "Traceback" not in captured.err


def test_ranks_sharing_a_machine_split_its_rates():
    """A rank of N on one machine runs at 1/N of every rate; N tensor-parallel ranks, each doing
    1/N of the work at once, then take the one machine's roofline for a step."""
    machine = HardwareSpec(**SPEC, linear_stream_bandwidth={"fp32": 4e9}, linear_flops_by_rows={"fp32": {1: 1e9}},
                           packed_kernel_seconds_per_value={"int8": 1e-9})  # fmt: skip
    rank = shared_by(machine, 2)
    assert rank.peak_flops == {"fp32": 2.5e10} and rank.memory_bandwidth == 2.5e9
    assert rank.linear_stream_bandwidth == {"fp32": 2e9} and rank.linear_flops_by_rows == {"fp32": {1: 5e8}}
    assert rank.packed_kernel_seconds_per_value == {"int8": 2e-9}
    config = transformers.Qwen3Config(**QWEN3).to_dict()
    cost = ModelCost.from_config(config)
    common = dict(weights=weight_format("fp32"), kv_dtype="fp32", compute_dtype="fp32")
    one = Roofline(cost, machine, PlanInputs(**common)).decode_uniform(30, 2)
    split = Roofline(cost, rank, PlanInputs(**common, tp=2, gpus=2, link=link("cpu-shm"))).decode_uniform(30, 2)
    # the weights split exactly in two here (no replicated norms in the matmuls' bytes)
    assert split.roofline == pytest.approx(one.roofline, rel=0.05)


def test_a_decode_step_below_the_micro_batch_floor_is_one_micro_batch():
    """The ruler cuts a pipeline step as the engine does: micro-batches of at least
    MIN_MICRO_BATCH_TOKENS tokens, at most pp of them."""
    assert PIPELINE_MICRO_BATCH_TOKENS == MIN_MICRO_BATCH_TOKENS
    over = link("100gbe")
    roof = roofline(transformers.Qwen3Config(**QWEN3).to_dict(), tp=1, pp=2, link=over)
    assert roof.stage_transfer(16) == pytest.approx(2 * over.latency + roof.stage_transfer_bytes(16) / over.bandwidth)
    many = 2 * MIN_MICRO_BATCH_TOKENS
    assert roof.stage_transfer(1, many) == pytest.approx(4 * over.latency + roof.stage_transfer_bytes(1, many) / over.bandwidth)
