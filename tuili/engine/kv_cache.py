"""The paged KV cache's bookkeeping: which blocks of the preallocated pool each sequence holds.

The pool itself (the tensors) lives in the runner; this module only counts block ids.
Invariant: every block id is either in the free list or in exactly one sequence's block table.
"""

from __future__ import annotations

from collections import deque

from tuili.engine.request import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold its first `num_tokens` tokens after allocating."""
        return blocks_for(num_tokens, self.block_size) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for its first `num_tokens` tokens (callers check can_grow)."""
        needed = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if needed > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, {len(self._free)} free")
        for _ in range(needed):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
