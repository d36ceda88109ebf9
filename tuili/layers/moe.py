"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and (with a shared expert) Qwen3-Next and
Qwen3.5-MoE: a router scores every expert for each token, the token goes through its top-k
experts (SwiGLU MLPs), and their outputs are summed with the routing weights.

Routing follows the reference (transformers' TopKRouter) dtype for dtype: the router's logits in
the working dtype, softmax in float32, top-k, renormalised over the k when `norm_topk_prob`, and
the weights rounded back to the working dtype before they scale the experts' outputs.

The experts run grouped: the (token, expert) pairs are sorted by expert, so each expert's tokens
are one contiguous block of rows, and each expert that has tokens multiplies its block once
(`tuili.layers.linear.linear`: the native GEMV for a few rows, oneDNN for many). The Python loop
is over experts, never over tokens; an expert no token picked costs nothing. The outputs are
added back per token in expert order, as the reference's loop over experts adds them.

The weights come from outside (the loader's weight plan builds the router and the shared expert
as linears and stacks the experts' matrices); this module only computes.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.layers.activation import silu_and_mul
from tuili.layers.linear import linear
from tuili.platform import Platform


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64),
    the k most probable experts of each token in decreasing probability. Probabilities are a
    float32 softmax over all E experts; `normalize` rescales the k chosen ones to sum to 1."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class Experts(nn.Module):
    """The routed experts of one layer, each a SwiGLU MLP, stacked along a leading expert
    dimension: `gate_up_proj` [E, 2I, H] (expert e's gate rows, then its up rows) and
    `down_proj` [E, H, I], float and contiguous, so expert e's matrices are contiguous row-major
    views that every linear kernel takes as they are. The parameter names are transformers'
    (model.layers.N.mlp.experts.gate_up_proj / down_proj)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, platform: Platform) -> None:
        super().__init__()
        num, two_inter, hidden = gate_up.shape
        if two_inter % 2 or tuple(down.shape) != (num, hidden, two_inter // 2):
            raise ValueError(
                f"expert weights do not fit together: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}; "
                f"expected [E, 2I, H] and [E, H, I]"
            )
        self.num_experts, self.hidden_size, self.intermediate_size = num, hidden, two_inter // 2
        self.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
        self.platform = platform

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts [T, k] expert ids; weights [T, k] in x's dtype -> [T, H]: per token
        the sum over its k experts of weight * expert(x)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        # Rows sorted by expert; the stable sort keeps each expert's tokens in token order.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # the token of each sorted row
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            block = rows[start : start + n]
            h = silu_and_mul(linear(block, self.gate_up_proj[e], platform=self.platform), self.platform)
            out[start : start + n] = linear(h, self.down_proj[e], platform=self.platform)
            start += n
        out.mul_(weights.reshape(-1)[order].unsqueeze(-1))
        # index_add_ visits the rows in order: each token's experts are added in increasing id,
        # as the reference adds them.
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


class SparseMoE(nn.Module):
    """Router (`gate`: a linear hidden -> E logits) -> top-k -> grouped experts, plus, when given,
    a shared expert that every token passes through, scaled by sigmoid(`shared_expert_gate`(x))
    (a linear hidden -> 1), as Qwen2-MoE and Qwen3-Next add it. Module names are the checkpoints'."""

    def __init__(
        self,
        gate: nn.Module,
        experts: Experts,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts.num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({experts.num_experts})")
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("a shared expert comes with its gate: give both or neither")
        self.gate = gate
        self.experts = experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.gate(flat), self.top_k, self.norm_topk_prob)
        out = self.experts(flat, experts, weights)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)
