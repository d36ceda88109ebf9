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

The experts' matrices are held one of two ways, both stacked along a leading expert dimension:
`Experts`, floats [E, out, in]; `QuantizedExperts`, each expert's matrices in the packed layout
the dense quantized linears run (tuili/layers/quant: the int4 tiles for int4, GGUF Q4_0 and Q4_1;
the int8-group layout for GGUF Q8_0; int8 rows for int8), one buffer per projection and kind of
stored number ([E, ...]: codes, scales), expert e's part a contiguous slice. Each expert with
tokens multiplies its block through a QuantizedLinear whose buffers are views of those slices,
so the experts take exactly the dense quantized linears' kernels (the native gemv or tiled
dequantize-then-matmul on CPUs with tuili's kernels, torch's ops or the torch tiled fallback
elsewhere) and their choice by row count.

The weights come from outside (the loader's weight plan builds the router and the shared expert
as linears and stacks or quantizes the experts' matrices); this module only computes.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.layers.activation import silu_and_mul
from tuili.layers.linear import linear
from tuili.layers.quant import Int4Weight, QuantizedLinear, QuantizedWeight, int6_fits, make_linear
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


class RoutedExperts(nn.Module):
    """The routed experts of one layer, each a SwiGLU MLP (gate_up: [2I, H], expert e's gate rows
    then its up rows; down: [H, I]), run grouped. Subclasses hold the matrices, every weight
    tensor stacked along a leading expert dimension of `num_experts` (what a decode step's byte
    count scales by top_k / num_experts), and run one expert's projection on a block of rows."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    platform: Platform

    def _gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
            out[start : start + n] = self._down(e, silu_and_mul(self._gate_up(e, block), self.platform))
            start += n
        out.mul_(weights.reshape(-1)[order].unsqueeze(-1))
        # index_add_ visits the rows in order: each token's experts are added in increasing id,
        # as the reference adds them.
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


def _check_shapes(gate_up: tuple[int, ...], down: tuple[int, ...]) -> tuple[int, int, int]:
    """(E, H, I) from the stacked shapes gate_up [E, 2I, H] and down [E, H, I], checked."""
    num, two_inter, hidden = gate_up
    if two_inter % 2 or tuple(down) != (num, hidden, two_inter // 2):
        raise ValueError(
            f"expert weights do not fit together: gate_up {tuple(gate_up)}, down {tuple(down)}; "
            f"expected [E, 2I, H] and [E, H, I]"
        )
    return num, hidden, two_inter // 2


class Experts(RoutedExperts):
    """Float experts: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], contiguous, so expert
    e's matrices are contiguous row-major views that every linear kernel takes as they are
    (`tuili.layers.linear.linear`: the native GEMV for a few rows, oneDNN for many). The
    parameter names are transformers' (model.layers.N.mlp.experts.gate_up_proj / down_proj)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, platform: Platform) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = _check_shapes(gate_up.shape, down.shape)
        self.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
        self.platform = platform

    def _gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return linear(rows, self.gate_up_proj[expert], platform=self.platform)

    def _down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return linear(rows, self.down_proj[expert], platform=self.platform)


PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantizedExperts(RoutedExperts):
    """Experts whose matrices stay quantized: `gate_up` and `down` are one QuantizedWeight per
    expert, of one format per projection (a GGUF file may store gate/up and down in different
    types), run by the module `make_linear` builds for that format.

    The stored numbers are buffers `{projection}_{buffer}` stacked [E, ...] (e.g.
    gate_up_proj_packed [E, tiles, K, 32] and gate_up_proj_scale_zero [E, K / group, N, 2] (or
    gate_up_proj_scale [E, K / group, N] where the module holds its scales alone) for
    the int4 layout), expert e's bytes the contiguous slice e. Stacking per expert (rather than
    one linear over all experts' rows) keeps each expert's int4 tiles, row padding and scale
    layout exactly those of a dense linear of its shape, so no kernel learns about experts.

    Invariant: `_linears[projection][e]` is a QuantizedLinear (not a submodule: its bytes are the
    stacked buffers', counted once) whose buffers are views of slice e of the stacked ones;
    `_apply` (.to(), .cpu(), ...) rebinds the views after it replaces the stacked tensors."""

    def __init__(
        self,
        gate_up: list[QuantizedWeight],
        down: list[QuantizedWeight],
        compute_dtype: torch.dtype,
        platform: Platform,
    ) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"expected one gate_up and one down weight per expert; got {len(gate_up)} and {len(down)}")
        for name, weights in (("gate_up", gate_up), ("down", down)):
            formats, shapes = {type(w).__name__ for w in weights}, {tuple(w.q.shape) for w in weights}
            if len(formats) != 1:  # one stacked buffer per stored number: one layout per projection
                raise ValueError(f"experts' {name} matrices must share one quantized format; got {sorted(formats)}")
            if len(shapes) != 1:
                raise ValueError(f"experts' {name} matrices differ in shape: {sorted(shapes)}")
        self.num_experts, self.hidden_size, self.intermediate_size = _check_shapes(
            (len(gate_up), *gate_up[0].q.shape), (len(down), *down[0].q.shape)
        )
        self.platform = platform
        self._linears: dict[str, list[QuantizedLinear]] = {}
        for projection, weights in zip(PROJECTIONS, (gate_up, down), strict=True):
            linears = self._linears[projection] = []
            # One buffer layout per projection: int4 scales alone only if every expert's zeros are 0.
            keep_zeros = any(isinstance(w, Int4Weight) and w.zero.any() for w in weights)
            six_bit = all(int6_fits(w, compute_dtype, platform) for w in weights)  # all experts, or none
            # Expert by expert into the stacked buffers: the layer's packed bytes plus one expert's
            # are held at a time, never a second copy of them all.
            for e, weight in enumerate(weights):
                module = make_linear(weight, None, compute_dtype, platform=platform, keep_zeros=keep_zeros,
                                     six_bit=six_bit)
                for name, tensor in list(module.named_buffers()):
                    if e == 0:
                        self.register_buffer(f"{projection}_{name}", tensor.new_empty(len(weights), *tensor.shape))
                    stacked = getattr(self, f"{projection}_{name}")
                    stacked[e].copy_(tensor)
                    module._buffers[name] = stacked[e]
                linears.append(module)

    def _bind(self) -> None:
        """Point every expert's linear at its slice of the stacked buffers (the invariant)."""
        for projection, linears in self._linears.items():
            for e, module in enumerate(linears):
                for name in list(module._buffers):
                    if module._buffers[name] is not None:
                        module._buffers[name] = getattr(self, f"{projection}_{name}")[e]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._bind()
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._linears["gate_up_proj"][0].compute_dtype

    def linear(self, projection: str, expert: int) -> QuantizedLinear:
        """The module that runs expert `expert`'s `projection` ("gate_up_proj" | "down_proj")."""
        return self._linears[projection][expert]

    def dequantize(self, projection: str) -> torch.Tensor:
        """The float32 [E, out, in] matrices the kernels compute with, for references and tests."""
        return torch.stack([m.dequantize() for m in self._linears[projection]])

    def _gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self._linears["gate_up_proj"][expert](rows)

    def _down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self._linears["down_proj"][expert](rows)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={type(self._linears['down_proj'][0]).__name__}"


class SparseMoE(nn.Module):
    """Router (`gate`: a linear hidden -> E logits) -> top-k -> grouped experts, plus, when given,
    a shared expert that every token passes through, scaled by sigmoid(`shared_expert_gate`(x))
    (a linear hidden -> 1), as Qwen2-MoE and Qwen3-Next add it. Module names are the checkpoints'."""

    def __init__(
        self,
        gate: nn.Module,
        experts: RoutedExperts,
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
