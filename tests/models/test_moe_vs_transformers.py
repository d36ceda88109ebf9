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
from tuili.layers.linear import Linear
from tuili.layers.moe import Experts, QuantizedExperts, SparseMoE
from tuili.layers.quant import QuantizedLinear
from tuili.perf.measure import engine_storage
from tuili.platform import Platform

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
    assert llm.engine.platform.native_kernels == (path == "native" and kernels.available())
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


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), device="cpu", block_size=4, kv_cache_memory=1 << 20, **kwargs)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_holds_experts_packed(checkpoint, method, prompt_logits):
    """`quantization` quantizes the routed experts as it quantizes dense linears, expert by expert.
    Exact path (float32 compute): the model equals the float model holding every matrix's
    dequantized weights. Fast path (bf16 compute, as `LLM(quantization=...)` loads it): close to the
    float model; the experts' bytes are the packed ones (the engine's, the ruler's), and a decode
    step of one sequence reads top_k of each layer's experts."""
    path, hf, name = checkpoint
    top_k, moe_layers = hf.config.num_experts_per_tok, CASES[name][1]

    exact = _llm(path, dtype="float32", quantization=method)
    reference = _llm(path, dtype="float32")
    float_logits = prompt_logits(reference, PROMPTS)
    held = dict(exact.engine.runner.model.named_modules())
    floats = dict(reference.engine.runner.model.named_modules())
    packed_experts = {n: m for n, m in held.items() if isinstance(m, QuantizedExperts)}
    assert len(packed_experts) == sum(moe_layers) and not any(isinstance(m, Experts) for m in held.values())
    with torch.no_grad():
        for module_name, module in held.items():
            if isinstance(module, QuantizedExperts):
                assert module.compute_dtype == torch.float32
                floats[module_name].gate_up_proj.copy_(module.dequantize("gate_up_proj"))
                floats[module_name].down_proj.copy_(module.dequantize("down_proj"))
            elif isinstance(module, QuantizedLinear):
                if module_name.startswith("lm_head"):
                    floats["lm_head"].projection = Linear.holding(module.dequantize(), None, Platform.detect())
                else:
                    floats[module_name].weight.copy_(module.dequantize())
    torch.testing.assert_close(prompt_logits(exact, PROMPTS), prompt_logits(reference, PROMPTS), rtol=1e-4, atol=1e-4)

    fast = _llm(path, quantization=method)
    model = fast.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert [m.compute_dtype for m in experts] == [torch.bfloat16] * sum(moe_layers)
    E, H, inter = COMMON["num_experts"], COMMON["hidden_size"], COMMON["moe_intermediate_size"]
    values = E * 3 * inter * H  # gate, up and down of every expert
    expert_bytes = sum(t.nbytes for m in experts for t in m.buffers())
    if method == "int8":  # a byte per value, and per group of a row a bf16 scale (Int8GroupLinear; 8
        # bytes, a scale and zero per nibble half, where PyTorch's op runs instead of tuili's kernels):
        # groups of 64 inputs for gate_up (H = 64), 32 for down (inter = 32), the largest of 128, 64
        # and 32 that divides the input
        per_group = 2 if experts[0].platform.native_kernels else 8
        assert expert_bytes == len(experts) * (values + per_group * E * (2 * inter * H // 64 + H * inter // 32))
    else:  # 4 bits per value and a bf16 scale and zero per 32 (every row count a multiple of 64)
        assert expert_bytes == len(experts) * values * 5 // 8
    assert engine_storage(model).bytes_by_kind["experts"] == expert_bytes  # the ruler's count
    weight_bytes = fast.engine.weight_bytes()
    unread = model.model.embed_tokens.weight.nbytes + expert_bytes * (E - top_k) // E
    assert fast.engine.decode_weight_bytes() == weight_bytes - unread
    # Against the same model in bf16: at least the experts' saving (the dense linears shrink too),
    # less the int8 copy a tied embedding gets for the logits (the float table stays for lookups).
    copy = model.lm_head.projection.weight_bytes if hf.config.tie_word_embeddings else 0
    assert _llm(path).engine.weight_bytes() - weight_bytes >= 2 * values * len(experts) - expert_bytes - copy

    fast_logits = prompt_logits(fast, PROMPTS)
    error = (fast_logits - float_logits).abs() / float_logits.std()
    agree = (fast_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    # Loose bounds, as the dense quantized models' (tests/layers/test_quant.py; a wrong layout or
    # scale gives ~1), the mean a little looser: where quantization moves a token's router logits
    # past each other it takes another expert, a jump no dense model has (measured mean error /
    # logit spread 0.012 to 0.021 for int8, 0.13 to 0.26 for int4; max 0.76 and 2.5 at top-1).
    # The exact path above is the check of the arithmetic.
    if method == "int8":
        assert error.mean() < 0.03 and agree >= 0.9, (error.mean(), agree)
    else:
        assert error.mean() < 0.35 and agree >= 0.5, (error.mean(), agree)


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
