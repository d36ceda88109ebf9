"""Qwen3-Next and Qwen3.5 (dense and MoE): a hybrid decoder. Per `layer_types`, each layer's
token mixer is either Gated DeltaNet linear attention (tuili/layers/deltanet.py, per-sequence
state in fixed slots) or gated full attention over the paged KV cache; the MLP is a mixture of
experts with a shared expert (tuili/layers/moe.py, `ModelConfig.moe`) or dense where the config
says so.

This file describes the network and nothing else. What differs from the Llama family: RMSNorm
weights stored centred on zero (scale 1 + w, `OffsetRMSNorm`) for the layer norms, the final norm
and q/k norms; the full attention's q_proj also yields a per-head output gate (rows [q, gate] per
head), applied as sigmoid(gate) before o_proj; RoPE rotates only the first `rotary_dim`
dimensions of each head (partial_rotary_factor). Module paths follow the Hugging Face
checkpoints.

Qwen3.5 is the same network with two differences, both taken as parameters rather than copies:
- its DeltaNet input projections are stored apart and flat (in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a) where Qwen3-Next fuses them grouped by key head (in_proj_qkvz, in_proj_ba): the
  weight plan stacks Qwen3.5's into the same two matmuls (`Qwen3_5ForCausalLM.stacked_projections`)
  and the layer reads the flat layout;
- its rotary embedding is multimodal (mrope: sections of the frequencies follow temporal, height
  and width positions). For text all three positions are the token's position, which makes mrope
  the ordinary (partial) RoPE computed here.
Qwen3.5-MoE's router always renormalises its top-k weights and every layer is a mixture of experts
(tuili/config.py reads it so); Qwen3.5 dense has a SwiGLU MLP in every layer.

Multi-token-prediction weights (`mtp.*`) are not part of this network's forward; they are loaded
and held by `model.mtp` (tuili/models/mtp.py), and `build_mtp` makes the MTP network of them for
speculative decoding (`mtp_forward` runs it with this model's embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from tuili import kernels
from tuili.config import ModelConfig
from tuili.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tuili.layers.deltanet import GatedDeltaNet
from tuili.layers.norm import OffsetRMSNorm, fused_elementwise
from tuili.layers.rotary import RotaryEmbedding, apply_partial_rotary
from tuili.models.llama import MLP, Rope, sparse_moe
from tuili.models.mtp import PREFIX, MultiTokenPredictor, mtp_layer_count, multi_token_prediction_weights
from tuili.models.weights import WeightPlan


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: WeightPlan, backend: AttentionBackend, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q_proj (2 * q_size rows: per head its query, then its gate), k_proj, v_proj as one matmul.
        self.qkv_proj = plan.linear(f"{prefix}.qkv_proj", cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, False)
        self.o_proj = plan.linear(f"{prefix}.o_proj", self.q_size, cfg.hidden_size, False)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, plan.platform)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, plan.platform)
        self.backend = backend
        self.platform = plan.platform
        self.scale = cfg.head_dim**-0.5
        # Bound by the runner once the KV pool exists.
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        assert self.kv_cache is not None, "the runner binds the KV cache before the first forward"
        if fused_elementwise(self.platform, qkv, self.q_norm.weight):
            # One native pass: q normed and rotated into a tensor of its own (its heads sit between
            # the gates), k in place; k, v and the gates stay views of qkv.
            heads = qkv.view(tokens, 2 * self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q = qkv.new_empty(tokens, self.num_heads, self.head_dim)
            cos, sin = rope
            kernels.qk_norm_rope(
                heads, self.num_heads, self.q_norm.weight, self.k_norm.weight, cos.view(tokens, -1),
                sin.view(tokens, -1), self.q_norm.eps, offset=True, q_step=2, q_out=q,
            )  # fmt: skip
            k, v = heads[:, 2 * self.num_heads :].split([self.num_kv_heads, self.num_kv_heads], dim=1)
            self.backend.store(self.kv_cache, k, v, meta.slot_mapping)
            out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale).contiguous()
            kernels.sigmoid_gate(out, heads[:, 1 : 2 * self.num_heads : 2])
            return self.o_proj(out.view(tokens, self.q_size))
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), rope)
        k = apply_partial_rotary(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), rope)
        # Contiguous like k (normed and rotated, so a new tensor): backends store k and v a token apart alike.
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()
        self.backend.store(self.kv_cache, k, v, meta.slot_mapping)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale).reshape(tokens, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, self.q_size)))


def gated_deltanet(cfg: ModelConfig, plan: WeightPlan, prefix: str) -> GatedDeltaNet:
    lin = cfg.linear
    assert lin is not None
    key_dim, value_dim = lin.num_k_heads * lin.head_k_dim, lin.num_v_heads * lin.head_v_dim
    return GatedDeltaNet(
        plan.linear(f"{prefix}.in_proj_qkvz", cfg.hidden_size, 2 * key_dim + 2 * value_dim, False),
        plan.linear(f"{prefix}.in_proj_ba", cfg.hidden_size, 2 * lin.num_v_heads, False),
        plan.linear(f"{prefix}.out_proj", value_dim, cfg.hidden_size, False),
        lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.conv_kernel, cfg.rms_norm_eps,
        plan.platform,
        # Qwen3-Next stores the projections fused per key head; Qwen3.5 stores them flat.
        grouped_by_key_head=cfg.family == "qwen3_next",
    )  # fmt: skip


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, plan: WeightPlan, backend: AttentionBackend, prefix: str, linear: bool, sparse: bool,
    ) -> None:  # fmt: skip
        """The layer whose weights are `{prefix}.*`: Gated DeltaNet (`linear`) or gated full
        attention, then a mixture of experts (`sparse`) or a dense MLP."""
        super().__init__()
        self.linear = linear
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)
        # Exactly one token mixer, under the checkpoint's name for it.
        if self.linear:
            self.linear_attn = gated_deltanet(cfg, plan, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, plan, backend, f"{prefix}.self_attn")
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)
        self.mlp: nn.Module
        if sparse:
            self.mlp = sparse_moe(cfg, plan, f"{prefix}.mlp")
        else:
            self.mlp = MLP(plan, f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama layer: returns this layer's output and the residual stream."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.linear:
            assert meta.states is not None, "the runner gives hybrid models the step's state slots"
            mixed = self.linear_attn(h, meta.states)
        else:
            mixed = self.self_attn(h, rope, meta)
        h, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(h), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, plan: WeightPlan, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = plan.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, tied=cfg.tie_word_embeddings)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, plan, backend, f"model.layers.{i}", cfg.layer_types[i] == "linear_attention",
                               cfg.moe is not None and cfg.moe.sparse_layers[i])
            for i in range(cfg.num_layers)
        )  # fmt: skip
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        return self.embed_tokens(input_ids), self.rotary.tables(positions)

    def run_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]


class Qwen3NextForCausalLM(nn.Module):
    """The interface of LlamaForCausalLM (forward -> final hidden states, compute_logits on the
    sampled rows, attention_layers for the KV pool), plus linear_attention_layers for the state
    slots. `mtp` holds the checkpoint's multi-token-prediction weights (None without any)."""

    stacked_projections = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, max_positions: int, plan: WeightPlan, attention: AttentionBackend) -> None:
        super().__init__()
        if not cfg.is_hybrid or cfg.rotary_dim is None:
            raise ValueError(f"{type(self).__name__} needs a config read as a hybrid (layer types, linear attention)")
        self.config = cfg
        self.platform, self.attention = plan.platform, attention
        self.model = Qwen3NextModel(cfg, max_positions, plan, attention)
        self.lm_head = plan.output_head("lm_head", self.model.embed_tokens, cfg.tie_word_embeddings)
        if cfg.tie_word_embeddings:
            self.model.embed_tokens = plan.token_lookup(self.model.embed_tokens, self.lm_head)
        self.mtp = multi_token_prediction_weights(plan)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.run_layers(*self.model.embed(input_ids, positions), meta)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        return self.model.embed(input_ids, positions)

    def run_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.run_layers(x, rope, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows of `hidden`."""
        return self.lm_head(hidden)

    def build_mtp(self) -> MultiTokenPredictor:
        """The runnable MTP network from the held `mtp.*` weights (floats, in the working dtype):
        its decoder layers are this model's full-attention layers, a mixture of experts where the
        model has one. The embedding and output head stay the model's (`mtp_forward`)."""
        held = self.mtp
        if held is None:
            raise ValueError(f"{type(self).__name__} has no mtp.* weights")
        tensors = {f"{PREFIX}{name}": (lambda t=t: t) for name, t in held.named_buffers()}
        some = next(iter(tensors.values()))()
        plan = WeightPlan(self.platform, some.dtype, tensors, self.stacked_projections, "the held mtp.* weights")
        cfg, eps, platform = self.config, self.config.rms_norm_eps, self.platform
        layers = [
            HybridDecoderLayer(cfg, plan, self.attention, f"{PREFIX}layers.{i}", False, cfg.moe is not None)
            for i in range(mtp_layer_count(held))
        ]
        norms = [OffsetRMSNorm(cfg.hidden_size, eps, platform) for _ in range(3)]
        mtp = MultiTokenPredictor(plan.linear(f"{PREFIX}fc", 2 * cfg.hidden_size, cfg.hidden_size, False), *norms[:2],
                                  layers, norms[2])
        named = nn.Module()  # so that the norms' parameter names are the checkpoint's (mtp.*)
        named.add_module(PREFIX.rstrip("."), mtp)
        plan.fill(named)
        return mtp

    def mtp_forward(
        self, mtp: MultiTokenPredictor, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
        meta: AttentionMetadata, step: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """One MTP step at `positions`: the tokens after them (`next_ids`) and the hidden states
        at them; returns the normed output, whose compute_logits predict the token after next."""
        embeds, rope = self.model.embed(next_ids, positions)
        return mtp(embeds, hidden, rope, meta, step)

    def attention_layers(self) -> list[GatedAttention]:
        """The full-attention layers, in order: the ones with a KV cache."""
        return [layer.self_attn for layer in self.model.layers if not layer.linear]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The Gated DeltaNet layers, in order: the ones with state slots."""
        return [layer.linear_attn for layer in self.model.layers if layer.linear]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 and Qwen3.5-MoE: the same network; the weight plan stacks the checkpoint's separate
    DeltaNet projections into the two matmuls the layer runs (in the layer's flat layout)."""

    stacked_projections = Qwen3NextForCausalLM.stacked_projections | {
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    }
