"""benchmarks/cpu.py's comparison rules: which repetitions count as steady, and the ratios and
utilizations taken over them. Synthetic samples; the engines themselves are not run here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tuili.perf.probe import Reading

ROOT = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def cpu():
    sys.path.insert(0, str(ROOT))
    try:
        spec = importlib.util.spec_from_file_location("bench_cpu", ROOT / "cpu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_cpu", None)
        sys.path.remove(str(ROOT))


FAST, SLOW = Reading(30e9, 2.2e12), Reading(30e9, 0.8e12)


def column(cpu, label, engine, rates_and_states):
    c = cpu.Column(engine, label, "16-bit")
    c.samples["prefill 512"] = [cpu.Sample(rate, before, after) for rate, before, after in rates_and_states]
    c.rates["prefill 512"] = max(rate for rate, _, _ in rates_and_states)
    return c


def test_steady_needs_every_reading_within_the_tolerance(cpu):
    assert cpu.steady(cpu.Sample(1.0, FAST, FAST), cpu.Sample(1.0, FAST, Reading(30e9, 1.7e12)))
    assert not cpu.steady(cpu.Sample(1.0, FAST, FAST), cpu.Sample(1.0, FAST, SLOW))
    assert not cpu.steady(cpu.Sample(1.0, FAST, Reading(20e9, 2.2e12)))  # bandwidth moved by a half


def test_ratio_compares_only_repetitions_in_one_state(cpu):
    # Repetition 0: tuili caught a slow state, vLLM a fast one; the best samples alone would say
    # tuili trails 2.2x. Repetitions 1 and 2 ran in one state each and say 1.1x.
    mine = column(cpu, "tuili bf16", "tuili", [(500, SLOW, SLOW), (550, SLOW, SLOW), (1320, FAST, FAST)])
    peer = column(cpu, "vllm bf16", "vllm", [(1300, FAST, FAST), (500, SLOW, SLOW), (1200, FAST, FAST)])
    r = cpu.ratio(mine, peer, "prefill 512")
    assert r.steady == 2 and r.value == pytest.approx((1.1 + 1.1) / 2)
    assert r.best == pytest.approx(1320 / 1300)
    # the peer tuili leads least is the one a target is judged against
    slower = column(cpu, "llama bf16", "llama", [(400, SLOW, SLOW), (400, SLOW, SLOW), (900, FAST, FAST)])
    assert cpu.worst_ratio([mine, peer, slower], mine, "prefill 512").peer is peer


def test_ratio_without_a_steady_repetition_takes_them_all(cpu):
    mine = column(cpu, "tuili bf16", "tuili", [(500, SLOW, FAST), (1000, FAST, SLOW)])
    peer = column(cpu, "vllm bf16", "vllm", [(1000, FAST, FAST), (500, SLOW, SLOW)])
    r = cpu.ratio(mine, peer, "prefill 512")
    assert r.steady == 0 and r.value == pytest.approx((0.5 + 2.0) / 2)


def test_mfu_judges_each_steady_sample_against_its_own_readings(cpu):
    sizes = cpu.Sizes(512, 128, 64, 1, 3)
    mine = column(cpu, "tuili bf16", "tuili", [(550, SLOW, SLOW), (1300, FAST, FAST), (2000, SLOW, FAST)])
    flops = 1.1e12 * 512 / 1300  # so that 1300 tokens/s is 1.1 TFLOP/s
    mine.facts = {"decode_weight_bytes": 1.0, "kv_bytes_per_token": 0.0, "state_bytes_per_seq": 0, "prefill_flops": flops}
    roof = cpu.roofline(mine, sizes, None)
    per_token = flops / 512
    expected = sorted([550 * per_token / SLOW.matmul_flops, 1300 * per_token / FAST.matmul_flops])
    assert roof["mfu"] == pytest.approx(sum(expected) / 2)  # the unsteady third sample is left out
    assert roof["mbu"] is None  # no decode row sampled


def test_mbu_counts_a_hybrids_state_read_and_written_each_step(cpu):
    sizes = cpu.Sizes(512, 128, 64, 1, 1)
    mine = cpu.Column("tuili", "tuili bf16", "16-bit")
    mine.samples["decode b1"] = [cpu.Sample(20.0, FAST, FAST)]
    mine.rates["decode b1"] = 20.0
    weights, kv_per_token, state = 1.5e9, 8192, 19.5e6
    mine.facts = {"decode_weight_bytes": weights, "kv_bytes_per_token": kv_per_token, "state_bytes_per_seq": state,
                  "prefill_flops": 1.0}
    context = 128 + (64 + 1) / 2  # the mean context of the 64 timed steps after a 128-token prompt
    step = weights + kv_per_token * context + 2 * state
    assert cpu.roofline(mine, sizes, None)["mbu"] == pytest.approx(step * 20.0 / FAST.read_bandwidth)


def test_a_target_against_transformers_is_judged_against_the_transformers_column(cpu):
    # llama.cpp is the closer peer, but a target naming transformers ignores it
    mine = column(cpu, "tuili bf16", "tuili", [(900, FAST, FAST)])
    hf = column(cpu, "transformers bf16", "transformers", [(250, FAST, FAST)])
    llama = column(cpu, "llama bf16", "llama", [(800, FAST, FAST)])
    columns = [mine, hf, llama]
    assert cpu.worst_ratio(columns, mine, "prefill 512").peer is llama
    r = cpu.worst_ratio(columns, mine, "prefill 512", "transformers")
    assert r.peer is hf and r.value == pytest.approx(900 / 250)
    targets = {(t.row, t.peer, t.factor) for t in cpu.hybrid_targets(cpu.Sizes(512, 128, 64, 1, 1))
               if t.label == "tuili bf16"}
    assert ("prefill 512", "transformers", 3.0) in targets and ("decode b16", "llama", 1.5) in targets


def test_rows_pick_the_batches_run_including_ones_not_run_by_default(cpu):
    sizes = cpu.Sizes(512, 128, 64, 4, 8)
    assert sizes.only(None).rows() == ["prefill 512", "decode b1", "decode b16", "decode b32"]
    assert sizes.only(["b8", "b4"]).rows() == ["decode b4", "decode b8"]
    assert sizes.only(["prefill", "b16"]).rows() == ["prefill 512", "decode b16"]
