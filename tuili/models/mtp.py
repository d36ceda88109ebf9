"""Multi-token-prediction weights (`mtp.*` in Qwen3-Next and Qwen3.5 checkpoints), held and not run.

These checkpoints carry a small draft network (a projection `mtp.fc`, its input norms, one or
more decoder layers `mtp.layers.N.*` and a final norm `mtp.norm`) trained to predict the token
after next, for speculative decoding. tuili does not run speculative decoding yet; the main
network never reads these weights. They are loaded, as the checkpoint stores them, so that a
draft runner can be built on them later and so that nothing in the checkpoint is dropped.

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
