"""Pure decode steps replayed from CPU graphs (tuili/engine/decode_graphs.py) give exactly what
the same engine gives eagerly (enforce_eager): the same tokens and the same logprobs, bit for
bit, as batches shrink and grow; steps a graph cannot replay run eagerly, with the reason kept.
The transformers reference for the graph path is tests/models/test_llama_vs_transformers.py."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams, kernels
from tuili.layers.quant import quantize_int8
from tuili.models import weights

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU graphs replay the native kernels")


def generate(path, prompts, params, **options):
    llm = LLM(model=str(path), device="cpu", block_size=4, kv_cache_memory=1 << 22, max_model_len=128, **options)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


PROMPTS = [[5, 17, 250, 3, 99], [42], list(range(30, 53)), [7, 7, 7, 200, 201]]


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_graph_steps_equal_eager_steps(tiny_qwen3_bf16, quantization):
    # Different lengths: the decode batch shrinks from 4 to 1 as requests finish, and sampled
    # with a seed so that logits, not only their argmax, must agree. int4 and int8: every linear,
    # the tied output matrix's int8 copy included, runs the native kernel (int8 per group).
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + 5 * i, logprobs=3) for i in range(4)]
    options = dict(dtype="bfloat16", quantization=quantization)
    llm, replayed = generate(tiny_qwen3_bf16, PROMPTS, params, **options)
    _, eager = generate(tiny_qwen3_bf16, PROMPTS, params, enforce_eager=True, **options)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    assert graphs.captured_batch_sizes() == [1, 2, 3, 4] and not graphs.refused
    assert llm.engine.runner.graph_captures() == 4  # one per shape: the steps after it replay


def test_a_draft_catching_up_on_two_tokens_replays_one_graph(tiny_qwen3_bf16):
    """A draft model whose proposals were all kept computes the last proposal and the bonus
    token as one two-row chunk: its step replays a graph that returns every row's logits, of which
    the runner keeps the chunk's last. The proposals, and so the counts of kept ones, equal the
    eager run's; the text equals the one without speculation. (The target's int8 copy named by
    its path: a "self" draft would adopt the target's KV for the kept proposal instead.)"""
    spec = {"model": str(tiny_qwen3_bf16), "quantization": "int8", "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for name, options in [("plain", {}), ("graphs", {"speculative_config": spec}),
                          ("eager", {"speculative_config": spec, "enforce_eager": True})]:
        llm, out = generate(tiny_qwen3_bf16, PROMPTS[:1], params, dtype="bfloat16", **options)
        stats = llm.engine.stats().spec
        runs[name] = (out, stats and (stats.num_proposed_tokens, stats.num_accepted_tokens))
        if name == "graphs":
            draft_graphs = llm.engine.speculator.proposer.runner.graphs
            assert (2,) in draft_graphs.captured_row_shapes() and not draft_graphs.refused
    assert runs["graphs"] == runs["eager"]
    assert runs["graphs"][0] == runs["plain"][0]
    assert runs["graphs"][1][1] > 6  # several rounds kept all three proposals


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    """A Qwen3.5 hybrid (three Gated DeltaNet layers, then gated full attention), bfloat16."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=32, max_position_embeddings=256, initializer_range=0.1,
        tie_word_embeddings=True,
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForCausalLM"]
    path = tmp_path_factory.mktemp("qwen35") / "bf16"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("quantization", [None, "int4", "int4-row-head"])
def test_hybrid_graph_steps_equal_eager_steps(tiny_qwen35, quantization, monkeypatch, caplog):
    """The DeltaNet layers' states step on in their slots inside the replay. "int4-row-head": the
    tied output matrix's int8 copy is quantized per row (as where its input size takes no group
    of 32), which torch's op runs, so the first capture (with the logits) is refused after every
    layer has stepped the states: they must be put back, or the tokens drift from the eager run's."""
    if quantization == "int4-row-head":
        monkeypatch.setattr(weights, "quantize_int8_for_kernels", quantize_int8)
        quantization = "int4"
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + 5 * i, logprobs=3) for i in range(4)]
    options = dict(dtype="bfloat16", quantization=quantization)
    with caplog.at_level(logging.INFO, logger="tuili.engine.decode_graphs"):
        llm, replayed = generate(tiny_qwen35, PROMPTS, params, **options)
    _, eager = generate(tiny_qwen35, PROMPTS, params, enforce_eager=True, **options)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    assert graphs.captured_batch_sizes() == [1, 2, 3, 4] and not graphs.refused
    logits_eager = any("the logits of decode steps" in r.getMessage() for r in caplog.records)
    assert logits_eager == (weights.quantize_int8_for_kernels is quantize_int8)
    slots = llm.engine.scheduler.state_slots
    assert slots.num_free == slots.num_slots


def test_a_batch_the_native_kernels_do_not_cover_runs_eagerly_and_says_why(tiny_llama):
    # Kernels picked by row count: float32 linears of more than 8 rows run torch's F.linear,
    # which a replay would skip. (The batch-invariant mode, the default, runs linear_small in
    # blocks of 8 rows instead: all native, captured.)
    prompts = [[i + 1, i + 2] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm, replayed = generate(tiny_llama, prompts, params, dtype="float32", batch_invariant=False)
    _, eager = generate(tiny_llama, prompts, params, dtype="float32", enforce_eager=True, batch_invariant=False)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    assert "aten.linear" in graphs.refused[10]
    assert graphs.captured_batch_sizes() == []
    assert graphs.captures == 1  # a refused capture is tried once: the later steps of 10 run eagerly
    small, _ = generate(tiny_llama, prompts[:3], params, dtype="float32", batch_invariant=False)  # native only
    assert small.engine.runner.graphs.captured_batch_sizes() == [3]
    invariant, _ = generate(tiny_llama, prompts, params, dtype="float32")
    assert invariant.engine.runner.graphs.captured_batch_sizes() == [10]


def test_graphs_are_off_where_a_step_is_not_all_native_kernels(tiny_llama, monkeypatch):
    fp8, _ = generate(tiny_llama, PROMPTS, SamplingParams(max_tokens=2), dtype="float32", kv_cache_dtype="fp8")
    assert fp8.engine.runner.graphs is None  # the fp8 cache is written by torch ops
    eager, _ = generate(tiny_llama, PROMPTS, SamplingParams(max_tokens=2), dtype="float32", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    portable, _ = generate(tiny_llama, PROMPTS, SamplingParams(max_tokens=2), dtype="float32")
    assert portable.engine.runner.graphs is None


def test_an_eager_shape_is_logged_once_at_info(tiny_llama, caplog):
    """Issue 20.10: the reason a shape runs eagerly is said once per batch size, at debug after."""
    # Kernels picked by row count: 10 float32 rows run F.linear, which no graph replays.
    llm = LLM(model=str(tiny_llama), device="cpu", block_size=4, kv_cache_memory=1 << 22, max_model_len=128,
              dtype="float32", batch_invariant=False)
    prompts = [{"prompt_token_ids": [i + 1, i + 2]} for i in range(10)]
    with caplog.at_level(logging.DEBUG, logger="tuili.engine.decode_graphs"):
        for _ in range(3):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        graphs = llm.engine.runner.graphs
        for _ in range(3):  # as if the shape came back under a new key (another thread count)
            graphs.refused.clear()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    said = [r for r in caplog.records if "decode steps of 10 sequences run eagerly" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] + [logging.DEBUG] * (len(said) - 1)
    assert len(said) == 4
