"""Pipeline parallelism on CPU with gloo and real processes (tuili/parallel/pipeline*.py).

- PP=2, and TP=2 x PP=2, against PP=1 in float32 on a random Qwen3 checkpoint written by
  `save_pretrained`: every prompt token's logits within a tight tolerance, 32 greedy tokens and
  the prompt logprobs of a batch of four uneven prompts identical, the prefill cut into two
  micro-batches;
- each rank's weight bytes, measured by the rank itself: half of the whole per stage (exactly
  what `tuili plan --pp 2` predicts), a quarter per rank at TP=2 x PP=2;
- `tuili serve -pp 2` on a tied Llama with 3 layers (stages of 2 and 1 layers): serves the
  tokens the whole model gives; a killed stage fails the request in flight, the server exits
  with status 1 within seconds naming the lost rank, and leaves no process;
- the real SmolLM2 GGUF at PP=2: the whole model's logits and greedy tokens;
- the layer split, the micro-batch split, and what is refused, by name.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.config import EngineConfig, ModelConfig
from tuili.engine.request import Sequence
from tuili.engine.scheduler import ScheduledSeq
from tuili.errors import TuiliError
from tuili.parallel.pipeline import PipelineStage, check_supported
from tuili.parallel.pipeline_runner import split_batch
from tuili.perf.checkpoint import read_config
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import preset
from tuili.perf.plan import PlanInputs, make_plan

# 566 prompt tokens: their prefill is cut into two micro-batches ([300], [1, 260, 5] tokens);
# the decode steps (4 tokens) stay whole.
PROMPTS = [[(7 * i) % 311 + 5 for i in range(300)], [42], [(3 * i) % 317 + 2 for i in range(260)], [7, 7, 200, 201, 5]]
COMMON = dict(vocab_size=320, hidden_size=96, max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-6)
QWEN3 = dict(num_hidden_layers=4, intermediate_size=200, num_attention_heads=12, num_key_value_heads=4, head_dim=16,
             attention_bias=True, tie_word_embeddings=False)
LLAMA_TIED = dict(num_hidden_layers=3, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True)
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24)


def _save(path: Path, config_class, extra: dict) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **extra)).save_pretrained(path)
    return path


def _seq(i: int, ids: list[int]) -> Sequence:
    return Sequence(seq_id=10_000 + i, request_id=str(i), index=0, token_ids=list(ids), prompt_len=len(ids),
                    params=SamplingParams())


def _run(llm: LLM, tokens: int = 32) -> tuple[torch.Tensor, list[list[int]], list]:
    """Every prompt token's logits in one prefill, then `tokens` greedy tokens and the prompt
    logprobs (top 2) of each prompt, all four in one batch."""
    engine, batch = llm.engine, []
    for i, ids in enumerate(PROMPTS):
        seq = _seq(i, ids)
        engine.block_manager.grow(seq, len(ids))
        batch.append(ScheduledSeq.next_chunk(seq, len(ids)))
    logits = engine.runner.logits(batch)
    for item in batch:
        engine.block_manager.free(item.seq)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    prompt_logprobs = [[None if lp is None else {t: (v.logprob, v.rank) for t, v in lp.items()} for lp in o.prompt_logprobs]
                       for o in outs]
    return logits, [o.outputs[0].token_ids for o in outs], prompt_logprobs


def _assert_same(got: tuple, want: tuple, atol: float) -> None:
    """Logits within `atol`, the greedy tokens identical, the prompt logprobs' tokens and ranks
    identical and their values within `atol`."""
    logits, tokens, prompt = got
    ref_logits, ref_tokens, ref_prompt = want
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=atol)
    assert tokens == ref_tokens and all(len(t) == len(ref_tokens[0]) > 0 for t in tokens)
    assert len(prompt) == len(ref_prompt)
    for got_seq, want_seq in zip(prompt, ref_prompt, strict=True):
        assert [None if p is None else sorted(p) for p in got_seq] == [None if p is None else sorted(p) for p in want_seq]
        for g, w in zip(got_seq, want_seq, strict=True):
            for token in w or {}:
                assert g[token][1] == w[token][1]
                assert g[token][0] == pytest.approx(w[token][0], abs=atol)


def test_pipeline_matches_one_stage(tmp_path):
    path = _save(tmp_path / "qwen3", transformers.Qwen3Config, QWEN3)
    whole = LLM(str(path), **ENGINE)
    reference = _run(whole)
    whole_bytes = whole.engine.weight_bytes()
    del whole
    llm = LLM(str(path), pipeline_parallel_size=2, **ENGINE)
    try:
        engine = llm.engine
        steps, transfers = engine.stats().num_steps, engine.parallel.num_collectives
        result = _run(llm)
        # Rank 0 sends each micro-batch's hidden states and receives its logits: the logits()
        # call is one micro-batch (2 transfers), the prefill two (4), each decode step one (2).
        steps, transfers = engine.stats().num_steps - steps, engine.parallel.num_collectives - transfers
        per_rank = engine.runner.weight_bytes_per_rank()
        comm = engine.communication_seconds()
    finally:
        llm.engine.close()
    # The stages compute exactly what the whole model does, in the same order.
    _assert_same(result, reference, atol=1e-5)
    assert transfers == 2 + 4 + 2 * (steps - 1), (transfers, steps)
    # 4 layers over 2 stages, the embedding on the first, the head on the second (as big):
    # each stage holds half, and together exactly the whole (no weight is held twice).
    assert sum(per_rank) == whole_bytes
    assert max(per_rank) <= whole_bytes / 2 * 1.01, (per_rank, whole_bytes)
    assert comm > 0
    # ... and exactly what `tuili plan --pp 2` predicts per device.
    assert per_rank == ModelCost.from_config(read_config(str(path / "config.json"))).weight_bytes_per_stage("fp32", 2)

    # TP=2 within each of 2 stages: 4 ranks, each a quarter of the weights (the norms replicated).
    llm = LLM(str(path), pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    try:
        result = _run(llm)
        per_rank = llm.engine.runner.weight_bytes_per_rank()
    finally:
        llm.engine.close()
    _assert_same(result, reference, atol=1e-4)  # float32 sums in another order: a few ulps
    assert len(per_rank) == 4 and whole_bytes <= sum(per_rank) <= whole_bytes * 1.02
    assert max(per_rank) <= whole_bytes / 4 * 1.02, (per_rank, whole_bytes)


def test_layers_split_contiguously_the_first_stages_taking_the_extra():
    assert [list(PipelineStage(r, 3).layers(5)) for r in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(PipelineStage(r, 2).layers(4)) for r in range(2)] == [[0, 1], [2, 3]]


def test_a_batch_splits_into_contiguous_micro_batches_balanced_by_tokens():
    def items(*tokens: int) -> list[ScheduledSeq]:
        return [ScheduledSeq.next_chunk(_seq(i, list(range(n))), n) for i, n in enumerate(tokens)]

    def shape(runs: list[list[ScheduledSeq]]) -> list[list[int]]:
        return [[item.num_tokens for item in run] for run in runs]

    assert shape(split_batch(items(1, 1, 1, 1), 2, min_tokens=1)) == [[1, 1], [1, 1]]
    assert shape(split_batch(items(100, 1, 1, 1), 2, min_tokens=1)) == [[100], [1, 1, 1]]
    assert shape(split_batch(items(1, 1, 1, 100), 2, min_tokens=1)) == [[1, 1, 1], [100]]
    assert shape(split_batch(items(5, 5, 5), 3, min_tokens=1)) == [[5], [5], [5]]
    assert shape(split_batch(items(5), 3, min_tokens=1)) == [[5]]
    assert shape(split_batch(items(1, 1, 1, 1, 1), 4, min_tokens=1)) == [[1, 1], [1], [1], [1]]
    # By default a run holds 256 tokens or more: decode steps stay whole, long prefills split.
    assert shape(split_batch(items(*[1] * 64), 2)) == [[1] * 64]
    assert shape(split_batch(items(300, 1, 260, 5), 2)) == [[300], [1, 260, 5]]
    assert shape(split_batch(items(300, 300, 300), 4)) == [[300], [300], [300]]


def test_what_pipeline_parallelism_refuses_is_named():
    with pytest.raises(TuiliError, match="pipeline_parallel_size=0 is invalid"):
        EngineConfig(pipeline_parallel_size=0).validate()
    raw = {**transformers.Qwen3Config(**COMMON, **QWEN3).to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(TuiliError, match="pipeline_parallel_size=5 exceeds the 4 decoder layers"):
        check_supported(ModelConfig.from_hf_config(raw), 5)
    moe = transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(TuiliError, match="mixture-of-experts layers, which pipeline parallelism does not run"):
        check_supported(ModelConfig.from_hf_config({**moe.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}), 2)


def test_plan_pp_counts_each_stage_its_layers_kv_and_a_tied_table_twice(tmp_path):
    (tmp_path / "config.json").write_text(transformers.LlamaConfig(**COMMON, **LLAMA_TIED).to_json_string())
    cost = ModelCost.from_config(read_config(str(tmp_path / "config.json")))
    whole = cost.weight_bytes("bf16")
    table = COMMON["vocab_size"] * COMMON["hidden_size"] * 2
    stages = cost.weight_bytes_per_stage("bf16", 2)  # layers 2 + 1: the last adds the norm and the table again
    assert sum(stages) == whole + table
    layer = (stages[0] - table) / 2
    assert stages[1] == pytest.approx(layer + table + COMMON["hidden_size"] * 2)
    one, two = (make_plan(cost, preset("h100-sxm"), PlanInputs(weights=weight_format("bf16"), gpus=pp, pp=pp, context=1024)) for pp in (1, 2))
    assert two["weights_bytes_per_device"] == max(stages) and two["weights_bytes_per_stage"] == stages
    assert two["gpus"] == 2 and two["replicas"] == 1 and two["stage_transfer_bytes_per_step"] > 0
    # The first stage holds 2 of the 3 layers' KV: a request takes 2/3 of its bytes there.
    assert two["max_concurrent_requests"] > one["max_concurrent_requests"] * 1.4
    with pytest.raises(TuiliError, match="--pp 4 exceeds the model's 3 decoder layers"):
        cost.weight_bytes_per_stage("bf16", 4)


# ---- processes --------------------------------------------------------------------------








def test_serve_with_two_stages_and_a_lost_stage(tmp_path, real_tokenizer_dirs, served_ranks):
    """`tuili serve -pp 2` gives the whole model's text; a killed stage fails the request in
    flight, the server exits 1 within seconds, naming it, and no process is left."""
    path = _save(tmp_path / "llama", transformers.LlamaConfig, LLAMA_TIED)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # so that the answers carry text
        shutil.copy(real_tokenizer_dirs["llama3"] / name, path / name)
    log = tmp_path / "serve.log"
    server = served_ranks.serve(path, log, "-pp", "2")
    try:
        whole = LLM(str(path), **ENGINE)  # while the server starts
        expected = whole.generate({"prompt_token_ids": [5, 17, 250]},
                                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].text
        url = served_ranks.wait_for_url([log], [server])
        answer = served_ranks.complete(url)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected and len(expected) > 8
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        comm = re.search(r"^tuili:pipeline_parallel_communication_seconds_total\S* (\S+)$", metrics, re.MULTILINE)
        assert comm is not None and float(comm.group(1)) > 0, metrics
        served_ranks.kill_a_worker_mid_request(server, url, log, "pipeline-parallel worker rank 1")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_pipeline_matches_one_stage_on_the_real_smollm2_gguf():
    """The real SmolLM2 GGUF (30 layers, 15 per stage; dequantized to float32): PP=2 gives the
    whole model's logits and greedy tokens (8 of them: the tiny models above run 32)."""
    from tuili.models.default_model import default_model_path

    path, engine = str(default_model_path()), {**ENGINE, "kv_cache_memory": 1 << 27}  # 46 KB of KV per token
    whole = LLM(path, **engine)
    reference = _run(whole, tokens=8)
    del whole
    llm = LLM(path, pipeline_parallel_size=2, **engine)
    try:
        result = _run(llm, tokens=8)
    finally:
        llm.engine.close()
    _assert_same(result, reference, atol=1e-4)
