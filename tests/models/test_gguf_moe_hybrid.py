"""Qwen3-MoE and Qwen3-Next GGUF files as llama.cpp writes them, against the safetensors they came
from and against transformers.

Each case writes a tiny random checkpoint with `save_pretrained` (the real Qwen3 tokenizer beside
it: llama.cpp's converter reads the vocabulary from it, so the vocabulary is Qwen3's 151,936
rows), converts it with llama.cpp's own convert_hf_to_gguf.py (llama-cpp-python 0.3.36's, fetched
by scripts/setup.sh test) to f32 and to q8_0, and checks:
- the f32 file: logits equal to transformers' and to the safetensors checkpoint's in tuili, and
  greedy tokens equal to transformers';
- the q8_0 file: logits equal to transformers' run on the file's weights as gguf-py's own
  quantize/dequantize makes them (Q8_0 where the file is Q8_0, F16 where it fell back to F16); its
  split projection (qkvz) and its Q8_0 experts run packed in Hugging Face row order;
- Qwen3-Next's multi-token-prediction block (converted as llama.cpp converts it by default, an extra
  block) comes back as the checkpoint's mtp.* tensors.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize
from safetensors.torch import load_file, save_file

from tuili import LLM, SamplingParams
from tuili.layers.deltanet import GatedDeltaNet
from tuili.layers.moe import QuantizedExperts, SparseMoE
from tuili.layers.quant import Int8GroupLinear
from tuili.models.gguf import open_gguf
from tuili.models.weights import WeightPlan
from tuili.platform import Platform

COMMON = dict(
    vocab_size=151936,  # the Qwen3 tokenizer's ids reach 151,668; Qwen3 checkpoints have 151,936 rows
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper distributions: no near-ties for greedy to trip on
    rms_norm_eps=1e-6,
)
CONFIGS = {
    # untied output matrix; top-2 of 8 experts, renormalised (llama.cpp always renormalises)
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # 3 DeltaNet layers and 1 full attention; Hv = 2 Hk and Dv = 2 Dk, so that no q/k/v/z row
    # confusion can pass; a shared expert of width 48 (no Q8_0 block fits its down projection's
    # rows: the converter falls back to F16 for it)
    "qwen3next": lambda: transformers.Qwen3NextConfig(
        **COMMON, tie_word_embeddings=True, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    ),
}  # fmt: skip
PROMPTS = [
    [5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13],
    [42],
    list(range(30, 53)),
]
STEPS = 8


def _hf_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():  # transformers starts every norm at its identity: a norm loaded wrong would not show
        for name, param in model.named_parameters():
            if "norm" in name:
                centre = 1.0 if arch == "qwen3moe" or ".linear_attn.norm" in name else 0.0
                param.copy_(torch.randn_like(param) * 0.2 + centre)
    return model


def _mtp_tensors(cfg: transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    """A Qwen3-Next multi-token-prediction block as the published checkpoints store it: the
    projection of [embedding, hidden], its two input norms, one full-attention MoE layer (experts
    one by one) and a final norm. Random: the main network never reads it."""
    g = torch.Generator().manual_seed(1)
    h, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    layer = "mtp.layers.0."
    tensors = {
        "mtp.fc.weight": rand(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": rand(h),
        "mtp.pre_fc_norm_hidden.weight": rand(h),
        "mtp.norm.weight": rand(h),
        layer + "input_layernorm.weight": rand(h),
        layer + "post_attention_layernorm.weight": rand(h),
        layer + "self_attn.q_proj.weight": rand(2 * heads * d, h),
        layer + "self_attn.k_proj.weight": rand(kv * d, h),
        layer + "self_attn.v_proj.weight": rand(kv * d, h),
        layer + "self_attn.o_proj.weight": rand(h, heads * d),
        layer + "self_attn.q_norm.weight": rand(d),
        layer + "self_attn.k_norm.weight": rand(d),
        layer + "mlp.gate.weight": rand(cfg.num_experts, h),
        layer + "mlp.shared_expert_gate.weight": rand(1, h),
        layer + "mlp.shared_expert.gate_proj.weight": rand(shared, h),
        layer + "mlp.shared_expert.up_proj.weight": rand(shared, h),
        layer + "mlp.shared_expert.down_proj.weight": rand(h, shared),
    }
    for e in range(cfg.num_experts):
        for part, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            tensors[f"{layer}mlp.experts.{e}.{part}.weight"] = rand(*shape)
    return tensors


@pytest.fixture(scope="module", params=list(CONFIGS))
def converted(request, tmp_path_factory, real_tokenizer_dirs, llama_cpp_convert):
    """(arch, transformers model, checkpoint dir, {outtype: GGUF path})."""
    arch = request.param
    model = _hf_model(arch)
    root = tmp_path_factory.mktemp(arch)
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, hf_dir / name)
    no_mtp: tuple[str, ...] = ()
    if arch == "qwen3next":
        weights = load_file(str(hf_dir / "model.safetensors"))
        save_file(weights | _mtp_tensors(model.config), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        no_mtp = ("--no-mtp",)  # the q8_0 file without it: the converter's other mode
    files = {
        "f32": llama_cpp_convert(hf_dir, root / "f32.gguf", "f32"),
        "q8_0": llama_cpp_convert(hf_dir, root / "q8_0.gguf", "q8_0", *no_mtp),
    }
    return arch, model, hf_dir, files


def _llm(path) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20)


def test_f32_file_gives_the_safetensors_logits(converted, prompt_logits, assert_logits_match, hf_greedy):
    arch, hf, hf_dir, files = converted
    llm = _llm(files["f32"])
    assert llm.engine.runner.model.config.architecture == type(hf).__name__
    layers = llm.engine.runner.model.model.layers
    assert all(isinstance(layer.mlp, SparseMoE) for layer in layers)
    if arch == "qwen3next":
        assert [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in layers] == [
            True, True, True, False,
        ]  # fmt: skip
    ours = prompt_logits(llm, PROMPTS)
    assert_logits_match(ours, hf, PROMPTS)
    # The same network from the safetensors: the file changes nothing but float32 rounding
    # (llama.cpp stores -exp(A_log) and 1 + w for Qwen3-Next's norms).
    torch.testing.assert_close(ours, prompt_logits(_llm(hf_dir), PROMPTS), atol=2e-6, rtol=1e-6)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, STEPS)


@pytest.fixture(scope="module")
def q8_0_file(converted):
    return converted, open_gguf(converted[3]["q8_0"])


def _as_stored(tensor: torch.Tensor, qtype: Q) -> torch.Tensor:
    """`tensor` rounded as a file of type `qtype` stores it, by gguf-py's reference code (blocks
    run along the last dimension, the rows the converter quantized: splitting or stacking rows
    changes no block)."""
    data = tensor.detach().float().numpy()
    if qtype == Q.F32:
        return tensor.detach().float()
    if qtype == Q.F16:
        return torch.from_numpy(data.astype(np.float16).astype(np.float32))
    return torch.from_numpy(reference_dequantize(reference_quantize(data, qtype), qtype).reshape(data.shape))


def test_q8_0_file_matches_transformers_on_its_weights(q8_0_file, prompt_logits, assert_logits_match):
    (arch, hf, _, files), ckpt = q8_0_file
    types = {name: {p.ggml_type for p in ckpt.tensor_info(name).parts} for name in ckpt.tensor_names()}
    assert types["model.layers.0.mlp.experts.gate_up_proj"] == {Q.Q8_0}
    assert types["model.layers.0.mlp.experts.down_proj"] == {Q.Q8_0}
    if arch == "qwen3next":
        assert types["model.layers.0.linear_attn.in_proj_qkvz.weight"] == {Q.Q8_0}
        assert types["model.layers.0.mlp.shared_expert.down_proj.weight"] == {Q.F16}
    reference = copy.deepcopy(hf)
    state = reference.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if name == "lm_head.weight" and hf.config.tie_word_embeddings:
                continue
            (qtype,) = types[name]
            tensor.copy_(_as_stored(tensor, qtype))
    llm = _llm(files["q8_0"])  # float32 asked for by name: every weight dequantized at load
    float_logits = prompt_logits(llm, PROMPTS)
    # float32 rounding, with a little more room than the default 2e-5: on an Intel Xeon with AMX
    # (oneDNN's float32 reduction order there) two of Qwen3-Next's 3.5 million logits were 2.13e-5
    # from transformers'; on AMD Zen 5 all within 2e-5.
    assert_logits_match(float_logits, reference, PROMPTS, atol=3e-5, rtol=1e-4)

    # The experts as the loader holds a GGUF file run packed: the Q8_0 blocks as stored, in the
    # int8-group layout (no float copy). With float32 compute (the exact path) the logits must
    # still match transformers'.
    cfg = hf.config
    plan = WeightPlan(Platform.detect(), torch.float32, {}, {}, str(files["q8_0"]), quantized_dtype=torch.float32,
                      gguf_packed=ckpt)  # fmt: skip
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        layer.mlp.experts = plan.experts(
            f"model.layers.{i}.mlp.experts", cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        )
        assert isinstance(layer.mlp.experts, QuantizedExperts) and not list(layer.mlp.experts.parameters())
        assert type(layer.mlp.experts.linear("gate_up_proj", 0)) is Int8GroupLinear
    assert_logits_match(prompt_logits(llm, PROMPTS), reference, PROMPTS)

    if arch != "qwen3moe":  # the loader's default below is one path for both: checked once
        return
    # As `LLM` loads the file by default on a CPU: the experts packed, computing in bf16.
    packed = LLM(model=str(files["q8_0"]), device="cpu", block_size=4, kv_cache_memory=1 << 20)
    assert packed.engine.weights_quantized == "gguf"
    for layer in packed.engine.runner.model.model.layers:
        assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.compute_dtype == torch.bfloat16
    packed_logits = prompt_logits(packed, PROMPTS)
    error = (packed_logits - float_logits).abs() / float_logits.std()
    agree = (packed_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    assert error.mean() < 0.1 and agree >= 0.9, (error.mean(), agree)  # the packed SmolLM2's bounds


@pytest.mark.parametrize("converted", ["qwen3next"], indirect=True)  # qwen3moe splits no projection
def test_split_projection_runs_packed_in_hf_row_order(q8_0_file):
    _, ckpt = q8_0_file
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    assert ckpt.runs_packed(name)
    packed = ckpt.quantized_tensor(name)
    assert torch.equal(packed.dequantize(), ckpt.load_tensor(name))
    # A stack of experts runs packed too: its [E * 2I, H] rows, per expert the gate rows then the
    # up rows, as the dequantized stack has them.
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert ckpt.runs_packed(name)
    stack = ckpt.load_tensor(name)
    assert torch.equal(ckpt.quantized_tensor(name).dequantize(), stack.reshape(-1, stack.shape[-1]))


@pytest.mark.parametrize("converted", ["qwen3next"], indirect=True)  # the one with an MTP block
def test_mtp_block_comes_back_as_the_checkpoint_tensors(converted):
    _, hf, hf_dir, files = converted
    ckpt = open_gguf(files["f32"])
    assert ckpt.metadata("qwen3next.block_count") == 5 and ckpt.config["num_hidden_layers"] == 4
    stored = {name: t for name, t in load_file(str(hf_dir / "model.safetensors")).items() if name.startswith("mtp.")}
    ours = {name for name in ckpt.tensor_names() if name.startswith("mtp.")}
    experts = "mtp.layers.0.mlp.experts"
    per_expert = {name for name in stored if name.startswith(experts + ".")}
    assert ours == (set(stored) - per_expert) | {f"{experts}.gate_up_proj", f"{experts}.down_proj"}
    for name in ours - {f"{experts}.gate_up_proj", f"{experts}.down_proj"}:
        if name.endswith("norm.weight") or "norm_" in name:
            # stored as 1 + w: what a forward pass computes with is equal
            assert torch.equal(ckpt.load_tensor(name) + 1, stored[name] + 1), name
        else:
            assert torch.equal(ckpt.load_tensor(name), stored[name]), name
    count = hf.config.num_experts
    gate_up = torch.stack(
        [torch.cat([stored[f"{experts}.{e}.gate_proj.weight"], stored[f"{experts}.{e}.up_proj.weight"]]) for e in range(count)]
    )
    assert torch.equal(ckpt.load_tensor(f"{experts}.gate_up_proj"), gate_up)
    down = torch.stack([stored[f"{experts}.{e}.down_proj.weight"] for e in range(count)])
    assert torch.equal(ckpt.load_tensor(f"{experts}.down_proj"), down)


# -- Qwen3.5: the tensors and the config, to the value ------------------------------------------

QWEN35_CONFIGS = {
    "qwen35": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, tie_word_embeddings=True, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    ),
    "qwen35moe": lambda: transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in COMMON.items() if k != "intermediate_size"}, tie_word_embeddings=False,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(QWEN35_CONFIGS))
def test_qwen35_file_holds_the_checkpoint_tensors(arch, tmp_path, real_tokenizer_dirs, llama_cpp_convert,
                                                  prompt_logits, assert_logits_match):
    """Hv = 2 Hk: the converter stores the value heads tiled over the key heads (in_proj_qkv's v
    rows, in_proj_z, in_proj_b/a, A_log, dt_bias, conv1d's v channels, out_proj's columns);
    every tensor must come back in Hugging Face's grouped order."""
    torch.manual_seed(0)
    config = QWEN35_CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if ".linear_attn.norm" in name else 0.0))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, hf_dir / name)
    # --no-mtp: this checkpoint has no MTP block, which the converter otherwise insists on
    ckpt = open_gguf(llama_cpp_convert(hf_dir, tmp_path / "f32.gguf", "f32", "--no-mtp"))
    assert ckpt.config["architectures"] == [type(model).__name__]
    for key in ("num_hidden_layers", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim",
                "num_key_value_heads", "tie_word_embeddings"):  # fmt: skip
        assert ckpt.config[key] == getattr(config, key), key
    assert ckpt.config["partial_rotary_factor"] == config.rope_parameters["partial_rotary_factor"]
    if arch == "qwen35moe":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            assert ckpt.config[key] == getattr(config, key), key
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert set(ckpt.tensor_names()) == set(state)
    for name, tensor in state.items():
        ours = ckpt.load_tensor(name)
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            assert torch.equal(ours + 1, tensor + 1), name  # stored as 1 + w
        else:
            torch.testing.assert_close(ours, tensor, atol=1e-7, rtol=1e-6, msg=name)  # A_log: log(exp(x))
    # ... and tuili's Qwen3.5 network on the file gives transformers' logits (to 1e-4: the file's
    # A_log is log(exp(x)), a few ulps off, and the perturbed norms above amplify rounding).
    assert_logits_match(prompt_logits(_llm(tmp_path / "f32.gguf"), PROMPTS), model, PROMPTS, atol=1e-4, rtol=1e-4)
    if arch == "qwen35":
        # q8_0: the reordered projections run packed, their blocks moved whole (Dv = 32, one block)
        packed = open_gguf(llama_cpp_convert(hf_dir, tmp_path / "q8_0.gguf", "q8_0", "--no-mtp"))
        for name in ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight"):
            name = f"model.layers.0.{name}"
            assert packed.runs_packed(name), name
            assert torch.equal(packed.quantized_tensor(name).dequantize(), packed.load_tensor(name)), name
