"""The linear-attention state slots of a hybrid model: slot ids, no tensors (the runner owns the
state tensors, [slots, ...] per layer, and the layers index them by the ids handed out here).

A sequence takes a slot when it is admitted and gives it back when it finishes, is aborted or
is preempted. Preemption recomputes, so nothing in the slot needs keeping: the resumed sequence
takes any free slot and its first chunk (at position 0) starts the state from zero.

Invariant: every slot is either free or held by exactly one running sequence
(`Sequence.state_slot`); the scheduler admits at most as many sequences as there are slots.
"""

from __future__ import annotations

from tuili.engine.request import Sequence


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq: Sequence) -> None:
        """Give `seq` a slot (the scheduler admits no more sequences than there are slots)."""
        assert seq.state_slot is None, f"sequence {seq.seq_id} already holds slot {seq.state_slot}"
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held: admission must stop at max_num_seqs")
        seq.state_slot = self._free.pop()

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s slot, if it holds one."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
