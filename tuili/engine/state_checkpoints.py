"""Prefix caching for hybrid models: snapshots of the linear-attention state at block boundaries,
as ids (the runner owns the tensors: checkpoint c is row `num_state_slots + c` of every linear
layer's state tensors, beside the sequences' slots).

The KV of full-attention layers is shared by blocks (tuili/engine/block_manager.py), but a linear
layer's state after a prefix is one [Hv, Dk, Dv] float32 tensor (plus the conv's last inputs)
that cannot be cut into blocks. So while a prompt is prefilled, the state after every
`interval` tokens (a multiple of the block size) is copied into a checkpoint, keyed by the
digest of the prefix's last block (which covers the whole prefix). A new sequence restores the
deepest checkpoint at or below its cached KV prefix and computes from there: its cached-token
count is the checkpoint's depth, never more than what state exists for.

Life of a checkpoint: `reserve` hands out ids for the boundaries a scheduled chunk crosses
(pending: the step's forward writes them); `commit`, after the forward, files them under their
prefix digest (a duplicate digest gives its id straight back); `reset_pending` gives back the
ids of a step that never completed (an error in the forward), so nothing leaks. Committed
checkpoints belong to the cache, not to a sequence: finishing, aborting or preempting a
sequence frees nothing here, and a restore copies the checkpoint into the sequence's slot
before the forward. Checkpoints are evicted least recently used first (a hit counts as a use)
when a reserve finds no free id. A checkpoint whose KV blocks were evicted is merely never
matched again until it ages out.

Host tier (`num_host_checkpoints`, from kv_offload_memory, as the KV blocks' host tier): a filed
checkpoint evicted from the device is first copied to a host slot (an LRU of digests, the KV
host tier's HostTier); a lookup that finds a boundary's checkpoint on the host only takes a
device id for it and has it copied back before the step's forward. The runner performs both
kinds of copy before the forward, spills first (`take_copies`). A checkpoint handed out for a
restore in this step is never evicted in the same step: its row is read by the forward, after
the copies that would overwrite a reused id.

Invariant: every id is exactly one of free, pending (this step), or filed under one digest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

from tuili.engine.block_manager import BlockCopies, HostTier
from tuili.engine.request import Sequence


@dataclass
class CheckpointStats:
    saved: int = 0  # checkpoints filed
    restored: int = 0  # admissions that started from a checkpoint
    evicted: int = 0  # filed checkpoints dropped to make room
    filed: int = 0  # checkpoints held now (set when a snapshot is taken)
    capacity: int = 0  # checkpoints the pool holds at most
    spilled: int = 0  # evicted checkpoints copied to the host tier
    host_restored: int = 0  # host checkpoints copied back for a restore
    host_capacity: int = 0  # checkpoints the host tier holds at most


class StateCheckpoints:
    def __init__(self, num_checkpoints: int, block_size: int, interval_blocks: int, num_host_checkpoints: int = 0) -> None:
        if num_checkpoints < 1:
            raise ValueError(f"num_checkpoints={num_checkpoints} must be >= 1")
        self.host = HostTier(num_host_checkpoints) if num_host_checkpoints > 0 else None
        self._to_host: list[tuple[int, int]] = []  # (checkpoint id, host slot), this step
        self._to_device: list[tuple[int, int]] = []  # (host slot, checkpoint id), this step
        self._restoring: set[int] = set()  # ids handed out for restores this step
        self.num_checkpoints = num_checkpoints
        self.block_size = block_size
        self.interval = interval_blocks * block_size  # tokens between checkpoints
        self._free = list(range(num_checkpoints - 1, -1, -1))  # pop() hands out id 0 first
        self._filed: OrderedDict[bytes, int] = OrderedDict()  # prefix digest -> id, least recent first
        self._pending: list[tuple[Sequence, int, int]] = []  # (sequence, depth in tokens, id)
        self.stats = CheckpointStats(capacity=num_checkpoints, host_capacity=num_host_checkpoints)

    def snapshot(self) -> CheckpointStats:
        """The counters now, with the number of checkpoints filed."""
        return replace(self.stats, filed=len(self._filed))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_filed(self) -> int:
        return len(self._filed)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def deepest(self, digests: list[bytes]) -> tuple[int, int] | None:
        """The deepest filed checkpoint on the prefix whose leading blocks have `digests`, as
        (depth in tokens, id), marked as recently used; None when there is none."""
        per = self.interval // self.block_size
        for blocks in range(len(digests) // per * per, 0, -per):
            digest = digests[blocks - 1]
            checkpoint = self._filed.get(digest)
            if checkpoint is not None:
                self._filed.move_to_end(digest)
            elif self.host is not None and (slot := self.host.lookup(digest, ())) is not None:
                checkpoint = self._take()
                if checkpoint is None:
                    continue
                self._filed[digest] = checkpoint
                self._to_device.append((slot, checkpoint))
                self.stats.host_restored += 1
            else:
                continue
            self._restoring.add(checkpoint)
            return blocks * self.block_size, checkpoint
        return None

    def take_copies(self, copies: BlockCopies) -> None:
        """Add this step's host<->device checkpoint copies to the step's copies (once per step)."""
        copies.states_to_host, self._to_host = self._to_host, []
        copies.states_to_device, self._to_device = self._to_device, []

    def reserve(self, seq: Sequence, start: int, num_tokens: int) -> tuple[tuple[int, int], ...]:
        """Ids for the checkpoint boundaries that computing `seq`'s tokens [start, start +
        num_tokens) crosses inside its prompt, as (depth, id) in order of depth. When every id
        is pending, the deepest boundaries get one (a deeper checkpoint saves more compute),
        and they are filed shallowest first, so that the LRU evicts the shallow ones first."""
        end = min(start + num_tokens, seq.prompt_len)
        saves = []
        for depth in range(end // self.interval * self.interval, start, -self.interval):
            checkpoint = self._take()
            if checkpoint is None:
                break
            saves.append((depth, checkpoint))
        saves.reverse()
        self._pending.extend((seq, depth, checkpoint) for depth, checkpoint in saves)
        return tuple(saves)

    def commit(self) -> None:
        """File the checkpoints this step's forward wrote, under the digests of their prefixes
        (call after the block manager has digested the step's full blocks)."""
        for seq, depth, checkpoint in self._pending:
            digest = seq.block_digests[depth // self.block_size - 1]
            if digest in self._filed:  # computed twice (two sequences with one prompt at once)
                self._free.append(checkpoint)
            else:
                self._filed[digest] = checkpoint
                self.stats.saved += 1
        self._pending = []
        self._restoring.clear()

    def reset_pending(self) -> None:
        """Give back the ids of a step whose forward never completed (call before scheduling)."""
        self._free.extend(checkpoint for _, _, checkpoint in self._pending)
        self._pending = []
        self._restoring.clear()

    def _take(self) -> int | None:
        """A free id, else the least recently used filed one not restored from in this step
        (spilled to the host tier first, where there is one); None when there is none."""
        if self._free:
            return self._free.pop()
        digest = next((d for d, c in self._filed.items() if c not in self._restoring), None)
        if digest is None:
            return None
        checkpoint = self._filed.pop(digest)
        self.stats.evicted += 1
        if self.host is not None:
            loading = {slot for slot, _ in self._to_device}
            slot = self.host.store(digest, (), loading)
            if slot is not None:  # None: already on the host (or every host slot loads this step)
                self._to_host.append((checkpoint, slot))
                self.stats.spilled += 1
        return checkpoint
