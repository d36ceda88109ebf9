"""tuili's Qwen3.5 (dense hybrid) and Qwen3.5-MoE (hybrid MoE) against Hugging Face transformers
on the same random weights.

Each case writes a tiny random checkpoint with `save_pretrained` (4 layers in the 3:1
linear:full pattern), then checks logits for a batch of prompts (one longer than the DeltaNet's
64-token chunk) and 32 greedy tokens per prompt against transformers' `generate`, with
block_size=4 and a 7-token step budget, so that prompts are split at odd positions and steps mix
prefill chunks with decodes; on the native kernels and on the portable torch path; under
preemption; every state slot returned after finish and abort. The shapes cover Hv != Hk (3 value
heads per key head), head counts that divide neither each other's powers of two nor the chunk
size (6 and 3 attention heads, 3 value heads), and MoE routing with top-k 1 and top-k 8 of 8
experts. Also: a multimodal checkpoint (Qwen3_5ForConditionalGeneration, weights under
model.language_model., a vision encoder) loads as its language model and matches transformers'
multimodal model on text; multi-token-prediction tensors are held, equal to the checkpoint's;
bf16 close to transformers' bf16; bad configs refused by name.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.models.hybrid_models import (
    GREEDY,
    PROMPTS,
    Checkpoint,
    assert_all_state_free,
    check_greedy_with_split_prompts,
    check_preemption_recomputes_state,
    check_slots_freed_on_abort_and_reused,
    greedy_answers,
    randomise_norms,
    tuili_llm,
    write_checkpoint,
)
from tuili import SamplingParams
from tuili.config import ModelConfig
from tuili.errors import TuiliError
from tuili.layers.deltanet import GatedDeltaNet
from tuili.layers.moe import SparseMoE
from tuili.models.llama import MLP
from tuili.perf.cost import ModelCost
from tuili.perf.meter import UtilizationMeter
from tuili.platform import Platform

COMMON = dict(
    vocab_size=320,
    hidden_size=48,
    num_hidden_layers=4,  # layer_types: linear, linear, linear, full
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper distributions: no near-ties for greedy to trip on
    rms_norm_eps=1e-6,
)

CASES = {
    # dense; Hv = 3 Hk; 6 query heads over 3 KV heads; partial_rotary_factor left at its 0.25 default
    "dense-hv6-hk2": ("qwen3_5", dict(intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
                                      linear_num_key_heads=2, linear_num_value_heads=6)),
    # MoE top-1 of 4 with the shared expert; Hv = Hk; tied embeddings; half of each head rotated
    "moe-top1-hv2": ("qwen3_5_moe", dict(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                         linear_num_value_heads=2, num_experts=4, num_experts_per_tok=1,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=24,
                                         tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5})),
    # MoE top-8 of 8 (every expert, renormalised); one key head for 3 value heads; 3 query heads, 1 KV head
    "moe-top8-hv3-hk1": ("qwen3_5_moe", dict(num_attention_heads=3, num_key_value_heads=1, linear_num_key_heads=1,
                                             linear_num_value_heads=3, num_experts=8, num_experts_per_tok=8,
                                             moe_intermediate_size=16, shared_expert_intermediate_size=32)),
}  # fmt: skip

TEXT_CONFIGS = {"qwen3_5": transformers.Qwen3_5TextConfig, "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig}
ARCHITECTURES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}

LONG_PROMPT = [(7 * i + 3) % 320 for i in range(71)]  # two DeltaNet chunks (64 + 7) in one prefill


def _hf_model(name: str) -> transformers.PreTrainedModel:
    family, fields = CASES[name]
    torch.manual_seed(0)
    config = TEXT_CONFIGS[family](**COMMON, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    assert type(model).__name__ == ARCHITECTURES[family]
    randomise_norms(model)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return write_checkpoint(_hf_model(request.param), tmp_path_factory.mktemp("ckpt") / request.param)


def test_logits_match_transformers(checkpoint, prompt_logits, assert_logits_match):
    hf = checkpoint.hf
    llm = tuili_llm(checkpoint.path)
    model = llm.engine.runner.model
    layers = model.model.layers
    assert [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in layers] == [True, True, True, False]
    assert not layers[0].linear_attn.grouped_by_key_head  # Qwen3.5's flat projection layout
    moe = isinstance(hf.model.layers[0].mlp, transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock)
    assert all(isinstance(layer.mlp, SparseMoE if moe else MLP) for layer in layers)
    if moe:  # the router renormalises whatever the config says (Qwen3.5-MoE has no norm_topk_prob)
        assert all(layer.mlp.norm_topk_prob and layer.mlp.shared_expert is not None for layer in layers)
    assert model.mtp is None
    prompts = [*PROMPTS, LONG_PROMPT]
    # float32 rounding, as for Llama, with a little more absolute room: the long prompt's DeltaNet
    # state sums 71 tokens of writes, and the native rule's vector width orders those sums (an
    # AVX2-only Zen 3 came 2.6e-5 off on one logit of 22720, where 16-lane AVX-512 stays in 2e-5)
    assert_logits_match(prompt_logits(llm, prompts), hf, prompts, atol=4e-5, rtol=1e-4)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_greedy_matches_transformers_generate_with_split_prompts(checkpoint, path, monkeypatch, mixed_steps):
    if path == "torch":
        monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    check_greedy_with_split_prompts(checkpoint, path == "native", mixed_steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_on_cuda_matches_transformers_with_split_prompts(checkpoint, mixed_steps):
    """The same on a CUDA GPU: the rule in flash-linear-attention's kernels where fla-core is
    installed (its chunked kernel for prefill chunks, its fused recurrent one for decodes), in
    torch otherwise; the reference is transformers on the CPU."""
    assert Platform.detect("cuda").fla == (importlib.util.find_spec("fla") is not None)
    check_greedy_with_split_prompts(checkpoint, False, mixed_steps, device="cuda")


def test_preemption_recomputes_state_from_zero(checkpoint):
    check_preemption_recomputes_state(checkpoint)


def test_slots_are_freed_on_abort_and_reused(checkpoint):
    check_slots_freed_on_abort_and_reused(checkpoint)


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=4,
              temporal_patch_size=2, num_position_embeddings=16)  # fmt: skip
WRAPPERS = {"qwen3_5": transformers.Qwen3_5Config, "qwen3_5_moe": transformers.Qwen3_5MoeConfig}


def _mtp_tensors(hidden: int) -> dict[str, torch.Tensor]:
    """The kind of tensors a published checkpoint's multi-token-prediction head has (a fused
    3-D expert tensor among them); random, as only their keeping is checked."""
    generator = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "mtp.fc.weight": rand(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": rand(hidden),
        "mtp.pre_fc_norm_hidden.weight": rand(hidden),
        "mtp.layers.0.self_attn.q_proj.weight": rand(64, hidden),
        "mtp.layers.0.mlp.experts.gate_up_proj": rand(4, 64, hidden),
        "mtp.norm.weight": rand(hidden),
    }


@pytest.mark.parametrize("case", ["dense-hv6-hk2", "moe-top1-hv2"])
def test_multimodal_checkpoint_loads_its_language_model_and_keeps_mtp(case, tmp_path, caplog, prompt_logits,
                                                                      assert_logits_match):  # fmt: skip
    """A checkpoint as Qwen3.5 is published: Qwen3_5(Moe)ForConditionalGeneration with a text_config,
    the language model under model.language_model., a vision encoder under model.visual. and the
    MTP head under mtp.: tuili loads the language model (saying it ignores the vision encoder),
    matches the multimodal model on text, and holds the MTP tensors as stored."""
    family, fields = CASES[case]
    torch.manual_seed(0)
    text = TEXT_CONFIGS[family](**COMMON, **fields).to_dict()
    config = WRAPPERS[family](text_config=text, vision_config=VISION, tie_word_embeddings=text["tie_word_embeddings"])
    hf = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").float().eval()
    randomise_norms(hf)
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    assert any(n.startswith("model.language_model.") for n in tensors) and any(n.startswith("model.visual.") for n in tensors)
    mtp = _mtp_tensors(COMMON["hidden_size"])
    save_file(tensors | mtp, str(file), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="tuili.models.loader"):
        llm = tuili_llm(tmp_path, max_num_batched_tokens=7)
    assert "ignoring" in caplog.text and "vision-encoder tensors (model.visual.*)" in caplog.text
    assert f"holding {len(mtp)} multi-token-prediction tensors" in caplog.text
    model = llm.engine.runner.model
    assert model.config.architecture == type(hf).__name__
    held = dict(model.named_buffers())
    for name, tensor in mtp.items():
        assert torch.equal(held[name], tensor), name
    # held, not counted as the network's weights (the bytes a step reads): the engine's weights are
    # the cost model's for the language model alone, and the live meter reads the wrapped config
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())
    assert llm.engine.weight_bytes() == ModelCost.from_config(model.config.raw).weight_bytes("fp32")
    meter = UtilizationMeter.for_engine(llm.engine, "h100")
    assert meter.state_bytes_per_sequence == llm.engine.pool.state_bytes_per_slot > 0
    assert_logits_match(prompt_logits(llm, PROMPTS), hf, PROMPTS)
    greedy = greedy_answers(hf, PROMPTS[:2])
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS[:2]], GREEDY)
    for ids, out in zip(PROMPTS[:2], outs, strict=True):
        assert out.outputs[0].token_ids == greedy[tuple(ids)]
    assert_all_state_free(llm)


def _text_config(case: str, **changes) -> dict:
    family, fields = CASES[case]
    cfg = TEXT_CONFIGS[family](**COMMON, **fields).to_dict()
    return cfg | {"architectures": [ARCHITECTURES[family]]} | changes


def test_config_reads_what_transformers_builds():
    dense = ModelConfig.from_hf_config(_text_config("dense-hv6-hk2"))
    assert dense.family == "qwen3_5" and dense.moe is None and dense.rotary_dim == 4  # 0.25 x 16
    assert (dense.linear.num_k_heads, dense.linear.num_v_heads) == (2, 6)
    # Qwen3.5-MoE: no intermediate_size; every layer sparse and renormalised, whatever the config
    # says about fields Qwen3.5-MoE does not have (transformers does not read them either).
    written = {k: v for k, v in _text_config("moe-top8-hv3-hk1").items() if k != "intermediate_size"}
    moe = ModelConfig.from_hf_config(written | dict(norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=2))
    assert moe.moe.norm_topk_prob and moe.moe.sparse_layers == (True,) * 4 and moe.moe.top_k == 8
    assert moe.intermediate_size == 0
    # published: a multimodal wrapper whose tie_word_embeddings is the one that counts; no layer_types
    text = {k: v for k, v in _text_config("dense-hv6-hk2").items() if k not in ("layer_types", "architectures")}
    text["tie_word_embeddings"] = False
    wrapped = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": True, "text_config": text | {"full_attention_interval": 2}}  # fmt: skip
    cfg = ModelConfig.from_hf_config(wrapped)
    assert cfg.family == "qwen3_5" and cfg.tie_word_embeddings
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        ("dense-hv6-hk2", dict(intermediate_size=None), r"missing required field\(s\) \['intermediate_size'\]"),
        ("moe-top1-hv2", dict(moe_intermediate_size=None), r"missing required field 'moe_intermediate_size'"),
        ("moe-top8-hv3-hk1", dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds the number of experts \(8\)"),
        ("dense-hv6-hk2", dict(linear_num_value_heads=5), r"linear_num_value_heads=5 is not a multiple of linear_num_key_heads=2"),
        ("dense-hv6-hk2", dict(layer_types=["linear_attention"] * 4), r"has no full_attention layer"),
    ],
)  # fmt: skip
def test_bad_config_is_refused_by_name(case, changes, message):
    cfg = {k: v for k, v in _text_config(case, **changes).items() if v is not None}
    with pytest.raises(TuiliError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_bf16_runs_close_to_transformers_bf16(tmp_path, prompt_logits, assert_bf16_as_close_as_transformers):
    """bf16 weights and activations, float32 recurrent state: as close to float32 as transformers'
    own bf16 run (measured: mean errors 0.0135 ours, 0.0143 transformers')."""
    hf = _hf_model("moe-top1-hv2").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    llm = tuili_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=7)
    assert llm.engine.runner.model.model.layers[0].linear_attn.state.recurrent.dtype == torch.float32
    assert_bf16_as_close_as_transformers(prompt_logits(llm, PROMPTS), hf, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_all_state_free(llm)
