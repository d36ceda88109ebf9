"""The shared-memory collectives (tuili/parallel/shm.py) between real processes.

Three processes join a gloo group (torch.distributed, as the engine's ranks do), open a link and
check every collective against what torch computes from the same inputs: all-reduces of float32,
bfloat16 and float16 tensors, small ones and ones several slots long, equal bit for bit on every
rank to the float32 sum in rank order; a gather and a broadcast that span several slots; a
native all-reduce replayed from a CPU graph; and a rank that aborts the group ends the others'
waits instead of leaving them waiting for it.
"""

from __future__ import annotations

import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tuili import kernels
from tuili.kernels.graph import Arena, capture
from tuili.parallel import shm
from tuili.parallel.shm import SLOT_BYTES, SharedMemoryLink

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the shared-memory link needs the native kernels")

WORLD = 3


class Aborted(Exception):
    pass


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=generator).to(dtype)


def _expected(numel: int, dtype: torch.dtype) -> torch.Tensor:
    total = _inputs(0, numel, dtype).float()
    for rank in range(1, WORLD):
        total += _inputs(rank, numel, dtype).float()
    return total.to(dtype)


def _check(aborted: bool = False) -> None:
    if aborted:
        raise Aborted


def _rank(rank: int, port: int, errors) -> None:  # noqa: ANN001 (a multiprocessing queue)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        link = SharedMemoryLink.open(rank, WORLD, 0, None, _check)
        assert link is not None, "ranks on one machine get a link"

        big = SLOT_BYTES // 2 + 1000  # more than one slot of float32 or bfloat16 elements
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for numel in (1, 96, big):
                x = _inputs(rank, numel, dtype)
                link.all_reduce(x)
                assert torch.equal(x, _expected(numel, dtype)), (dtype, numel)

        # A 2-D, non-contiguous tensor is summed in place too.
        x = _inputs(rank, 64, torch.float32).view(8, 8).t()
        expected = _expected(64, torch.float32).view(8, 8).t().clone()
        link.all_reduce(x)
        assert torch.equal(x, expected)

        pieces = link.gather(_inputs(rank, big, torch.float32).view(-1, 2))
        if rank == 0:
            assert pieces is not None and len(pieces) == WORLD
            for r, piece in enumerate(pieces):
                assert torch.equal(piece, _inputs(r, big, torch.float32).view(-1, 2))
        else:
            assert pieces is None

        payload = {"tokens": list(range(SLOT_BYTES // 3)), "name": "step"}  # pickled: several slots
        got = link.broadcast(payload if rank == 0 else None)
        assert got == payload

        # The native all-reduce inside a CPU graph: captured once (eagerly run), then replayed on
        # new contents of the same input tensor; each replay is one more exchange on every rank.
        x = torch.empty(96)
        x.copy_(_inputs(rank, 96, torch.float32))
        _, graph = capture(lambda: (link.all_reduce(x), [])[1], Arena())
        assert torch.equal(x, _expected(96, torch.float32))
        for round_ in range(3):
            x.copy_(_inputs(rank, 96, torch.float32) * (round_ + 2))
            graph.replay()
            expected = sum((_inputs(r, 96, torch.float32) * (round_ + 2) for r in range(WORLD)), torch.zeros(96))
            assert torch.equal(x, expected)

        # A rank that fails aborts the group: the others' next wait ends with their check.
        if rank == WORLD - 1:
            link.abort()
        else:
            with pytest.raises(Aborted):
                link.all_reduce(torch.ones(4))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_shared_memory_collectives_between_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    errors = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, errors)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    assert not reports, "\n".join(reports)
    assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]


def test_a_segment_too_large_for_its_folder_is_refused_cleanly(tmp_path, monkeypatch):
    """No room for the segment: rank 0 reports why (the group then stays on gloo), no file left."""
    monkeypatch.setattr(shm.os.path, "isdir", lambda path: False)  # no /dev/shm: the temporary directory
    monkeypatch.setattr(shm.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shm.os, "posix_fallocate", _no_space)
    path, reason, _ = shm._create(1 << 20, 2, b"x" * 16)
    assert path is None and "no room" in reason
    assert not list(tmp_path.iterdir())


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(28, "No space left on device")
