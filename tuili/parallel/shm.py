"""Collectives through shared memory, for the ranks of a CPU group that share one machine.

gloo's all-reduce costs ~0.5-1.7 ms per call between two processes on one 2-core machine (its
TCP loopback and thread hand-offs), and a decode step makes two per layer: communication alone
exceeded the whole step of one process (docs/benchmarks.md). vLLM's CPU backend meets the same
wall with a shared-memory all-reduce; so does this module. torch.distributed still does the
rendezvous, says which ranks share a machine and carries everything else (pipeline sends, the
rare object gathers); NCCL keeps GPUs. Without the native kernels (no C compiler, or
TUILI_NATIVE_KERNELS=0), ranks on several machines, or no room for the segment, the group stays
on gloo (`SharedMemoryLink.open` returns None).

The segment, one per group, mapped by each of its ranks from a file that rank 0 removes once all
have mapped it (nothing is left behind, whatever way the processes end):

    counters   int64 [world + 1, 16]: rank r's counter at [r, 0], alone on its 128 bytes; at
               [world, 0] the abort flag, set by a rank whose group failed (waits then end)
    slots      2 x world slots of SLOT_BYTES: exchange n uses the slots of parity n % 2

Exchange n (n = 1, 2, ...; every collective is one or more exchanges, each a chunk of at most
SLOT_BYTES per rank): a rank that contributes writes its slot of parity n % 2, then every rank
raises its counter to n ("arrives"); the readers wait for the counters they need, then read.
Invariant: a rank writes exchange n's slot only after every counter reached n - 1; a rank
arrives at n - 1 only after it finished reading exchange n - 2, the last user of that slot. So
no slot is overwritten while someone may still read it, with no second barrier per exchange.
Every rank sums the slots in rank order, so all ranks hold the same bits (as with gloo).

A rank that dies never arrives. Every rank watches the others' processes (all on this machine;
their pids exchanged when the link opens) and, when one is gone, sets the abort flag, which
ends every wait, the native all-reduce's too (also inside a CPU graph); the group then fails
with the lost rank named. Rank 0 also fails the group when a worker it started exits, and
Python-driven waits look at the group's failure every WAIT_SLICE_S. So nothing hangs, under
torchrun as well.

The all-reduce is one native call (csrc/shm_comm.c: copy in, arrive, wait, sum), which a CPU
graph can record and replay; it numbers its exchanges from the same per-process counter as the
Python-driven exchanges (broadcast, gather).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tuili.kernels import cpu as kernels
from tuili.kernels.graph import GraphCaptureError

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20
COUNTER_STRIDE = kernels.SHM_COUNTER_STRIDE
WAIT_SLICE_S = 0.05  # how long one native wait spins/yields before the failure check
IDLE_SLEEP_S = 0.0005  # between looks, once a broadcast has waited longer than IDLE_AFTER_S
IDLE_AFTER_S = 0.02
PEER_POLL_S = 0.2  # how often each rank looks whether the other ranks' processes are alive
_NONCE_BYTES = 16


class SharedMemoryLink:
    def __init__(self, segment: torch.Tensor, rank: int, world: int, check: Callable[[bool], None]) -> None:
        self.rank, self.world = rank, world
        # raises when the group has failed, or (True) was aborted by another rank; else returns
        self._check = check
        self._segment = segment
        self._header = _header_bytes(world)
        self._counters = segment[: (world + 1) * COUNTER_STRIDE * 8].view(torch.int64).view(world + 1, COUNTER_STRIDE)
        self._bytes = segment.numpy()  # for bytes in and out (broadcast)
        self._seq = torch.zeros(1, dtype=torch.int64)  # this rank's last exchange number
        self._seq_cell = self._seq.numpy()
        self._native = torch.zeros(2, dtype=torch.int64)  # the native all-reduce's nanoseconds and calls
        self.lost: tuple[int, int] | None = None  # the (rank, pid) of a peer process gone, once one is
        self._closed = False

    # -- set-up ----------------------------------------------------------------------------

    @classmethod
    def open(
        cls, rank: int, world: int, root: int, process_group: Any, check: Callable[[bool], None],
    ) -> SharedMemoryLink | None:
        """Collective over the group (`root`: its rank 0's global rank): a link when every rank
        mapped rank 0's segment, else None on every rank (the reason logged by rank 0). Call it
        only where the native kernels run (Platform.native_kernels), on every rank alike."""
        size = _header_bytes(world) + 2 * world * SLOT_BYTES
        nonce = secrets.token_bytes(_NONCE_BYTES)
        offer: list[Any] = [None]
        if rank == 0:
            offer[0] = _create(size, world, nonce)
        dist.broadcast_object_list(offer, src=root, group=process_group)
        segment, reason = None, offer[0][1] if offer[0] is not None else None
        if offer[0] is not None and offer[0][0] is not None:
            path, nonce = offer[0][0], offer[0][2]
            segment, reason = _map(path, size, world, nonce)
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, (socket.gethostname(), reason, os.getpid()), group=process_group)
        if rank == 0 and offer[0][0] is not None:
            os.unlink(offer[0][0])  # every rank mapped it or gave up: the mappings outlive the name
        refused = [(r, host, why) for r, (host, why, _) in enumerate(verdicts) if why is not None]
        if refused:
            if rank == 0:
                logger.info("tensor-parallel collectives stay on gloo: %s",
                            "; ".join(f"rank {r} on {host}: {why}" for r, host, why in refused))
            return None
        assert segment is not None
        link = cls(segment, rank, world, check)
        link._watch([pid for _, _, pid in verdicts])
        return link

    def _watch(self, pids: list[int]) -> None:
        """Watch the other ranks' processes (all on this machine): when one is gone, abort the
        group, so that no wait, native or not, outlives it, whoever started the processes."""

        def watch() -> None:
            while not self._closed:
                for rank, pid in enumerate(pids):
                    if rank != self.rank and not _alive(pid):
                        if not self._closed:
                            self.lost = (rank, pid)
                            self.abort()
                        return
                time.sleep(PEER_POLL_S)

        threading.Thread(target=watch, name="tuili-shm-peers", daemon=True).start()

    def close(self) -> None:
        """Stop watching the peers (they may now exit)."""
        self._closed = True

    # -- collectives -----------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (float32 accumulation, in rank order)."""
        flat = tensor.contiguous()
        if flat.dtype in (torch.float32, torch.bfloat16):
            if not kernels.shm_all_reduce(self._segment, self.world, self.rank, self._header, SLOT_BYTES, self._seq,
                                          self._native, flat):
                self._check(aborted=True)
        else:
            started = time.perf_counter_ns()
            self._torch_all_reduce(flat.view(-1))
            self._native += torch.tensor([time.perf_counter_ns() - started, 1])
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat)
        return tensor

    def native_time(self) -> tuple[float, int]:
        """Seconds spent in all-reduces, and their calls (the native ones in replayed graphs
        included)."""
        return int(self._native[0]) / 1e9, int(self._native[1])

    def abort(self) -> None:
        """End every rank's waits: the group has failed."""
        self._counters[self.world, 0] = 1

    def _torch_all_reduce(self, flat: torch.Tensor) -> None:
        """The native all-reduce's exchanges for the dtypes it does not take (float16)."""
        self._refuse_capture("float16 all-reduce")
        for _, chunk, seq in self._published(flat):
            self._wait(seq, 0, self.world)
            total = self._slot(seq, 0, chunk).float()
            for r in range(1, self.world):
                total.add_(self._slot(seq, r, chunk))
            chunk.copy_(total)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `tensor` (all of one shape and dtype), in rank order; others: None."""
        self._refuse_capture("gather")
        flat = tensor.contiguous().view(-1)
        pieces = [torch.empty_like(flat) for _ in range(self.world)] if self.rank == 0 else None
        for start, chunk, seq in self._published(flat):
            if pieces is not None:
                self._wait(seq, 0, self.world)
                for r, piece in enumerate(pieces):
                    piece[start:start + chunk.numel()].copy_(self._slot(seq, r, chunk))
        return None if pieces is None else [piece.view(tensor.shape) for piece in pieces]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled) on every rank. The other ranks may wait here idle for long
        (a worker between requests): after IDLE_AFTER_S they sleep between looks."""
        self._refuse_capture("broadcast")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        size, offset, received = len(payload), 0, bytearray()
        first = True
        while first or offset < size:
            seq = self._begin(writes=self.rank == 0)
            base = self._slot_offset(seq, 0)
            if self.rank == 0:
                head = 8 if first else 0
                end = min(size, offset + SLOT_BYTES - head)
                if first:
                    self._bytes[base:base + 8] = memoryview(size.to_bytes(8, "little"))
                self._bytes[base + head:base + head + end - offset] = memoryview(payload)[offset:end]
                self._arrive(seq)
            else:
                self._arrive(seq)
                self._wait(seq, 0, 1, idle=first)
                if first:
                    size = int.from_bytes(self._bytes[base:base + 8].tobytes(), "little")
                head = 8 if first else 0
                end = min(size, offset + SLOT_BYTES - head)
                received += self._bytes[base + head:base + head + end - offset].tobytes()
            offset, first = end, False
        return obj if self.rank == 0 else pickle.loads(received)

    # -- exchanges -------------------------------------------------------------------------

    @staticmethod
    def _refuse_capture(what: str) -> None:
        """Before an exchange driven from Python begins (no exchange number taken): a graph
        being captured could not replay it. Every rank refuses at the same call."""
        if kernels.is_recording():
            raise GraphCaptureError(f"the shared-memory {what} is driven from Python, so a replay would skip it")

    def _published(self, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, int]]:
        """Each slot-sized chunk of `flat`, once written to this rank's slot and arrived at, as
        (its first element, the chunk, its exchange number)."""
        per_chunk = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start:start + per_chunk]
            seq = self._begin()
            self._slot(seq, self.rank, chunk).copy_(chunk)
            self._arrive(seq)
            yield start, chunk, seq

    def _begin(self, writes: bool = True) -> int:
        """The next exchange's number; for a rank that writes its slot, once the slot is free
        (every counter at n - 1)."""
        self._seq_cell[0] += 1
        seq = int(self._seq_cell[0])
        if writes:
            self._wait(seq - 1, 0, self.world)
        return seq

    def _arrive(self, seq: int) -> None:
        kernels.shm_arrive(self._counters, self.rank, seq)

    def _wait(self, seq: int, first: int, count: int, idle: bool = False) -> None:
        waited = 0.0
        while not (done := kernels.shm_wait(self._counters, first, count, seq,
                                            0.0 if waited >= IDLE_AFTER_S and idle else WAIT_SLICE_S)):
            self._check(aborted=done is None)
            if idle and waited >= IDLE_AFTER_S:
                time.sleep(IDLE_SLEEP_S)
                waited += IDLE_SLEEP_S
            else:
                waited += WAIT_SLICE_S

    def _slot_offset(self, seq: int, rank: int) -> int:
        return self._header + ((seq % 2) * self.world + rank) * SLOT_BYTES

    def _slot(self, seq: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = self._slot_offset(seq, rank)
        nbytes = like.numel() * like.element_size()
        return self._segment[start:start + nbytes].view(like.dtype)


def _header_bytes(world: int) -> int:
    """The counters and the abort flag, then (in the header's last bytes) the nonce that tells
    rank 0's segment."""
    return -(-((world + 1) * COUNTER_STRIDE * 8 + _NONCE_BYTES) // 4096) * 4096


def _create(size: int, world: int, nonce: bytes) -> tuple[str | None, str | None, bytes]:
    """Rank 0: a zeroed file of `size` bytes in /dev/shm (else the temporary directory) whose
    header ends with `nonce`; (path, None, nonce), or (None, why not, nonce)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        fd, path = tempfile.mkstemp(prefix="tuili-tp-", dir=folder)
    except OSError as e:
        return None, f"cannot create a segment in {folder}: {e}", nonce
    try:
        # Reserve every page now: on a full tmpfs this fails here, not as a SIGBUS mid-step.
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, nonce, _header_bytes(world) - _NONCE_BYTES)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        return None, f"no room for a {size >> 20} MiB segment in {folder}: {e}", nonce
    os.close(fd)
    return path, None, nonce


def _map(path: str, size: int, world: int, nonce: bytes) -> tuple[torch.Tensor | None, str | None]:
    """This rank's mapping of rank 0's segment, or why not (another machine has no such file,
    or a different one: the nonce tells)."""
    if not os.path.exists(path):
        return None, f"{path} does not exist here (another machine)"
    segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    offset = _header_bytes(world) - _NONCE_BYTES
    if bytes(segment[offset:offset + _NONCE_BYTES].numpy()) != nonce:
        return None, f"{path} here is not rank 0's segment (another machine)"
    return segment, None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (an exited one not yet reaped is a zombie: gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: kill() said it exists
