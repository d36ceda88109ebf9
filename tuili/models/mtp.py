"""Multi-token prediction (`mtp.*` in Qwen3-Next and Qwen3.5 checkpoints): the weights, held as
stored, and the network they make, run by speculative decoding's "mtp" method.

These checkpoints carry a small draft network (a projection `mtp.fc`, its input norms, one or
more decoder layers `mtp.layers.N.*` and a final norm `mtp.norm`) trained to predict the token
after next. The main network never reads these weights. They are loaded as the checkpoint stores
them, so that nothing in it is dropped; `MultiTokenPredictor` is built from them only when
speculative decoding asks for it (tuili/engine/spec/mtp.py).

They are held as buffers, under their checkpoint names (`model.mtp` is the checkpoint's `mtp`
prefix, `model.get_buffer("mtp.fc.weight")` its `mtp.fc.weight`), in the working dtype on the
model's device. Buffers, not parameters, on purpose: what the engine and the ruler count as the
network's weights (`model.parameters()`: the bytes a step reads, the cost model's parameter
kinds) is what a forward pass uses; the memory these take is still counted by the device's free
memory when the KV pool is sized.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.layers.attention import AttentionMetadata
from tuili.models.llama import Rope
from tuili.models.weights import WeightPlan

PREFIX = "mtp."


class HeldWeights(nn.Module):
    """A tree of modules mirroring dotted checkpoint names, each leaf tensor a buffer."""

    def hold(self, name: str, tensor: torch.Tensor) -> None:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = HeldWeights()
                module.add_module(part, child)
            module = child
        module.register_buffer(leaf, tensor)


def multi_token_prediction_weights(plan: WeightPlan) -> HeldWeights | None:
    """The checkpoint's `mtp.*` tensors in the plan's dtype on its device, or None if it has none."""
    names = sorted(name for name in plan.tensors if name.startswith(PREFIX))
    if not names:
        return None
    held = HeldWeights()
    for name in names:
        held.hold(name.removeprefix(PREFIX), plan.tensors[name]().to(device=plan.device, dtype=plan.dtype))
    return held


def mtp_layer_count(held: HeldWeights) -> int:
    """How many decoder layers (`mtp.layers.N`) the held weights have."""
    layers = held._modules.get("layers")
    return len(layers._modules) if layers is not None else 0


class MultiTokenPredictor(nn.Module):
    """The MTP step, as vLLM runs Qwen3-Next's and Qwen3.5's (qwen3_next_mtp.py, qwen3_5_mtp.py):
    for position p, the target's final hidden state h_p (after its final norm) and the embedding
    of the token at p + 1 make

        x = fc(concat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))
        y = norm(layer(x))            (a full-attention decoder layer, its own KV cache)

    whose logits through the target's output head predict the token at p + 2. Proposing k > 1
    tokens repeats the step on its own output: y and the proposed token at position p + 1. With
    several MTP layers, step j of a chain runs layer j mod n (vLLM's spec_step_idx). The embedding
    and the output head are the target's; the layers are the target's decoder layer class."""

    def __init__(
        self, fc: nn.Module, pre_fc_norm_embedding: nn.Module, pre_fc_norm_hidden: nn.Module, layers: list[nn.Module],
        norm: nn.Module,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fc = fc
        self.pre_fc_norm_embedding = pre_fc_norm_embedding
        self.pre_fc_norm_hidden = pre_fc_norm_hidden
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                step: int = 0) -> torch.Tensor:
        """embeds: [T, H] the next tokens' embeddings; hidden: [T, H] the states they follow (the
        target's, or the previous step's output). Returns the normed output [T, H]."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x, residual = self.layers[step % len(self.layers)](self.fc(x), None, rope, meta)
        return self.norm(x, residual)[0]

    def attention_layers(self) -> list[nn.Module]:
        """Each layer's attention, in order: the ones with a KV cache."""
        return [layer.self_attn for layer in self.layers]
