"""tuili's Qwen3-Next (hybrid Gated DeltaNet + gated full attention) against Hugging Face
transformers on the same random weights.

Each case writes a tiny random Qwen3-Next checkpoint with `save_pretrained` (4 layers in the
3:1 linear:full pattern), then checks logits for a batch of prompts and 32 greedy tokens per
prompt against transformers' `generate`, with block_size=4 and a 7-token step budget, so that
prompts are split at odd positions across steps and steps mix prefill chunks with decodes; on
the native kernels and on the portable torch path (TUILI_NATIVE_KERNELS=0). Also: a run under
preemption (a KV/state budget too small for all sequences at once), every state slot free after
finish and abort, prefix caching off when the budget leaves no room for a state checkpoint
(never a wrong hit; hits are tested in test_hybrid_prefix_cache.py), bf16, MTP tensors held, and the
config's checks.
"""

from __future__ import annotations

import json
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
    randomise_norms,
    tuili_llm,
    write_checkpoint,
)
from tuili import SamplingParams
from tuili.config import EngineConfig, ModelConfig
from tuili.engine.pool import kv_bytes_per_block, plan_pool, state_bytes_per_slot
from tuili.errors import TuiliError
from tuili.layers.deltanet import GatedDeltaNet
from tuili.layers.moe import SparseMoE

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # layer_types: linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper distributions: no near-ties for greedy to trip on
    rms_norm_eps=1e-6,
)

CASES = {
    # Hv = 2 Hk; every layer a mixture of 4 experts (top-2, renormalised) plus the shared expert
    "moe-shared-hv4": dict(linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Hv = Hk; layer 1 dense by mlp_only_layers; tied embeddings; half the head rotated
    "hv2-mlp-only-tied": dict(linear_num_value_heads=2, num_experts=4, num_experts_per_tok=1,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[1],
                              tie_word_embeddings=True, partial_rotary_factor=0.5),
}  # fmt: skip

def _hf_model(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**COMMON, **CASES[name])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomise_norms(model)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return write_checkpoint(_hf_model(request.param), tmp_path_factory.mktemp("ckpt") / request.param)


def test_logits_match_transformers(checkpoint, prompt_logits, assert_logits_match):
    llm = tuili_llm(checkpoint.path)
    layers = llm.engine.runner.model.model.layers
    assert [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in layers] == [True, True, True, False]
    expect_sparse = [i not in checkpoint.hf.config.mlp_only_layers for i in range(4)]
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == expect_sparse
    assert_logits_match(prompt_logits(llm, PROMPTS), checkpoint.hf, PROMPTS)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_greedy_matches_transformers_generate_with_split_prompts(checkpoint, path, monkeypatch, mixed_steps):
    if path == "torch":
        monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    check_greedy_with_split_prompts(checkpoint, path == "native", mixed_steps)


def test_preemption_recomputes_state_from_zero(checkpoint):
    check_preemption_recomputes_state(checkpoint)


def test_slots_are_freed_on_abort_and_reused(checkpoint):
    check_slots_freed_on_abort_and_reused(checkpoint)


def test_prefix_caching_is_off_without_room_for_a_checkpoint(checkpoint, caplog):
    """The KV floor of max_model_len and four state slots take the whole budget: no state
    checkpoint fits, so a cached prefix could not be restored and prefix caching is off."""
    cfg = checkpoint.model_config()
    budget = 16 * kv_bytes_per_block(cfg, 4, torch.float32) + 4 * state_bytes_per_slot(cfg, torch.float32)
    with caplog.at_level(logging.INFO, logger="tuili.engine.core"):
        llm = tuili_llm(checkpoint.path, enable_prefix_caching=True, kv_offload_memory=1 << 16, kv_cache_memory=budget,
                   max_model_len=64, max_num_seqs=4)  # fmt: skip
    assert "prefix caching is off" in caplog.text and "linear-attention state checkpoint" in caplog.text
    assert llm.engine.pool.num_state_checkpoints == 0 and llm.engine.scheduler.checkpoints is None
    assert not llm.engine.block_manager.enable_prefix_caching and llm.engine.pool.num_host_blocks == 0
    for _ in range(2):  # the same prompt twice: the second is computed again, never a cache hit
        out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)[0]
        assert out.outputs[0].token_ids == checkpoint.greedy[tuple(PROMPTS[2])]
    assert llm.engine.stats().prefix_cache.hit_tokens == 0


