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

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU graphs replay the native kernels")


def generate(path, prompts, params, **options):
    llm = LLM(model=str(path), device="cpu", block_size=4, kv_cache_memory=1 << 22, max_model_len=128, **options)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


PROMPTS = [[5, 17, 250, 3, 99], [42], list(range(30, 53)), [7, 7, 7, 200, 201]]


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_graph_steps_equal_eager_steps(tiny_qwen3_bf16, quantization):
    # Different lengths: the decode batch shrinks from 4 to 1 as requests finish, and sampled
    # with a seed so that logits, not only their argmax, must agree. int4: the tied output
    # matrix is an int8 copy run by torch's op, so the graph stops before the logits; int8: every
    # linear is torch's op, so nothing is replayed.
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + 5 * i, logprobs=3) for i in range(4)]
    options = dict(dtype="bfloat16", quantization=quantization)
    llm, replayed = generate(tiny_qwen3_bf16, PROMPTS, params, **options)
    _, eager = generate(tiny_qwen3_bf16, PROMPTS, params, enforce_eager=True, **options)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    if quantization == "int8":
        assert graphs.captured_batch_sizes() == [] and "aten._weight_int8pack_mm" in graphs.refused[4]
    else:
        assert graphs.captured_batch_sizes() == [1, 2, 3, 4] and not graphs.refused


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


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_hybrid_graph_steps_equal_eager_steps(tiny_qwen35, quantization):
    """The DeltaNet layers' states step on in their slots inside the replay. int4: the tied output
    matrix runs torch's int8 op, so the first capture (with the logits) is refused after every
    layer has stepped the states: they must be put back, or the tokens drift from the eager run's."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + 5 * i, logprobs=3) for i in range(4)]
    options = dict(dtype="bfloat16", quantization=quantization)
    llm, replayed = generate(tiny_qwen35, PROMPTS, params, **options)
    _, eager = generate(tiny_qwen35, PROMPTS, params, enforce_eager=True, **options)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    assert graphs.captured_batch_sizes() == [1, 2, 3, 4] and not graphs.refused
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
