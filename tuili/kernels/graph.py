"""CPU graphs: the native kernel calls of a forward recorded once, then replayed by one native call.

At decode, a small model's step on a CPU spends a large share of its time between kernels: Python
module calls, argument checks and ctypes, for about ten kernels per layer (docs/kernels.md, CPU
graphs and Measured crossovers). A graph removes that time as a CUDA graph does on a GPU. `capture`
runs a function once, eagerly, and records every native kernel call with its arguments
(addresses, sizes, scalars); `Graph.replay` hands the recorded program to csrc/graph.c, which
makes the same calls in the same order, without Python.

Invariants that make a replay compute what the eager run computed:
- Inside the capture, every torch operation is a view or an allocation, never arithmetic: a
  dispatch mode checks each one and the capture fails (GraphCaptureError) otherwise, since a
  replay would silently skip that work. Every kernel called must be one graph.c can replay.
- Inputs live at fixed addresses: the caller writes each step's inputs into the tensors it
  captured with, and keeps them (and the weights and caches) alive as long as the graph.
- Tensors allocated inside the capture (the intermediates and the outputs) are given places in
  an `Arena`, planned from when each is first and last used, so a graph needs the memory of its
  largest live set rather than of every intermediate. The arena is shared by the graphs of one
  owner, who replays one at a time: the outputs are views into it, valid until the next replay.
- Scalars are fixed: a graph replays the shapes, thread count and flags it was captured with.
  The kernels still check the values inside index tensors (block ids, slots) at every replay.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tuili.errors import TuiliError
from tuili.kernels import cpu

_ALIGN = 64  # bytes: every planned tensor starts on a cache line
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty_strided.default,
}


class GraphCaptureError(TuiliError):
    """The function cannot be captured: it computes with torch, or calls a kernel graph.c does not
    replay. The caller keeps running it eagerly."""


class GraphReplayError(TuiliError):
    """A kernel refused its inputs during a replay (a bad block id or slot in this step's index
    tensors). The eager run of the same step raises the kernel's own, named error."""


class Arena:
    """Memory for the planned tensors of one owner's graphs. It only grows; graphs notice a new
    buffer through `generation` and move their addresses into it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.generation = 0

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.buffer.numel():
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.generation += 1


@dataclass(frozen=True)
class _Output:
    offset: int  # bytes into the arena
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Graph:
    """A captured program and where its outputs are. Replaying it repeats the captured calls on
    whatever the input tensors hold now."""

    def __init__(
        self, words: np.ndarray, relocations: np.ndarray, outputs: list[_Output], arena: Arena, calls: int
    ) -> None:
        self._words = words  # the program with planned addresses as offsets into the arena
        self._relocations = relocations  # which words are such offsets
        self._outputs = outputs
        self._arena = arena
        self._program = torch.empty(0, dtype=torch.int64)
        self._generation = -1
        self.calls = calls  # kernel calls per replay

    def replay(self) -> list[torch.Tensor]:
        """Runs the program; returns the outputs, views into the arena (overwritten by the next
        replay of any graph sharing it)."""
        arena = self._arena
        if self._generation != arena.generation:
            program = self._words.copy()
            program[self._relocations] += arena.buffer.data_ptr()
            self._program = torch.from_numpy(program)
            self._generation = arena.generation
        error = (ctypes.c_int64 * 4)()
        status = cpu._library().tuili_graph_replay(self._program.data_ptr(), self._program.numel(), error)
        if status != 0:
            raise GraphReplayError(
                f"kernel call {error[3]} of the graph failed with status {status} (details {error[1]}, {error[2]})"
            )
        return [
            arena.buffer[o.offset : o.offset + o.nbytes].view(o.dtype).view(o.shape) for o in self._outputs
        ]


def capture(function: Callable[[], Sequence[torch.Tensor]], arena: Arena) -> tuple[list[torch.Tensor], Graph]:
    """Runs `function` eagerly and records it. Returns its outputs (ordinary tensors, computed
    eagerly) and the graph that recomputes them from the inputs' current contents. Raises
    GraphCaptureError when `function` cannot be replayed; the work it did eagerly is done."""
    guard = _ViewsAndAllocationsOnly()
    with cpu.recording() as calls, guard:
        outputs = list(function())
    return outputs, _plan(calls, guard.allocations, outputs, arena)


class _ViewsAndAllocationsOnly(TorchDispatchMode):
    """Refuses any torch op that is neither a view nor an allocation; keeps every allocation
    alive until the plan is made, so no two of them share an address."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        if func not in _ALLOCATIONS and not func.is_view:
            raise GraphCaptureError(f"{func} computes outside the native kernels, so a replay would skip it")
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        return out


