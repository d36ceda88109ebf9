"""The Llama-family decoder: Llama (incl. Llama 3 RoPE scaling), Mistral, Qwen2, Qwen3.

This file describes the network and nothing else: the differences between the family
members are flags on ModelConfig (q/k/v bias, q/k RMSNorm, tied embeddings). Parameter
names follow the Hugging Face checkpoints so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.config import ModelConfig
from tuili.layers.activation import silu_and_mul
from tuili.layers.attention import AttentionMetadata, KVCache, paged_attention
from tuili.layers.linear import Linear, linear
from tuili.layers.norm import RMSNorm
from tuili.layers.quant import PACKED_LOGITS_MAX_ROWS, QuantizedLinear
from tuili.layers.rotary import RotaryEmbedding, norm_and_rotate

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin at this step's positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections as one matmul (checkpoints' q_proj/k_proj/v_proj rows stacked).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        # Bound by the runner once the KV pool exists.
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k, v = norm_and_rotate(qkv, self.num_heads, self.num_kv_heads, norms, rope)
        assert self.kv_cache is not None, "the runner binds the KV cache before the first forward"
        self.kv_cache.store(k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections as one matmul (checkpoints' gate_proj/up_proj rows stacked).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

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
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

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
    few rows that are sampled, so a long prefill never materialises [T, vocab] logits.

    `lm_head` is None when the embeddings are tied (the logits then read the embedding matrix),
    unless a loader installs a quantized copy of that matrix for the logits to read instead.
    `packed_logits`, when a loader sets it (GGUF files run packed), is a quantized copy of the
    output matrix for the logits of decode steps of up to PACKED_LOGITS_MAX_ROWS rows, where its
    native kernel reads fewer bytes than the float matrix; more rows keep reading the float
    matrix."""

    # Parameters that stack several checkpoint tensors, in order, along dim 0.
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head: nn.Module | None = None
        self.packed_logits: QuantizedLinear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """forward() in two parts, for callers that keep the step's inputs in fixed buffers (CPU
        graphs): the lookups, then `run_layers` on what they return."""
        return self.model.embed(input_ids, positions)

    def run_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.run_layers(x, rope, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits; from bf16 weights, unrounded where the native kernels run (linear)."""
        packed = self.packed_logits
        if (
            packed is not None
            and hidden.shape[0] <= PACKED_LOGITS_MAX_ROWS
            and packed.kernel_for(hidden.shape[0], hidden.device) == "gemv"
        ):
            return packed(hidden, out_dtype=torch.float32)
        if self.lm_head is None:
            return linear(hidden, self.model.embed_tokens.weight, out_dtype=torch.float32)
        if isinstance(self.lm_head, Linear):
            return linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