def test_bf16_runs_close_to_transformers_bf16(checkpoint, prompt_logits, assert_bf16_as_close_as_transformers):
    llm = tuili_llm(checkpoint.path, dtype="bfloat16")
    assert llm.engine.runner.model.model.layers[0].linear_attn.state.recurrent.dtype == torch.float32
    hf_bf16 = _hf_model(checkpoint.path.name).to(torch.bfloat16)
    assert_bf16_as_close_as_transformers(prompt_logits(llm, PROMPTS), hf_bf16, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_all_state_free(llm)


def test_mtp_tensors_are_held_as_stored_and_not_run(tmp_path, caplog, prompt_logits, assert_logits_match):
    """Multi-token-prediction tensors load into model.mtp (for speculative decoding, later), each
    equal to the checkpoint's, outside the network's parameters and its forward."""
    hf = _hf_model("moe-shared-hv4")
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    mtp = {
        "mtp.fc.weight": torch.randn(64, 128, generator=generator),
        "mtp.layers.0.input_layernorm.weight": torch.randn(64, generator=generator),
        "mtp.layers.0.mlp.experts.0.down_proj.weight": torch.randn(64, 32, generator=generator),
    }
    save_file(tensors | mtp, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="tuili.models.loader"):
        llm = tuili_llm(tmp_path)
    assert "holding 3 multi-token-prediction tensors (mtp.*)" in caplog.text
    model = llm.engine.runner.model
    held = dict(model.named_buffers())
    assert sorted(n for n in held if n.startswith("mtp.")) == sorted(mtp)
    for name, tensor in mtp.items():
        assert torch.equal(held[name], tensor), name
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())
    assert_logits_match(prompt_logits(llm, PROMPTS), hf, PROMPTS)


def test_pool_reserves_state_and_caps_sequences():
    cfg = ModelConfig.from_hf_config(_config())
    slot, block = state_bytes_per_slot(cfg, torch.float32), kv_bytes_per_block(cfg, 4, torch.float32)
    # 3 linear layers: conv (2*2*16 + 4*16 channels, 3 columns) + recurrent (4 x 16 x 16), float32
    assert slot == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    assert block == 2 * 1 * 4 * 2 * 16 * 4  # one full-attention layer holds KV
    budget = 20 * block + 3 * slot
    plan = plan_pool(cfg, EngineConfig(block_size=4, max_model_len=80, kv_cache_memory=budget, max_num_seqs=64),
                     torch.float32, torch.device("cpu"))  # fmt: skip
    assert (plan.num_state_slots, plan.num_blocks) == (3, 20)
    with pytest.raises(TuiliError, match=r"cannot hold one sequence's linear-attention state"):
        plan_pool(cfg, EngineConfig(block_size=4, max_model_len=80, kv_cache_memory=20 * block + slot - 1),
                  torch.float32, torch.device("cpu"))  # fmt: skip


def _config(**changes) -> dict:
    cfg = transformers.Qwen3NextConfig(**COMMON, **CASES["moe-shared-hv4"]).to_dict()
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    cfg.update(changes)
    return json.loads(json.dumps(cfg))


def test_config_is_read_once():
    cfg = ModelConfig.from_hf_config(_config())
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.linear.num_k_heads, cfg.linear.num_v_heads, cfg.linear.conv_kernel) == (2, 4, 4)
    assert cfg.rotary_dim == 4 and cfg.moe.shared_intermediate_size == 48 and cfg.num_attention_layers == 1
    # published checkpoints: no layer_types (full_attention_interval), partial_rotary_factor on top
    published = {k: v for k, v in _config().items() if k not in ("layer_types", "rope_parameters")}
    published |= dict(full_attention_interval=2, partial_rotary_factor=0.5, rope_theta=1e6)
    cfg = ModelConfig.from_hf_config(published)
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2 and cfg.rotary_dim == 8
    assert cfg.rope_theta == 1e6
    assert ModelConfig.from_hf_config(_config(num_experts=0)).moe is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(layer_types=["linear_attention"] * 3), r"layer_types=.* expected 4 entries"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), r"each one of full_attention"),
        (dict(layer_types=["linear_attention"] * 4), r"has no full_attention layer"),
        (dict(linear_num_value_heads=3), r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
        (dict(linear_key_head_dim=None), r"missing required field 'linear_key_head_dim'"),
        (dict(linear_conv_kernel_dim=1), r"linear_conv_kernel_dim=1 is invalid"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}), r"rotates 1 of head_dim=16"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 1.5}), r"partial_rotary_factor=1.5"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds the number of experts \(4\)"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ],
)
def test_bad_config_is_refused_by_name(changes, message):
    with pytest.raises(TuiliError, match=message):
        ModelConfig.from_hf_config(_config(**changes))