@functools.cache
def _op_codes() -> dict[str, tuple[int, int]]:
    """graph.c's numbering: kernel name -> (op code, number of arguments)."""
    library = cpu._library()
    codes, count = {}, ctypes.c_int()
    while (name := library.tuili_graph_op(len(codes), ctypes.byref(count))) is not None:
        codes[name.decode()] = (len(codes), count.value)
    return codes


def _plan(
    calls: list[tuple[str, tuple[object, ...]]],
    allocations: list[torch.Tensor],
    outputs: list[torch.Tensor],
    arena: Arena,
) -> Graph:
    """The program for `calls`, with the storages allocated during the capture placed in `arena`."""
    storages = sorted({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in allocations}.items())
    storages = [(base, size) for base, size in storages if size > 0]
    bases = [base for base, _ in storages]

    def planned(address: int) -> int | None:
        """The index of the planned storage holding `address`, if any."""
        i = bisect.bisect_right(bases, address) - 1
        return i if i >= 0 and address < bases[i] + storages[i][1] else None

    codes = _op_codes()
    library = cpu._library()
    words: list[int] = []
    references: list[tuple[int, int, int]] = []  # (word, storage, offset within it)
    first_use: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for index, (name, args) in enumerate(calls):
        if name not in codes:
            raise GraphCaptureError(f"kernel {name} cannot be replayed by a graph")
        code, count = codes[name]
        argtypes = getattr(library, name).argtypes
        if len(args) != count or len(argtypes) != count:
            raise GraphCaptureError(f"{name} was called with {len(args)} arguments; graph.c replays {count}")
        words.append(code)
        for value, kind in zip(args, argtypes, strict=True):
            if kind is ctypes.c_float:
                words.append(struct.unpack("<I", struct.pack("<f", value))[0])
            elif kind is ctypes.c_void_p:
                address = value if isinstance(value, int) else 0  # None, or an error array (the replayer's own)
                storage = planned(address)
                if storage is not None:
                    references.append((len(words), storage, address - bases[storage]))
                    first_use.setdefault(storage, index)
                    last_use[storage] = index
                words.append(address)
            else:
                words.append(int(value))  # type: ignore[call-overload]  # ints and bools, as ctypes took them

    end = len(calls)
    output_storages = []
    for tensor in outputs:
        storage = planned(tensor.data_ptr())
        if storage is None or not tensor.is_contiguous():
            raise GraphCaptureError("a graph's outputs must be contiguous tensors allocated inside the capture")
        first_use.setdefault(storage, end)
        last_use[storage] = end  # read after the replay: live to the end
        output_storages.append(storage)

    offsets = _place({s: (first_use[s], last_use[s], storages[s][1]) for s in first_use})
    relocations = []
    for word, storage, within in references:
        words[word] = offsets[storage] + within
        relocations.append(word)
    graph_outputs = [
        _Output(offsets[s] + t.data_ptr() - bases[s], t.numel() * t.element_size(), t.dtype, tuple(t.shape))
        for s, t in zip(output_storages, outputs, strict=True)
    ]
    arena.reserve(max((offsets[s] + _round_up(storages[s][1]) for s in offsets), default=0))
    return Graph(
        np.array(words, dtype=np.int64), np.array(relocations, dtype=np.int64), graph_outputs, arena, len(calls)
    )


def _place(lives: dict[int, tuple[int, int, int]]) -> dict[int, int]:
    """Offsets for storages given as {id: (first use, last use, bytes)}: first fit, in order of
    first use; two storages whose uses overlap (ends included) never overlap in memory."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first use, last use)
    offsets = {}
    for storage, (first, last, size) in sorted(lives.items(), key=lambda item: item[1][0]):
        size = _round_up(size)
        offset = 0
        for start, stop, other_first, other_last in sorted(placed):
            if other_last < first or other_first > last:
                continue  # never alive at the same time
            if offset + size <= start:
                break
            offset = max(offset, stop)
        placed.append((offset, offset + size, first, last))
        offsets[storage] = offset
    return offsets


def _round_up(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN
