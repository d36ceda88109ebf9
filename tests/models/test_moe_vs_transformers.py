"""tuili's Qwen3-MoE network against Hugging Face transformers on the same random weights.

Each case writes a tiny random Qwen3-MoE checkpoint with `save_pretrained` (which stores each
expert's gate/up/down matrices apart), then checks (1) logits for a batch of prompts of
different lengths and (2) 32 greedy tokens per prompt against a plain greedy loop over the
transformers model, with block_size=4 and a 16-token step budget so that paging, chunked
prefill and steps mixing prefill chunks with decodes all happen, on the native kernels and on
the portable torch path. The cases cover top-1 and top-all routing, norm_topk_prob on and off,
dense layers chosen by mlp_only_layers and by decoder_sparse_step, and a checkpoint that stores
the experts fused as transformers holds them in memory.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tuili import LLM, SamplingParams
from tuili.config import ModelConfig
from tuili.errors import CheckpointError, TuiliError
from tuili.layers.moe import SparseMoE

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper distributions: no near-ties for greedy to trip on
    rms_norm_eps=1e-6,
)

# name -> (config fields, which layers are mixtures of experts)
CASES = {
    # top-1, renormalised (every weight is then exactly 1); layer 1 dense by mlp_only_layers
    "top1-norm-mlp-only": (
        dict(num_hidden_layers=3, num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[1]),
        [True, False, True],
    ),
    # top-2 as softmax probabilities (not renormalised); every second layer sparse
    "top2-step2": (
        dict(num_hidden_layers=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2),
        [False, True, False, True],
    ),
    # every expert for every token, renormalised; tied embeddings
    "top8-all-norm-tied": (
        dict(num_hidden_layers=2, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=True),
        [True, True],
    ),
}

PROMPTS = [
    [5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13],
    [42],
    list(range(30, 53)),
    [7, 7, 7, 200, 201],
]


def _hf_model(name: str) -> transformers.PreTrainedModel:
    fields, _ = CASES[name]
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**COMMON, **fields)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp("ckpt") / request.param
    model.save_pretrained(path)
    return path, model, request.param


def test_logits_match_transformers(checkpoint, prompt_logits, assert_logits_match):
    path, hf, name = checkpoint
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20)
    # the layers the config makes sparse are mixtures of experts, the others dense
    layers = llm.engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == CASES[name][1]
    assert_logits_match(prompt_logits(llm, PROMPTS), hf, PROMPTS)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_greedy_matches_transformers_with_paging_and_chunking(checkpoint, path, monkeypatch, hf_greedy):
    """The native kernels (where they build) and the portable torch path (TUILI_NATIVE_KERNELS=0,
    read when the engine is built). A mixture of experts runs every step eagerly: no CPU graphs."""
    from tuili import kernels

    if path == "torch":
        monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    checkpoint_path, hf, _ = checkpoint
    steps = 32
    llm = LLM(
        model=str(checkpoint_path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
        kv_cache_memory=1 << 20,
    )
    assert llm.engine.runner.native_attention == (path == "native" and kernels.available())
    assert llm.engine.runner.graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, steps)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_fused_expert_checkpoint_loads(tmp_path, prompt_logits, assert_logits_match):
    """A checkpoint storing each layer's experts as the two 3-D tensors transformers holds in
    memory (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) gives the same
    logits as transformers."""
    hf = _hf_model("top2-step2")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and state["model.layers.1.mlp.experts.gate_up_proj"].dim() == 3
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20)
    assert_logits_match(prompt_logits(llm, PROMPTS), hf, PROMPTS)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_of_experts_is_refused_by_name(checkpoint, method):
    path, _, _ = checkpoint
    with pytest.raises(TuiliError, match=rf"quantization '{method}' does not cover mixture-of-experts.*mlp\.experts"):
        LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 20, quantization=method)


def test_missing_expert_is_named(tmp_path):
    hf = _hf_model("top1-norm-mlp-only")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=1 << 20)


def _config(**changes) -> dict:
    cfg = transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_experts_per_tok=2).to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg.update(changes)
    return json.loads(json.dumps(cfg))


def test_config_reads_both_expert_count_names():
    written = _config()  # transformers 5 writes num_local_experts
    assert "num_experts" not in written and written["num_local_experts"] == 8
    published = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_hf_config(written).moe == ModelConfig.from_hf_config(published).moe
    moe = ModelConfig.from_hf_config(written).moe
    assert dataclasses.astuple(moe) == (8, 2, 32, False, (True, True, True), 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds the number of experts \(8\)"),
        (dict(num_local_experts=0), r"num_local_experts=0 is invalid"),
        (dict(num_local_experts=8, num_experts=16), r"num_experts=16 and num_local_experts=8 disagree"),
        (dict(mlp_only_layers=[0, 3]), r"mlp_only_layers=\[0, 3\] names layer\(s\) \[3\] outside 0..2"),
        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 is invalid"),
        (dict(moe_intermediate_size=None), r"missing required field 'moe_intermediate_size'"),
        (dict(norm_topk_prob="yes"), r"norm_topk_prob='yes' is invalid"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(use_sliding_window=True, sliding_window=64), r"sliding-window attention \(sliding_window=64\)"),
    ],
)
def test_bad_moe_config_is_refused_by_name(changes, message):
    with pytest.raises(TuiliError, match=message):
        ModelConfig.from_hf_config(_config(**changes))
