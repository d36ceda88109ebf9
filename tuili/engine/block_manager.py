"""The paged KV cache's bookkeeping: block ids, reference counts, the prefix cache and its
host-memory tier. No tensors here: the runner owns the pools and performs the copies this
module asks for (`take_copies()`).

Prefix caching. A full block is identified by a digest of its tokens and of the digest of the
block before it (sha256, so the key covers the whole prefix); the cached block also keeps its
tokens, and a lookup compares them, so a hash collision can never hand out wrong KV. A new
sequence takes the longest run of cached blocks by reference (ref_count += 1, no copy) and
computes only the rest. Blocks that no sequence holds stay cached in an LRU free queue and are
reused, oldest first, only when the pool needs room. A block is registered only once every
slot of it has been computed, so a block still being written is never shared.

Host tier. When a cached block is evicted from the device pool and a host pool exists, its
contents are copied to a host slot (itself LRU); a later lookup that misses on the device but
hits on the host copies the block back instead of recomputing it.

Invariants: every device block is either held (ref_count > 0, in no free queue) or free
(ref_count == 0, in `_free`); a cached digest maps to exactly one device block; the KV of a
block is written only while exactly one sequence holds it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from tuili.engine.request import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot(block_table: list[int], position: int, block_size: int) -> int:
    """Where the KV of a sequence's token at ``position`` lives in the pool: block * block_size + offset."""
    return block_table[position // block_size] * block_size + position % block_size


def block_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    payload = b",".join(str(t).encode() for t in tokens)
    return hashlib.sha256(parent + b"|" + payload).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # set while the block is in the prefix cache
    tokens: tuple[int, ...] = ()


@dataclass
class CacheStats:
    """Token counts: queried = prompt tokens looked up; hits split by the tier that served them."""

    queried_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class PrefixMatch:
    """Tokens of a sequence's prefix found in the device pool and on the host tier."""

    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens


@dataclass
class BlockCopies:
    """Copies the runner performs before this step's forward: swap-outs first, then swap-ins."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    # A hybrid model's state checkpoints (tuili/engine/state_checkpoints.py), likewise.
    states_to_host: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint id, host slot)
    states_to_device: list[tuple[int, int]] = field(default_factory=list)  # (host slot, checkpoint id)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.states_to_host or self.states_to_device)


class HostTier:
    """LRU map digest -> host slot, with each slot's tokens kept for verification."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        self._slots: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()

    def lookup(self, digest: bytes, tokens: tuple[int, ...]) -> int | None:
        entry = self._slots.get(digest)
        if entry is None or entry[1] != tokens:
            return None
        self._slots.move_to_end(digest)
        return entry[0]

    def store(self, digest: bytes, tokens: tuple[int, ...], busy: set[int]) -> int | None:
        """A slot for this block (reusing the least recently used one), or None when every
        slot is busy with a copy of this step."""
        if digest in self._slots:
            self._slots.move_to_end(digest)
            return None  # already on the host: nothing to copy
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((d for d, (s, _) in self._slots.items() if s not in busy), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)[0]
        self._slots[digest] = (slot, tokens)
        return slot

    def __len__(self) -> int:
        return len(self._slots)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently used first; cached ones keep their digest until reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # digest -> device block id
        self.host = HostTier(num_host_blocks) if enable_prefix_caching and num_host_blocks > 0 else None
        self._copies = BlockCopies()
        self.stats = CacheStats()

    # ---- capacity ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (cached-but-free blocks count as free)."""
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
            block = self._pop_free()
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Uncached blocks go to the front of the LRU queue (nothing
        to keep); cached ones to the back, last block first, so a sequence's tail is evicted
        before its beginning (later requests are likelier to share the beginning)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.digest is None:
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None
        seq.block_table = []
        seq.block_digests = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks past those its first `num_tokens` tokens need (speculative
        decoding's rejected tokens). Such blocks were grown for this step only: held by `seq`
        alone and never registered, since registration covers computed slots only."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.digest is None, f"trimmed block {block.block_id} is shared or cached"
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    # ---- prefix cache -----------------------------------------------------------------

    def match_prefix(self, seq: Sequence, max_tokens: int | None = None) -> PrefixMatch:
        """Attach the longest cached prefix (of at most `max_tokens` tokens) to a sequence that
        holds no blocks yet. At least one token is always left to compute (its logits pick the
        next token), and what is left starts on a block boundary, so no shared block is ever
        written."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        if max_tokens is not None:
            limit = min(limit, max_tokens // bs)
        parent = b""
        hits_device = hits_host = 0
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            block_id = self._cached.get(digest)
            if block_id is not None and self.blocks[block_id].tokens == tokens:
                self._hold(self.blocks[block_id])
                hits_device += 1
            elif self.host is not None and (slot := self.host.lookup(digest, tokens)) is not None and self._free:
                block = self._pop_free()
                block.ref_count = 1
                self._register(block, digest, tokens)
                self._copies.to_device.append((slot, block.block_id))
                hits_host += 1
            else:
                break
            seq.block_table.append(self._cached[digest])
            seq.block_digests.append(digest)
            parent = digest
        return PrefixMatch(hits_device * bs, hits_host * bs)

    def prefix_digests(self, seq: Sequence) -> list[bytes]:
        """The cache keys of the blocks match_prefix would look up for `seq`, in order, whether
        cached or not (no side effects)."""
        digests: list[bytes] = []
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs if self.enable_prefix_caching else 0):
            digests.append(block_digest(digests[-1] if digests else b"", tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return digests

    def record_query(self, seq: Sequence, match: PrefixMatch) -> None:
        """Count one admitted sequence's lookup (once, even if admission is retried)."""
        self.stats.queried_tokens += seq.prompt_len
        self.stats.device_hit_tokens += match.device_tokens
        self.stats.host_hit_tokens += match.host_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Cache every block of `seq` whose slots are all computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Only tokens already in the sequence: accepted proposals are appended after this call.
        full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        while len(seq.block_digests) < full:
            i = len(seq.block_digests)
            parent = seq.block_digests[-1] if seq.block_digests else b""
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            seq.block_digests.append(digest)
            block = self.blocks[seq.block_table[i]]
            if block.digest is None and digest not in self._cached:
                self._register(block, digest, tokens)
            # else: another sequence computed the same block first; ours stays private.

    def take_copies(self) -> BlockCopies:
        """Hand the pending device<->host copies to the runner (once per step)."""
        copies, self._copies = self._copies, BlockCopies()
        return copies

    # ---- internals --------------------------------------------------------------------

    def _hold(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _register(self, block: Block, digest: bytes, tokens: tuple[int, ...]) -> None:
        block.digest, block.tokens = digest, tokens
        self._cached[digest] = block.block_id

    def _pop_free(self) -> Block:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.digest is not None:
            self._evict(block)
        return block

    def _evict(self, block: Block) -> None:
        """Forget a cached block that is about to be reused, spilling it to the host tier."""
        if self.host is not None:
            busy = {slot for slot, _ in self._copies.to_device}
            slot = self.host.store(block.digest, block.tokens, busy)
            if slot is not None:
                self._copies.to_host.append((block.block_id, slot))
        del self._cached[block.digest]
        block.digest, block.tokens = None, ()
