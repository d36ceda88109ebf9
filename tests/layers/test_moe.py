"""The mixture-of-experts layer (tuili/layers/moe.py) against transformers' blocks and a naive
per-token reference, on the native kernels and on the portable torch path."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
import torch.nn.functional as F
import transformers
from gguf import GGMLQuantizationType
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tuili import kernels
from tuili.config import ModelConfig
from tuili.errors import TuiliError
from tuili.layers import moe as moe_module
from tuili.layers.moe import Experts, QuantizedExperts, SparseMoE, route
from tuili.layers.quant import (
    Int4Linear,
    Int6GroupLinear,
    Int8GroupLinear,
    Int8Linear,
    QuantizedLinear,
    quantize_int4,
    quantize_int8,
)
from tuili.models.gguf import quantized_weight
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


# -- experts kept quantized --------------------------------------------------------------------

HERE = Platform.detect(batch_invariant=False)  # kernels picked by row count, so that all of them run
QUANT_PLATFORMS = {"native": lambda: HERE, "torch": Platform.portable}
GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q5_0": GGMLQuantizationType.Q5_0}  # fmt: skip


def _quantized_experts(
    kind: str, compute_dtype: torch.dtype, platform: Platform
) -> tuple[QuantizedExperts, torch.Tensor, torch.Tensor]:
    """Random experts (E = 8, H = 64, I = 32) quantized as `kind` (tuili's int8 / int4
    quantizers, or GGUF blocks made by gguf-py's own quantizer and read as the file reader reads
    them), and the float stacks [E, out, in] they stand for, by a reference independent of the
    packing: the format's own dequantization (tuili/layers/quant/formats.py), gguf-py's for GGUF
    blocks."""
    generator = torch.Generator().manual_seed(0)
    stacks = [torch.randn(E, 2 * INTER, H, generator=generator) * 0.2, torch.randn(E, H, INTER, generator=generator) * 0.2]
    weights, references = [], []
    for stack in stacks:
        if kind in GGUF_TYPES:
            raws = [gguf.quants.quantize(w.numpy(), GGUF_TYPES[kind]) for w in stack]
            weights.append([quantized_weight(raw, GGUF_TYPES[kind], tuple(stack.shape[1:])) for raw in raws])
            ref = [torch.from_numpy(gguf.quants.dequantize(raw, GGUF_TYPES[kind]).copy()) for raw in raws]
        else:
            quantize = quantize_int8 if kind == "int8" else lambda w, dtype: quantize_int4(w, 32, dtype)
            weights.append([quantize(w, compute_dtype) for w in stack])
            ref = [w.dequantize() for w in weights[-1]]
        references.append(torch.stack(ref).reshape(stack.shape))
    return QuantizedExperts(*weights, compute_dtype, platform), *references


def _routing(tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [tokens, top_k] (distinct per token) and their weights; with top-1, experts 2
    and 5 receive no token."""
    generator = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, E, generator=generator)
    if top_k == 1:
        logits[:, [2, 5]] = -1e9
    weights, ids = route(logits, top_k, normalize=True)
    return weights, ids


@pytest.mark.parametrize("kind", ["int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0"])
@pytest.mark.parametrize("platform", list(QUANT_PLATFORMS))
@pytest.mark.parametrize("top_k", [1, 8])
def test_packed_experts_compute_their_dequantized_weights(kind, platform, top_k):
    """Packed experts against float experts holding the weights they dequantize to: exactly (to
    float32 rounding) when they compute in float32; within bf16 rounding when in bf16. Token
    counts 3 and 100 put the few-row kernels (gemv / op) and the tiled one to work."""
    for compute_dtype in (torch.float32, torch.bfloat16):
        # Q5_0's codes (-16..15) at 6 bits where the kernels read them, in bf16 (every expert's)
        six_bit = compute_dtype == torch.bfloat16 and platform == "native" and kernels.linear_int6_available()
        expected_linear = {"int8": Int8Linear, "int4": Int4Linear, "q4_0": Int4Linear, "q4_1": Int4Linear,
                           "q8_0": Int8GroupLinear, "q5_0": Int6GroupLinear if six_bit else Int8GroupLinear}[kind]  # fmt: skip
        packed, gate_up, down = _quantized_experts(kind, compute_dtype, QUANT_PLATFORMS[platform]())
        assert type(packed.linear("down_proj", 0)) is expected_linear and packed.compute_dtype == compute_dtype
        if compute_dtype == torch.float32:  # the module's own dequantization agrees, expert by expert
            torch.testing.assert_close(packed.dequantize("gate_up_proj"), gate_up, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(packed.dequantize("down_proj"), down, rtol=1e-6, atol=1e-7)
        reference = Experts(gate_up, down, Platform.portable())
        for tokens in (3, 100):
            weights, ids = _routing(tokens, top_k)
            if top_k == 1:
                assert not ((ids == 2) | (ids == 5)).any()
            x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                got, want = packed(x, ids, weights), reference(x, ids, weights)
            if compute_dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:  # activations and scales rounded to bf16 (2^-9 each) in both projections
                assert (got - want).abs().max() <= 2**-6 * want.abs().max(), (got - want).abs().max()


def test_packed_experts_multiply_each_expert_with_tokens_once(monkeypatch):
    """The grouped form holds for packed experts: one gate_up and one down product per expert that
    received tokens, over all of its rows, in expert order; experts without tokens cost nothing."""
    packed, _, _ = _quantized_experts("q8_0", torch.bfloat16, HERE)
    ids = torch.tensor([[0, 3], [7, 0], [5, 3], [3, 7], [0, 5], [7, 3]])
    weights, x = torch.rand(ids.shape), torch.randn(ids.shape[0], H)
    calls = []
    real_forward = QuantizedLinear.forward

    def recording_forward(self, rows, *args, **kwargs):
        calls.append((id(self), rows.shape[0]))
        return real_forward(self, rows, *args, **kwargs)

    monkeypatch.setattr(QuantizedLinear, "forward", recording_forward)
    packed(x, ids, weights)
    expected = []
    for e, n in ((0, 3), (3, 4), (5, 2), (7, 3)):
        expected += [(id(packed.linear("gate_up_proj", e)), n), (id(packed.linear("down_proj", e)), n)]
    assert calls == expected


def test_packed_experts_are_stacked_views_that_survive_moves():
    """One buffer per projection and stored number, [E, ...]; each expert's linear reads its slice
    (no copy), also after the module is moved or cast as a whole."""
    packed, _, _ = _quantized_experts("int4", torch.bfloat16, HERE)
    buffers = dict(packed.named_buffers())
    assert sorted(buffers) == ["down_proj_packed", "down_proj_scale_zero", "gate_up_proj_packed", "gate_up_proj_scale_zero"]
    assert all(t.shape[0] == E for t in buffers.values())
    assert not list(packed.parameters()) and not list(packed.children())
    before = packed.dequantize("down_proj")
    packed = packed.to(torch.float32)  # the scales follow, as a dense linear's do
    assert packed.linear("down_proj", 5).scale_zero.data_ptr() == packed.down_proj_scale_zero[5].data_ptr()
    assert packed.compute_dtype == torch.float32
    torch.testing.assert_close(packed.dequantize("down_proj"), before, rtol=0, atol=0)


def test_int4_experts_share_one_scale_layout_per_projection():
    """Q4_0 experts (every zero 0) hold their scales alone; int4 experts with zeros hold pairs, also
    for an expert whose zeros all happen to be 0 (an all-zero matrix), which computes zero."""
    q4_0, _, _ = _quantized_experts("q4_0", torch.bfloat16, HERE)
    expected = {"down_proj_packed", "down_proj_scale", "gate_up_proj_packed", "gate_up_proj_scale"}
    assert set(dict(q4_0.named_buffers())) == (expected if HERE.native_kernels else {
        name.replace("_scale", "_scale_zero") for name in expected})
    generator = torch.Generator().manual_seed(1)
    gate_up = [quantize_int4(torch.randn(2 * INTER, H, generator=generator), 32) for _ in range(E)]
    down = [quantize_int4(torch.randn(H, INTER, generator=generator), 32) for _ in range(E)]
    gate_up[3] = quantize_int4(torch.zeros(2 * INTER, H), 32)  # scale 0, zero 0: symmetric
    assert not gate_up[3].zero.any()
    packed = QuantizedExperts(gate_up, down, torch.bfloat16, HERE)
    assert "gate_up_proj_scale_zero" in dict(packed.named_buffers())
    with torch.no_grad():
        assert not packed.linear("gate_up_proj", 3)(torch.randn(2, H).bfloat16()).any()


def test_packed_experts_take_one_format_per_projection_and_check_shapes():
    w = torch.randn(2 * INTER, H)
    down = [quantize_int8(torch.randn(H, INTER))]
    with pytest.raises(ValueError, match=r"gate_up matrices must share one quantized format; got \['Int4Weight', 'Int8Weight'\]"):
        QuantizedExperts([quantize_int4(w, 32), quantize_int8(w)], down * 2, torch.bfloat16, HERE)
    # Formats may differ between the projections (as a GGUF file's stacks may): int4 gate_up, int8 down.
    mixed = QuantizedExperts([quantize_int4(w, 32, torch.float32)], down, torch.float32, HERE)
    x, ids, weights = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    reference = Experts(mixed.dequantize("gate_up_proj"), mixed.dequantize("down_proj"), Platform.portable())
    torch.testing.assert_close(mixed(x, ids, weights), reference(x, ids, weights), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one gate_up and one down weight per expert"):
        QuantizedExperts([quantize_int8(w)] * 2, down, torch.bfloat16, HERE)
    with pytest.raises(ValueError, match=r"gate_up \(1, 64, 64\), down \(1, 64, 16\)"):
        QuantizedExperts([quantize_int8(w)], [quantize_int8(torch.randn(H, 16))], torch.bfloat16, HERE)


def test_int4_checks_fused_expert_stacks_before_building():
    """A fused [E, out, in] stack's input size is checked with the other linears': the error names
    the stack, as it names a dense weight."""
    prefix = "model.layers.0.mlp.experts"
    tensors = {f"{prefix}.gate_up_proj": torch.randn(E, 2 * INTER, H), f"{prefix}.down_proj": torch.randn(E, H, INTER)}
    source = {name: (lambda t=t: t) for name, t in tensors.items()}
    with pytest.raises(TuiliError, match=rf"{prefix}\.down_proj has 32 inputs \(32 % 64 = 32\).*fit every layer: 32"):
        WeightPlan(HERE, torch.float32, source, {}, "test", quantization="int4", group_size=64)
    plan = WeightPlan(HERE, torch.float32, source, {}, "test", quantization="int4", quantized_dtype=torch.float32)
    experts = plan.experts(prefix, E, H, INTER)
    assert isinstance(experts, QuantizedExperts) and type(experts.linear("gate_up_proj", 3)) is Int4Linear
    # expert by expert, as a dense linear of that weight is quantized
    expected = torch.stack([quantize_int4(w, 32, torch.float32).dequantize() for w in tensors[f"{prefix}.down_proj"]])
    torch.testing.assert_close(experts.dequantize("down_proj"), expected, atol=1e-6, rtol=1e-6)
