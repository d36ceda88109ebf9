"""Tensor parallelism for hybrid (Gated DeltaNet) and mixture-of-experts models, on CPU with gloo
and real processes (tuili/parallel/shard.py).

Random checkpoints written by `save_pretrained`, 4 layers (3 linear attention, 1 gated full
attention), with 4 key / 12 value DeltaNet heads and 8 query / 4 KV heads, so that TP=3 splits
both unevenly (key heads 2/1/1 with value heads 6/3/3; KV heads 2/1/1):
- Qwen3.5 dense (DeltaNet projections stored flat), intermediate size 100 (not a multiple of 3),
  at TP=2 and TP=3;
- Qwen3.5-MoE, 8 experts top-2 of intermediate 40 with a shared expert of 56 (neither a multiple
  of 3), at TP=3;
- Qwen3-Next (DeltaNet projections fused, grouped by key head), the same experts, at TP=2.
Against TP=1 in float32: the logits of a batch of prompts within a tight
tolerance and 32 greedy tokens identical; every rank's weight bytes, measured by the rank,
about 1/N of the whole, the most loaded rank's exactly what `tuili plan --tp N` counts per device; a prefix-cache hit under TP=3 that restores a linear-attention state
checkpoint (each rank's slice of it) gives the tokens of a cold run. One engine per checkpoint
and TP size, shared by the tests of this module; a process takes part in one process group at
a time, so a TP engine is closed before the next is built (the order below builds each once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.config import ModelConfig
from tuili.errors import TuiliError
from tuili.parallel.shard import TensorShard, check_supported, linear_attention_split, local_config
from tuili.perf.cost import ModelCost

PROMPTS = [[5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13], [42], list(range(30, 53)), [7, 7, 7, 200, 201]]
COMMON = dict(vocab_size=320, hidden_size=48, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
              initializer_range=0.1, rms_norm_eps=1e-6, num_attention_heads=8, num_key_value_heads=4,
              linear_num_key_heads=4, linear_num_value_heads=12)
CHECKPOINTS = {
    "qwen35-dense": (transformers.Qwen3_5TextConfig, dict(intermediate_size=100, tie_word_embeddings=False)),
    "qwen35-moe": (transformers.Qwen3_5MoeTextConfig, dict(num_experts=8, num_experts_per_tok=2,
                                                           moe_intermediate_size=40,
                                                           shared_expert_intermediate_size=56)),
    "qwen3next": (transformers.Qwen3NextConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                                     shared_expert_intermediate_size=56)),
}
# Prefix caching on, with a state checkpoint every 2 blocks of 4 tokens.
ENGINE = dict(dtype="float32", block_size=4, state_checkpoint_interval=2, kv_cache_memory=1 << 22)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
BASE = [int(t) for t in torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))]
FOLLOWER = BASE[:21] + [9, 9, 9]  # 20 tokens of cached KV, the checkpoint at 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for name, (config_class, extra) in CHECKPOINTS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **extra))
        with torch.no_grad():  # transformers starts the norms at identity: a misplaced one would not show
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.2)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def engines(checkpoints):
    """`engines(name, tp)`: the LLM of a checkpoint at a TP size. One-rank engines are kept; the
    last TP engine is kept until another is asked for (one process group per process)."""
    whole: dict[str, LLM] = {}
    parallel: dict[tuple[str, int], LLM] = {}

    def get(name: str, tp: int) -> LLM:
        if tp == 1:
            if name not in whole:
                whole[name] = LLM(str(checkpoints[name]), **ENGINE)
            return whole[name]
        if (name, tp) not in parallel:
            for llm in parallel.values():
                llm.engine.close()
            parallel.clear()
            parallel[(name, tp)] = LLM(str(checkpoints[name]), tensor_parallel_size=tp, **ENGINE)
        return parallel[(name, tp)]

    yield get
    for llm in parallel.values():
        llm.engine.close()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


# dense TP=3 last: the prefix-cache test below takes that engine.
@pytest.mark.parametrize(("name", "tp"), [("qwen3next", 2), ("qwen35-moe", 3), ("qwen35-dense", 2),
                                          ("qwen35-dense", 3)])
def test_hybrid_tensor_parallel_matches_one_rank(checkpoints, engines, prompt_logits, name, tp):
    whole, llm = engines(name, 1), engines(name, tp)
    ref_logits, logits = prompt_logits(whole, PROMPTS), prompt_logits(llm, PROMPTS)
    # float32 sums in another order: a few ulps of the largest logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-4)
    tokens = _greedy(llm, PROMPTS)
    assert tokens == _greedy(whole, PROMPTS) and all(len(t) == 32 for t in tokens)
    # The shards add up to the whole plus what every rank holds whole (norms, the router, the
    # shared expert's gate, the DeltaNet's per-head gated norm); the uneven splits give rank 0
    # the most (2 of 4 key heads and KV heads at TP=3).
    whole_bytes, per_rank = whole.engine.weight_bytes(), llm.engine.runner.weight_bytes_per_rank()
    assert len(per_rank) == tp
    assert whole_bytes <= sum(per_rank) <= whole_bytes * 1.03, (per_rank, whole_bytes)
    assert max(per_rank) <= whole_bytes / tp * 1.35, (per_rank, whole_bytes)
    # The ruler counts the most loaded device: whole KV-head groups (and key-head groups) first.
    cost = ModelCost.from_config(json.loads((checkpoints[name] / "config.json").read_text()))
    assert max(per_rank) == per_rank[0] == cost.weight_bytes_per_device("fp32", tp)
    assert cost.weight_bytes("fp32") == whole_bytes
    # ... and the per-device linear-attention state: rank 0's state slot, which sizes the pool.
    state = cost.state_bytes_per_sequence("fp32", "fp32", tp)
    assert llm.engine.pool.state_bytes_per_slot == state < whole.engine.pool.state_bytes_per_slot
    assert llm.engine.communication_seconds() > 0


def test_prefix_cache_hit_restores_each_ranks_state_checkpoint(engines):
    """BASE then FOLLOWER under TP=3: FOLLOWER starts from the checkpoint after 16 tokens (every
    rank restores its heads' conv and recurrent state) and says what it says cold on one rank."""
    whole, llm = engines("qwen35-dense", 1), engines("qwen35-dense", 3)
    assert llm.engine.pool.num_state_checkpoints > 0
    cold = whole.generate([{"prompt_token_ids": FOLLOWER}], GREEDY)[0]
    assert cold.metrics.num_cached_tokens == 0
    assert _greedy(llm, [BASE]) == _greedy(whole, [BASE])
    hit = llm.generate([{"prompt_token_ids": FOLLOWER}], GREEDY)[0]
    assert hit.metrics.num_cached_tokens == 16
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids


def _config(**changes) -> ModelConfig:
    raw = transformers.Qwen3_5TextConfig(**{**COMMON, "intermediate_size": 100, **changes}).to_dict()
    return ModelConfig.from_hf_config(raw | {"architectures": ["Qwen3_5ForCausalLM"]})


def test_linear_attention_heads_split_by_key_head_groups():
    # The seed's shape: 16 key / 48 value heads over 3 ranks.
    cfg = _config(linear_num_key_heads=16, linear_num_value_heads=48)
    splits = [linear_attention_split(cfg, TensorShard(r, 3)) for r in range(3)]
    assert [(s.k_start, s.k_stop, s.v_start, s.v_stop) for s in splits] == [(0, 6, 0, 18), (6, 11, 18, 33),
                                                                            (11, 16, 33, 48)]
    local = local_config(cfg, TensorShard(2, 3), 1).linear
    assert (local.num_k_heads, local.num_v_heads) == (5, 15)
    # Fewer key heads than ranks: refused, naming them.
    with pytest.raises(TuiliError, match="tensor_parallel_size=5 exceeds the 4 linear-attention key heads"):
        check_supported(_config(num_attention_heads=10, num_key_value_heads=1), TensorShard(0, 5))


def test_experts_split_by_channels_in_whole_quantization_groups():
    raw = transformers.Qwen3_5MoeTextConfig(**COMMON, **CHECKPOINTS["qwen35-moe"][1]).to_dict()
    cfg = ModelConfig.from_hf_config(raw | {"architectures": ["Qwen3_5MoeForCausalLM"]})
    local = [local_config(cfg, TensorShard(r, 3), 1).moe for r in range(3)]
    assert [(m.intermediate_size, m.shared_intermediate_size) for m in local] == [(14, 19), (13, 19), (13, 18)]
    assert {m.num_experts for m in local} == {8}  # every rank holds every expert's share
    # int4 groups of 128 are never cut: one group of 40 channels cannot feed 2 ranks.
    with pytest.raises(TuiliError, match=r"exceeds the expert intermediate size \(40 in blocks of 128"):
        check_supported(cfg, TensorShard(0, 2), ffn_unit=128, expert_unit=128)
