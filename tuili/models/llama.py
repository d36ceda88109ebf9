"""The Llama-family decoder: Llama (incl. Llama 3 RoPE scaling), Mistral, Qwen2, Qwen3, Qwen3-MoE.

This file describes the network and nothing else: the differences between the family
members are flags on ModelConfig (q/k/v bias, q/k RMSNorm, tied embeddings, and `moe`: which
layers' MLP is a mixture of experts, tuili/layers/moe.py). Module paths
follow the Hugging Face checkpoints. The model is built whole: each linear, the embedding and
the output head come from the loader's weight plan (tuili/models/weights.py: float, AMX
layout, int8/int4, GGUF blocks), every layer computes on the platform and the attention backend
it is given, and nothing is replaced after construction.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.config import ModelConfig
from tuili.layers.activation import silu_and_mul
from tuili.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tuili.layers.moe import SparseMoE
from tuili.layers.norm import RMSNorm
from tuili.layers.rotary import RotaryEmbedding, norm_and_rotate
from tuili.models.weights import WeightPlan

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin at this step's positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: WeightPlan, backend: AttentionBackend, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections as one matmul (checkpoints' q_proj/k_proj/v_proj rows stacked).
        self.qkv_proj = plan.linear(f"{prefix}.qkv_proj", cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = plan.linear(f"{prefix}.o_proj", cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, plan.platform)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, plan.platform)
        self.platform, self.backend = plan.platform, backend
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        # Bound by the runner once the KV pool exists.
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k, v = norm_and_rotate(qkv, self.num_heads, self.num_kv_heads, norms, rope, self.platform)
        assert self.kv_cache is not None, "the runner binds the KV cache before the first forward"
        self.backend.store(self.kv_cache, k, v, meta.slot_mapping)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU: the dense layers' MLP, and the shared expert of a mixture of experts."""

    def __init__(
        self, plan: WeightPlan, prefix: str, hidden: int, intermediate: int, bias: bool, reduce: bool = True
    ) -> None:
        super().__init__()
        # gate and up projections as one matmul (checkpoints' gate_proj/up_proj rows stacked).
        self.gate_up_proj = plan.linear(f"{prefix}.gate_up_proj", hidden, 2 * intermediate, bias)
        # `reduce`: under tensor parallelism, sum the output over the ranks here (not for a
        # shared expert, whose partial output is summed with the routed experts').
        self.down_proj = plan.linear(f"{prefix}.down_proj", intermediate, hidden, bias, reduce=reduce)
        self.platform = plan.platform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.platform))


def sparse_moe(cfg: ModelConfig, plan: WeightPlan, prefix: str) -> nn.Module:
    """A mixture-of-experts MLP: the router `gate`, the routed experts (float or packed, as the plan holds them) and,
    where the config has one, the shared expert with its sigmoid gate. Under tensor parallelism
    each rank's experts hold its share of their channels: the layer's output is summed once."""
    moe = cfg.moe
    assert moe is not None
    hidden, inter = cfg.hidden_size, moe.intermediate_size
    experts = plan.experts(f"{prefix}.experts", moe.num_experts, hidden, inter)
    shared, shared_gate = None, None
    if moe.shared_intermediate_size:
        shared = MLP(plan, f"{prefix}.shared_expert", hidden, moe.shared_intermediate_size, bias=False, reduce=False)
        shared_gate = plan.linear(f"{prefix}.shared_expert_gate", hidden, 1, bias=False)
    router = plan.linear(f"{prefix}.gate", hidden, moe.num_experts, bias=False)
    return plan.summed_over_ranks(SparseMoE(router, experts, moe.top_k, moe.norm_topk_prob, shared, shared_gate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: WeightPlan, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)
        self.self_attn = Attention(cfg, plan, backend, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            self.mlp = sparse_moe(cfg, plan, f"{prefix}.mlp")
        else:
            self.mlp = MLP(plan, f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the first layer:
        the embeddings, residual None). Returns this layer's output and the residual stream, so
        that each add is fused with the RMSNorm after it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, plan: WeightPlan, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = plan.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, tied=cfg.tie_word_embeddings)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, plan, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.run_layers(*self.embed(input_ids, positions), meta)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """The step's lookups: token embeddings and the rotary tables at `positions`."""
        return self.embed_tokens(input_ids), self.rotary.tables(positions)

    def run_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers and the final norm over embeddings `x`. x may be overwritten."""
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """forward() returns final hidden states for every token; compute_logits() projects the
    few rows that are sampled, so a long prefill never materialises [T, vocab] logits. The
    output head (tuili/layers/logits.py) holds the output matrix: the embedding table when
    tied, `lm_head.weight` otherwise, float or quantized, with or without a decode copy."""

    # Modules that stack several checkpoint tensors, in order, along the output dimension.
    stacked_projections = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, max_positions: int, plan: WeightPlan, attention: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.platform, self.attention = plan.platform, attention
        self.model = LlamaModel(cfg, max_positions, plan, attention)
        self.lm_head = plan.output_head("lm_head", self.model.embed_tokens, cfg.tie_word_embeddings)
        if cfg.tie_word_embeddings:
            self.model.embed_tokens = plan.token_lookup(self.model.embed_tokens, self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """forward() in two parts, for callers that keep the step's inputs in fixed buffers (CPU
        graphs): the lookups, then `run_layers` on what they return."""
        return self.model.embed(input_ids, positions)

    def run_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.run_layers(x, rope, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows of `hidden`."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def linear_attention_layers(self) -> list[nn.Module]:
        """None: every layer is full attention (Qwen3NextForCausalLM has some)."""
        return []
