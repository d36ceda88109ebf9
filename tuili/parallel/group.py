"""The tensor-parallel process group: its timed collectives, and the processes behind it.

Rendezvous is torch.distributed's env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): torchrun
sets it on every machine (its c10d rendezvous), and on one machine rank 0 sets it itself and
starts the other ranks as `python -m tuili.parallel.worker` processes (`start_workers`), which
it watches. Backend: NCCL on CUDA devices, gloo on CPUs.

Failure: a rank that dies closes its sockets, so the collective that waits on it raises in the
others (gloo and NCCL both report a closed peer). Rank 0 also polls the workers it started: one
that exits marks the group failed, the others are stopped and `on_failure` runs (the server
uses it to shut down with a non-zero status). Workers stop when rank 0 says so, when a
collective fails, or when the process that started them is gone: no orphans.
"""

from __future__ import annotations

import atexit
import base64
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tuili.errors import TuiliError
from tuili.parallel.shard import TensorShard
from tuili.parallel.shm import SharedMemoryLink
from tuili.platform import Platform

logger = logging.getLogger(__name__)

CONFIG_ENV = "TUILI_TP_ENGINE_CONFIG"  # a started worker's EngineConfig, pickled, base64
PARENT_ENV = "TUILI_TP_PARENT_PID"
# Collectives wait this long for a rank that is alive but stuck; a dead one fails them at once.
# An idle worker waits for the next step without limit (long idle periods are normal).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=30)
STOP_WAIT_SECONDS = 10.0
STOP = "stop"  # the message that ends the other ranks' serve() loops


class WorkerLostError(TuiliError):
    """A tensor-parallel rank is gone: this engine can no longer run a step."""


