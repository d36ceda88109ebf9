"""Real bytes from checkpoint headers, and GGUF formats at the gguf package's block sizes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import quant_shape_to_byte_shape, quantize

from tuili.errors import CheckpointError
from tuili.models.default_model import default_model_path
from tuili.perf.checkpoint import read_model, tensor_kind
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "IQ4_XS", "BF16", "F16", "MXFP4"])
def test_gguf_formats_take_the_bytes_the_gguf_package_gives(qtype):
    rows, cols = 7, 1024
    byte_shape = quant_shape_to_byte_shape((rows, cols), GGMLQuantizationType[qtype])
    assert weight_format(qtype.lower()).matrix_bytes(rows, cols) == math.prod(byte_shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_1"])
def test_gguf_formats_match_real_quantized_arrays(qtype):
    data = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    assert weight_format(qtype.lower()).matrix_bytes(3, 256) == quantize(data, GGMLQuantizationType[qtype]).nbytes


def test_hf_tensor_names_map_to_kinds():
    assert tensor_kind("model.embed_tokens.weight") == "embedding"
    assert tensor_kind("lm_head.weight") == "lm_head"
    assert tensor_kind("model.layers.3.self_attn.q_proj.weight") == "attention"
    assert tensor_kind("model.layers.3.self_attn.q_norm.weight") == "norm"
    assert tensor_kind("model.layers.3.mlp.down_proj.weight_scale") == "mlp"  # a quantized weight's scale
    assert tensor_kind("model.layers.3.mlp.gate.weight") == "router"
    assert tensor_kind("model.layers.3.mlp.gate_proj.qweight") == "mlp"
    assert tensor_kind("model.layers.3.mlp.experts.gate_up_proj") == "experts"
    assert tensor_kind("model.layers.3.mlp.shared_expert_gate.weight") == "router"
    assert tensor_kind("model.language_model.layers.0.linear_attn.in_proj_qkv.weight") == "linear_attention"
    assert tensor_kind("model.language_model.layers.0.linear_attn.norm.weight") == "norm"
    assert tensor_kind("model.visual.blocks.0.attn.qkv.weight") is None
    assert tensor_kind("mtp.layers.0.self_attn.q_proj.weight") is None


@pytest.mark.parametrize("tied", [True, False])
def test_safetensors_bytes_match_the_config_and_the_tensors(tmp_path, tied):
    config = transformers.Qwen3Config(
        vocab_size=500, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=tied,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    source = read_model(tmp_path)
    stored = {name: t.nbytes for name, t in model.state_dict().items()}
    if tied:
        stored.pop("lm_head.weight")  # the same tensor as the embedding, saved once
    assert sum(source.weights.bytes_by_kind.values()) == sum(stored.values())
    cost = ModelCost.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert source.weights.bytes_by_kind == cost.weight_bytes_by_kind("bf16")
    assert cost.weight_bytes(source.weights) == cost.weight_bytes("bf16")


def test_gguf_file_bytes_are_the_real_tensor_types():
    path = default_model_path()
    source = read_model(path)
    reader_total = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert sum(source.weights.bytes_by_kind.values()) + source.weights.ignored_bytes == reader_total
    # SmolLM2-135M Q4_1: the tied embedding is Q8_0, every projection Q4_1, norms F32
    cfg = source.config
    h, v, i, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    assert source.weights.bytes_by_kind["embedding"] == weight_format("q8_0").matrix_bytes(v, h)
    assert source.weights.bytes_by_kind["mlp"] == layers * 3 * weight_format("q4_1").matrix_bytes(i, h)
    assert source.weights.bytes_by_kind["norm"] == (2 * layers + 1) * h * 4


def test_bad_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_model(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match="config.json"):
        read_model(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_model(tmp_path)
