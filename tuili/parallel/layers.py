"""The modules of a tensor-parallel network that communicate. Column-parallel linears (q/k/v,
gate/up) need none: each rank computes its heads' or channels' outputs. Each row-parallel
linear (o, down, a DeltaNet's out_proj) ends in one all-reduce, a mixture of experts in one,
the embedding lookup in one, and the logits in one gather to rank 0, which samples."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuili.layers.logits import OutputHead
from tuili.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the inputs (its heads' or channels' columns of the
    weight); the ranks' partial products are summed. The bias is held by rank 0 alone."""

    def __init__(self, local: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.group = group

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.local(x) if out_dtype is None else self.local(x, out_dtype=out_dtype)
        return self.group.all_reduce(out)


class SummedOverRanks(nn.Module):
    """A module whose output on each rank is a partial sum of the whole (a mixture of experts
    over the rank's share of every expert's channels, routed and shared experts added first),
    summed over the ranks in one all-reduce."""

    def __init__(self, local: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.local(x))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, stop) of the embedding table; a token outside them looks up
    zeros, and the sum over ranks is the whole lookup."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, group: TensorParallelGroup) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True, device=weight.device)
        self.start, self.stop, self.group = start, stop, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local_ids = torch.where(outside, 0, input_ids - self.start)
        out = F.embedding(local_ids, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """This rank's vocabulary slice of the output head; rank 0 gathers the whole logits row
    (other ranks return their slice, which nobody reads)."""

    def __init__(self, local: OutputHead, widths: list[int], group: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.widths = widths
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.local(hidden)
        gathered = self.group.gather_columns(logits, self.widths)
        return logits if gathered is None else gathered

    def weights_read(self, rows: int, device: torch.device) -> list[torch.Tensor]:
        return self.local.weights_read(rows, device)