class TensorParallelGroup:
    def __init__(
        self, shard: TensorShard, device: torch.device, kind: str = "tensor-parallel",
        process_group: Any = None, root: int = 0,
    ) -> None:
        self.shard = shard
        self.kind = kind  # what the ranks split, for messages: "tensor-parallel" or "pipeline-parallel"
        # The ranks of a pipeline stage's tensor-parallel group (tuili/parallel/pipeline.py): its
        # torch.distributed group and the global rank of its rank 0; None, 0: the whole world.
        self.process_group = process_group
        self.root = root
        self.device = device
        self._seconds = 0.0  # collectives timed here (the native all-reduce times itself)
        self._collectives = 0
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        # A pipeline stage's group fails with the whole group (whose rank 0 watches the processes).
        self.parent: TensorParallelGroup | None = None
        self.children: list[TensorParallelGroup] = []
        # Ranks on one CPU machine: all-reduces, gathers and broadcasts through shared memory.
        self.link: SharedMemoryLink | None = None
        self._workers: list[subprocess.Popen] = []
        self._stopping = False

    @property
    def comm_seconds(self) -> float:
        """Seconds in all-reduces and the logits gather (or a pipeline's sends and receives),
        waits for the slower rank included, cumulative: the ruler reads it."""
        native = self.link.native_time()[0] if self.link is not None else 0.0
        return self._seconds + native

    @property
    def num_collectives(self) -> int:
        native = self.link.native_time()[1] if self.link is not None else 0
        return self._collectives + native

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    # -- collectives ---------------------------------------------------------------------

    def connect_shared_memory(self) -> None:
        """Collective: move this group's collectives to shared memory where its ranks share a
        CPU machine (tuili/parallel/shm.py); otherwise they stay on gloo / NCCL."""
        if self.world > 1 and Platform.detect(self.device).native_kernels:
            self.link = SharedMemoryLink.open(self.rank, self.world, self.root, self.process_group, self._check_alive)

    def _check_alive(self, aborted: bool = False) -> None:
        """Raises WorkerLostError once the group has failed: checked between the slices of a
        shared-memory wait, so that no wait outlives a rank (the watcher stops once stop()
        begins, so a worker that exits then is found here)."""
        exited = self._exited_worker()
        if exited is not None:
            self.fail(exited)
        lost = self.failure or (self.parent.failure if self.parent is not None else None)
        if lost is None and self.link is not None and self.link.lost is not None:
            rank, pid = self.link.lost
            who = "rank 0" if rank == 0 else f"{self.kind} worker rank {rank}"
            lost = f"{who} (pid {pid}) is gone (seen by rank {self.rank})"
        if lost is None and aborted:
            lost = f"another rank of this {self.kind} group failed (it aborted the shared-memory collectives)"
        if lost is not None:
            self.fail(lost)
            raise WorkerLostError(lost)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place, timed."""
        if self.link is not None:
            return self.link.all_reduce(tensor)  # timed by the native call (also inside a CPU graph)
        started = time.perf_counter()
        self._guard(dist.all_reduce, tensor, dist.ReduceOp.SUM, self.process_group)
        self._count(started)
        return tensor

    def gather_columns(self, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: the ranks' [rows, widths[r]] tensors side by side ([rows, sum(widths)]);
        other ranks: None. Shards are padded to the widest for the collective."""
        started = time.perf_counter()
        widest = max(widths)
        padded = tensor
        if tensor.shape[-1] < widest:
            padded = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[-1]))
        padded = padded.contiguous()
        if self.link is not None:
            pieces = self.link.gather(padded)
        else:
            pieces = [torch.empty_like(padded) for _ in widths] if self.rank == 0 else None
            self._guard(dist.gather, padded, pieces, self.root, self.process_group)
        self._count(started)
        if pieces is None:
            return None
        return torch.cat([piece[..., :width] for piece, width in zip(pieces, widths, strict=True)], dim=-1)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled: step plans, the pool plan)."""
        if self.link is not None and self.process_group is None:
            return self.link.broadcast(obj)
        holder = [obj if self.rank == 0 else None]
        self._guard(dist.broadcast_object_list, holder, 0)
        return holder[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Rank 0: every rank's `obj`, in rank order; other ranks: []."""
        gathered: list[Any] = [None] * self.world if self.rank == 0 else []
        self._guard(dist.gather_object, obj, gathered if self.rank == 0 else None, 0)
        return gathered

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Callable[[], None]:
        """Start sending `tensor` to rank `peer` (pipeline stages); the call returned waits for
        the send to finish (timed). `tensor` must not change until then."""
        work = self._guard(dist.isend, tensor, peer, None, tag)

        def wait() -> None:
            started = time.perf_counter()
            self._guard(work.wait)
            self._count(started)

        return wait

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """Receive into `tensor` from rank `peer`, timed: the time includes waiting for the
        peer to have it ready."""
        started = time.perf_counter()
        self._guard(dist.recv, tensor, peer, None, tag)
        self._count(started)
        return tensor

    def _count(self, started: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # NCCL returns before the transfer is done
        self._seconds += time.perf_counter() - started
        self._collectives += 1

    def _guard(self, collective: Callable, *args) -> Any:
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        try:
            return collective(*args)
        except (RuntimeError, ValueError) as e:  # gloo/NCCL: a peer closed its connection
            self.fail(self._exited_worker(wait=1.0) or f"a {self.kind} collective failed on rank {self.root + self.rank}: {e}")
            raise WorkerLostError(self.failure) from e

    # -- processes -----------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Mark the group failed (once): stop the workers this process started, tell on_failure."""
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("%s", reason)
        if self.link is not None:
            self.link.abort()
        for child in self.children:
            child.fail(reason)
        self._terminate_workers()
        if self.on_failure is not None:
            self.on_failure(reason)

    def start_workers(self, config: Any, port: int) -> None:
        """Rank 0 on one machine: start ranks 1..world-1 with `config` and watch them."""
        encoded = base64.b64encode(pickle.dumps(config)).decode()
        for rank in range(1, self.world):
            env = {**os.environ, CONFIG_ENV: encoded, PARENT_ENV: str(os.getpid()), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self._workers.append(subprocess.Popen([sys.executable, "-m", "tuili.parallel.worker"], env=env))
        threading.Thread(target=self._watch, name="tuili-tp-monitor", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping and self.failure is None:
            exited = self._exited_worker()
            if exited is not None and not self._stopping:
                self.fail(exited)
                return
            time.sleep(0.2)

    def _exited_worker(self, wait: float = 0.0) -> str | None:
        """Which worker this process started has exited (waiting up to `wait` seconds for one
        whose connection closed to be reaped), said as the failure; None if all run."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self._workers, start=1):
                code = proc.poll()
                if code is not None:
                    return f"{self.kind} worker rank {rank} (pid {proc.pid}) exited with status {code}"
            if time.monotonic() >= deadline or not self._workers:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        """Rank 0: tell the workers to stop and wait for them (killing those that do not)."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None and self.rank == 0:
            try:
                self.broadcast((STOP,))
            except WorkerLostError:
                pass
        for group in (self, *self.children):
            if group.link is not None:
                group.link.close()  # the workers now exit: not a failure
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        for proc in self._workers:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _terminate_workers(self) -> None:
        for proc in self._workers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._workers:
            try:
                proc.wait(STOP_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()


def under_torchrun() -> bool:
    """Whether this process was started with a rendezvous environment (torchrun, or rank 0 here)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def join(world: int, device: torch.device, config: Any, kind: str = "tensor-parallel") -> TensorParallelGroup:
    """This process's place in a group of `world` ranks: under torchrun (or as a worker started
    here) the environment's rank; otherwise rank 0, which starts the other ranks on this machine.
    The same group serves pipeline parallelism (`kind`), whose stages are its ranks."""
    started_here = not under_torchrun()
    if started_here:
        rank, env_world, port = 0, world, _free_port()
        init_method = f"tcp://127.0.0.1:{port}"
    else:
        rank, env_world, init_method = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    if env_world != world:
        raise TuiliError(
            f"tensor_parallel_size x pipeline_parallel_size = {world} ranks but the launcher started {env_world} "
            "processes (WORLD_SIZE): run as many processes as ranks"
        )
    if device.type == "cuda":  # one GPU per rank: the local rank's
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) if not started_here else 0)
        torch.cuda.set_device(device)
    group = TensorParallelGroup(TensorShard(rank, world), device, kind)
    if started_here:
        group.start_workers(config, port)
    if rank == 0:
        atexit.register(group.stop)
    _share_threads(world if started_here else int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    if kind == "tensor-parallel":  # a pipeline's stages keep gloo between them; each stage's own group may not
        group.connect_shared_memory()
    if PARENT_ENV in os.environ:
        threading.Thread(target=_exit_with_parent, args=(int(os.environ[PARENT_ENV]),), daemon=True).start()
    return group


def _share_threads(local: int) -> None:
    """The `local` ranks on this machine split its cores, unless OMP_NUM_THREADS says otherwise
    (torchrun sets it)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(min(torch.get_num_threads(), threads))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    logger.error("rank 0 (pid %d) is gone: this tensor-parallel worker exits", parent)
    os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
