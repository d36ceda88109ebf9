"""Mean pooling over a prompt that arrives in chunks, with a result independent of the chunking.

A prompt's hidden states come a chunk per step, and where the chunks end depends on the batch
(the step's budget, its other sequences, preemption). A float sum taken chunk by chunk would
round differently for each split, so the same prompt would embed differently alone and in a
batch. Here rows are summed in fixed groups of GROUP absolute positions (0..63, 64..127, ...),
each group once it is complete (rows of an incomplete group wait for the next chunk), and the
group sums are added to the total in position order: the same additions in the same order
whatever the chunks were.
"""

from __future__ import annotations

import torch

GROUP = 64  # positions per partial sum; the rows held back between chunks are fewer than this


class MeanAccumulator:
    """The running float32 sum of one prompt's hidden states, fed in position order."""

    def __init__(self, hidden_size: int, device: torch.device) -> None:
        self.total = torch.zeros(hidden_size, dtype=torch.float32, device=device)
        self.pending: torch.Tensor | None = None  # rows of the incomplete group, float32
        self.count = 0  # positions added

    def add(self, rows: torch.Tensor) -> None:
        """Add the hidden states of the next positions (a [n, hidden] chunk)."""
        rows = rows.float()
        if self.pending is not None:
            rows = torch.cat([self.pending, rows])
            self.pending = None
        start = self.count - (self.count % GROUP)  # the first row's position (pending rows included)
        self.count = start + rows.shape[0]
        full = (rows.shape[0] // GROUP) * GROUP
        for offset in range(0, full, GROUP):
            self.total += rows[offset : offset + GROUP].sum(dim=0)
        if full < rows.shape[0]:
            self.pending = rows[full:].clone()

    def mean(self) -> torch.Tensor:
        """The mean over every position added (the incomplete group's rows summed last)."""
        total = self.total if self.pending is None else self.total + self.pending.sum(dim=0)
        return total / self.count
