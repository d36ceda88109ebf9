"""The mixture-of-experts layer (tuili/layers/moe.py) against transformers' blocks and a naive
per-token reference, on the native kernels and on the portable torch path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tuili.config import ModelConfig
from tuili.layers import moe as moe_module
from tuili.layers.moe import Experts, SparseMoE, route
from tuili.models.llama import LlamaForCausalLM, sparse_moe
from tuili.models.weights import WeightPlan
from tuili.platform import Platform

PLATFORMS = {"native": Platform.detect, "torch": Platform.portable}
H, INTER, E = 64, 32, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("top_k", "norm"), [(1, True), (2, False), (3, True), (8, False)])
def test_route_matches_transformers_router(top_k, norm, dtype):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config).to(dtype)
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(20, H, dtype=dtype)
    with torch.no_grad():
        logits, ref_weights, ref_experts = router(x)
    weights, experts = route(logits, top_k, norm)
    assert weights.dtype == ref_weights.dtype == dtype  # rounded back as the reference rounds them
    assert torch.equal(experts, ref_experts)
    assert torch.equal(weights, ref_weights)


def _naive(x, gate_up, down, experts, weights):
    """Per token, per chosen expert: the SwiGLU MLP's output times its weight, summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_grouped_experts_skip_experts_without_tokens(platform, monkeypatch):
    """Experts 1, 2, 4 and 6 receive no token: only the others multiply, each once over all of its
    tokens (one gate_up and one down product per expert with tokens, never one per token)."""
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, H) * 0.2, torch.randn(E, H, INTER) * 0.2
    experts = Experts(gate_up, down, PLATFORMS[platform]())
    ids = torch.tensor([[0, 3], [7, 0], [5, 3], [3, 7], [0, 5], [7, 3]])
    weights = torch.rand(ids.shape)
    x = torch.randn(ids.shape[0], H)

    calls = []
    real_linear = moe_module.linear

    def recording_linear(rows, weight, *args, **kwargs):
        calls.append((weight.data_ptr(), rows.shape[0]))
        return real_linear(rows, weight, *args, **kwargs)

    monkeypatch.setattr(moe_module, "linear", recording_linear)
    out = experts(x, ids, weights)
    torch.testing.assert_close(out, _naive(x, gate_up, down, ids, weights), atol=1e-5, rtol=1e-5)

    counts = {e: int((ids == e).sum()) for e in range(E)}
    used = [e for e in range(E) if counts[e]]
    assert used == [0, 3, 5, 7]
    expected = []
    for e in used:  # in expert order, each with all of its rows at once
        expected += [(experts.gate_up_proj[e].data_ptr(), counts[e]), (experts.down_proj[e].data_ptr(), counts[e])]
    assert calls == expected


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_one_token_uses_only_its_experts(platform):
    torch.manual_seed(1)
    gate_up, down = torch.randn(E, 2 * INTER, H) * 0.2, torch.randn(E, H, INTER) * 0.2
    experts = Experts(gate_up, down, PLATFORMS[platform]())
    ids, weights, x = torch.tensor([[6]]), torch.tensor([[0.75]]), torch.randn(1, H)
    torch.testing.assert_close(experts(x, ids, weights), _naive(x, gate_up, down, ids, weights), atol=1e-5, rtol=1e-5)


def _moe_config(top_k: int, norm: bool, shared: int) -> ModelConfig:
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=H, intermediate_size=96, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k,
        norm_topk_prob=norm, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ).to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    model_cfg = ModelConfig.from_hf_config(cfg)
    assert model_cfg.moe is not None
    return dataclasses.replace(model_cfg, moe=dataclasses.replace(model_cfg.moe, shared_intermediate_size=shared))


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per-expert"])
@pytest.mark.parametrize(("top_k", "norm"), [(2, False), (4, True)])
def test_shared_expert_block_matches_transformers_qwen2_moe(platform, per_expert, top_k, norm):
    """A Qwen2-MoE sparse block (routed experts plus a shared expert scaled by a sigmoid gate, as
    Qwen3-Next has it) built through the weight plan from the block's own tensors, under the
    checkpoint names of either layout."""
    torch.manual_seed(0)
    hf_config = transformers.Qwen2MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, shared_expert_intermediate_size=48, num_experts=E,
        num_experts_per_tok=top_k, norm_topk_prob=norm,
    )
    block = Qwen2MoeSparseMoeBlock(hf_config).float().eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    prefix = "model.layers.0.mlp"
    tensors = {f"{prefix}.{k}": v.detach().clone() for k, v in block.state_dict().items()}
    if per_expert:  # as save_pretrained writes them
        gate_up, down = tensors.pop(f"{prefix}.experts.gate_up_proj"), tensors.pop(f"{prefix}.experts.down_proj")
        for e in range(E):
            tensors[f"{prefix}.experts.{e}.gate_proj.weight"], tensors[f"{prefix}.experts.{e}.up_proj.weight"] = (
                gate_up[e].chunk(2)
            )
            tensors[f"{prefix}.experts.{e}.down_proj.weight"] = down[e]
    plan = WeightPlan(
        PLATFORMS[platform](), torch.float32, {k: (lambda v=v: v) for k, v in tensors.items()},
        LlamaForCausalLM.stacked_projections, "test",
    )
    ours = sparse_moe(_moe_config(top_k, norm, 48), plan, prefix)
    assert isinstance(ours, SparseMoE) and ours.shared_expert is not None
    x = torch.randn(2, 9, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), block(x), atol=1e-5, rtol=1e-5)


def test_experts_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match=r"gate_up \(8, 64, 64\), down \(8, 64, 16\)"):
        Experts(torch.zeros(E, 2 * INTER, H), torch.zeros(E, H, 16), Platform.portable())
