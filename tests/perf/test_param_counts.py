"""Parameter counts of real configs against the models transformers instantiates from them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tuili.perf.cost import ModelCost

# config.json files as published (fields the count does not depend on trimmed).
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
}
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "attention_bias": False,
    "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28, "torch_dtype": "bfloat16",
}
# A Qwen3.5 hybrid as transformers writes it: a multimodal wrapper whose text_config has 64
# layers, every fourth full attention (4 KV heads x 256), the rest Gated DeltaNet
# (16 key heads, 48 value heads of 128). The shape seed 000 describes for its 27B model.
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "tie_word_embeddings": False,
    },
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152},
}
# Qwen3-Next-80B-A3B: hybrid attention and a 512-expert MoE with a shared expert.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "vocab_size": 151936, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None, "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}
# A Qwen3-MoE config as transformers 5 writes it (num_local_experts, not num_experts), with a dense
# layer by mlp_only_layers and only every second layer sparse by decoder_sparse_step.
QWEN3_MOE_V5_WRITTEN = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 384,
    "num_attention_heads": 4, "num_hidden_layers": 6, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
    "num_local_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 96, "decoder_sparse_step": 2,
    "mlp_only_layers": [3], "norm_topk_prob": True, "tie_word_embeddings": False,
}
# Optional fields left out, so transformers' defaults apply (Mistral: 8 KV heads, window 4096).
MISTRAL_MINIMAL = {
    "model_type": "mistral", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
    "num_hidden_layers": 4, "vocab_size": 32768,
}
LLAMA_WITH_BIASES = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
    "num_hidden_layers": 3, "vocab_size": 1000, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
}


def transformers_count(config: dict) -> int:
    """Parameters of the causal LM transformers builds from ``config`` (its language model only)."""
    cfg = AutoConfig.for_model(**config)
    cfg = getattr(cfg, "text_config", None) or cfg
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config",
    [LLAMA_2_7B, LLAMA_3_8B, QWEN3_0_6B, QWEN2_5_7B, QWEN3_5_27B, QWEN3_NEXT_80B, MIXTRAL_8X7B, QWEN3_30B_A3B,
     QWEN3_MOE_V5_WRITTEN, MISTRAL_MINIMAL, LLAMA_WITH_BIASES],
    ids=["llama-2-7b", "llama-3-8b", "qwen3-0.6b", "qwen2.5-7b", "qwen3.5-27b", "qwen3-next-80b", "mixtral-8x7b",
         "qwen3-30b-a3b", "qwen3-moe-v5-written", "mistral-defaults", "llama-biases"],
)
def test_params_total_equals_transformers(config):
    assert ModelCost.from_config(config).params_total == transformers_count(config)


def test_parameter_kinds_add_up_and_split_as_the_model_does():
    cost = ModelCost.from_config(LLAMA_2_7B)
    kinds = cost.params_by_kind()
    assert sum(kinds.values()) == cost.params_total
    # Llama-2-7B by hand: 32 layers of q,k,v,o (4 x 4096^2) and gate,up,down (3 x 4096 x 11008).
    assert kinds["attention"] == 32 * 4 * 4096 * 4096
    assert kinds["mlp"] == 32 * 3 * 4096 * 11008
    assert kinds["embedding"] == kinds["lm_head"] == 32000 * 4096
    assert cost.params_matmul == kinds["attention"] + kinds["mlp"] + kinds["lm_head"]


def test_moe_active_parameters_count_top_k_experts():
    cost = ModelCost.from_config(QWEN3_30B_A3B)
    kinds = cost.params_by_kind()
    routed = kinds["experts"] * 8 / 128
    assert cost.params_active == pytest.approx(kinds["attention"] + kinds["router"] + routed + kinds["lm_head"])
    assert 3.0e9 < cost.params_active < 3.5e9  # "A3B": about 3 billion active
