"""Tensor parallelism on this machine's cores: TP=2 with one thread per rank against TP=1 with
two threads, side by side in one run (interleaved rounds, each configuration in its own
process), on a random checkpoint with Qwen3-0.6B's shape in bf16:

- decode at batch 1 and 16 (16-token prompts, 64 greedy tokens each): tokens/s over the decode
  steps only;
- prefill of one 512-token prompt (prefix caching off): seconds of the step;
- TP=2's measured communication (all-reduces and the logits gather) per step against the
  ruler's prediction (tuili/perf/plan.py, Roofline.comm / prefill) over a link measured here:
  the engine's shared-memory all-reduce between two processes on this machine (gloo's measured
  beside it, for reference), its latency from 2 KiB all-reduces and its bandwidth from 8 MiB
  ones.

    python benchmarks/tensor_parallel.py            # 2 rounds
    python benchmarks/tensor_parallel.py --rounds 1 --tokens 16   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, qwen3_06b_checkpoint  # noqa: E402

PROMPT_LEN, PREFILL_LEN, BATCH = 16, 512, 16


class DecodeTimer:
    """Sums the seconds and the communication of pure decode steps and of prefill steps."""

    wants_device_time = True

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.decode_seconds = self.decode_tokens = self.decode_steps = 0
        self.decode_comm = self.prefill_seconds = self.prefill_comm = 0.0
        self.prefill_steps = 0
        self._comm = self.engine.communication_seconds()

    def on_step(self, record) -> None:
        comm = self.engine.communication_seconds()
        spent, self._comm = comm - self._comm, comm
        if record.prefill_chunks:
            self.prefill_seconds += record.seconds
            self.prefill_comm += spent
            self.prefill_steps += 1
        else:
            self.decode_seconds += record.seconds
            self.decode_tokens += record.num_sampled
            self.decode_steps += 1
            self.decode_comm += spent


def run_one(tp: int, tokens: int) -> dict:
    """One configuration, in this process: its rates and communication."""
    from tuili import LLM, SamplingParams

    torch.set_num_threads(2 if tp == 1 else 1)
    llm = LLM(str(qwen3_06b_checkpoint()), dtype="bfloat16", tensor_parallel_size=tp, enable_prefix_caching=False,
              max_num_batched_tokens=PREFILL_LEN, max_model_len=1024, kv_cache_memory=1 << 30)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(1000, 1000 + PROMPT_LEN))}, params)  # warm-up
    result: dict = {"tp": tp, "threads": torch.get_num_threads()}
    timer = DecodeTimer(llm.engine)
    llm.engine.add_observer(timer)
    for batch in (1, BATCH):
        timer.reset()
        prompts = [{"prompt_token_ids": list(range(1000 + i, 1000 + i + PROMPT_LEN))} for i in range(batch)]
        llm.generate(prompts, params)
        result[f"decode_b{batch}"] = timer.decode_tokens / timer.decode_seconds
        result[f"decode_b{batch}_comm_ms"] = 1e3 * timer.decode_comm / max(timer.decode_steps, 1)
        result[f"decode_b{batch}_step_ms"] = 1e3 * timer.decode_seconds / max(timer.decode_steps, 1)
    timer.reset()
    for i in range(3):
        prompt = [(7 * j + i) % 100_000 + 10 for j in range(PREFILL_LEN)]
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0))
    result["prefill_512_s"] = timer.prefill_seconds / timer.prefill_steps
    result["prefill_512_comm_ms"] = 1e3 * timer.prefill_comm / timer.prefill_steps
    if tp > 1:
        result["weight_bytes_per_rank"] = llm.engine.runner.weight_bytes_per_rank()
    else:
        result["weight_bytes_per_rank"] = [llm.engine.weight_bytes()]
    llm.engine.close()
    return result


def _link_rank(rank: int, port: int, out: str, transport: str) -> None:
    import torch.distributed as dist

    from tuili.parallel.shm import SharedMemoryLink

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if transport == "gloo":
        all_reduce = dist.all_reduce
    else:
        link = SharedMemoryLink.open(rank, 2, 0, None, lambda aborted=False: None)
        assert link is not None, "the engine's shared-memory link could not open here"
        all_reduce = link.all_reduce
    times = {}
    for size, reps in ((2 << 10, 400), (8 << 20, 20)):
        x = torch.ones(size // 2, dtype=torch.bfloat16)
        for _ in range(3):
            all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            all_reduce(x)
        times[size] = (time.perf_counter() - start) / reps
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_link(transport: str):
    """An all-reduce between two processes here over `transport` ("shm": the engine's
    shared-memory link, tuili/parallel/shm.py; "gloo"), as the ruler's LinkSpec: a ring
    all-reduce of M bytes over n=2 takes 2 (n-1) (latency + M / n / bandwidth)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from tuili.perf.hardware import LinkSpec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_link_rank, args=(port, out, transport), nprocs=2)
    times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    os.unlink(out)
    small, large = min(times), max(times)
    latency = times[small] / 2 - small / 2 / 1e12
    bandwidth = (large / 2) / (times[large] / 2 - latency)
    return LinkSpec(f"{transport}-here", bandwidth, latency, f"measured here: {transport} all-reduce between two processes")


def predicted(link) -> dict:
    """The ruler's communication per step at TP=2 over `link`."""
    from tuili.perf.checkpoint import read_model
    from tuili.perf.cost import ModelCost
    from tuili.perf.formats import weight_format
    from tuili.perf.plan import PlanInputs, Roofline, allreduce_seconds
    from tuili.perf.resolve import current_hardware

    cost = ModelCost.from_config(read_model(str(qwen3_06b_checkpoint())).config)
    hardware = current_hardware("cpu")
    roof = Roofline(cost, hardware, PlanInputs(weights=weight_format("bf16"), gpus=2, tp=2, link=link))
    return {
        "decode_b1_comm_ms": 1e3 * roof.comm(1),
        f"decode_b{BATCH}_comm_ms": 1e3 * roof.comm(BATCH),
        # Roofline.prefill's communication term
        "prefill_512_comm_ms": 1e3 * roof.allreduces * allreduce_seconds(PREFILL_LEN * roof.hidden_bytes, 2, link),
        "weights_per_device": cost.weight_bytes_per_device(weight_format("bf16"), 2),
        "weights": cost.weight_bytes_per_device(weight_format("bf16"), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode request")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: run one config
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(args.one, args.tokens)))
        return
    qwen3_06b_checkpoint()
    print(f"# {machine()}; Qwen3-0.6B shape, bf16, random weights; {time.strftime('%Y-%m-%d %H:%M')}")
    for transport in ("gloo", "shm"):
        link = measure_link(transport)  # the last, shared memory, is the engine's on one machine
        print(f"link ({transport}, 2 processes here): latency {link.latency * 1e6:.1f} us/hop, "
              f"bandwidth {link.bandwidth / 1e9:.2f} GB/s")
    results: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp in (1, 2):
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            done = subprocess.run([sys.executable, __file__, "--one", str(tp), "--tokens", str(args.tokens)],
                                  capture_output=True, text=True, env=env, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            results[tp].append(json.loads(line.removeprefix("RESULT ")))
            print(f"  round: TP={tp} {results[tp][-1]}", flush=True)
    best = {tp: {k: (max if k.startswith("decode_b") and "ms" not in k else min)(r[k] for r in runs)
                 for k in runs[0] if not isinstance(runs[0][k], list)} for tp, runs in results.items()}
    ruler = predicted(link)
    print("\n| measure | TP=1, 2 threads | TP=2, 1 thread/rank | TP=2 / TP=1 |")
    print("|---|---|---|---|")
    for key, unit in (("decode_b1", "tok/s"), (f"decode_b{BATCH}", "tok/s")):
        print(f"| {key} ({unit}) | {best[1][key]:.1f} | {best[2][key]:.1f} | {best[2][key] / best[1][key]:.2f}x |")
    p1, p2 = best[1]["prefill_512_s"], best[2]["prefill_512_s"]
    print(f"| prefill 512 (s) | {p1:.3f} | {p2:.3f} | {p1 / p2:.2f}x (speed) |")
    print("\n| TP=2 communication per step | measured (ms) | ruler (ms) | step (ms) |")
    print("|---|---|---|---|")
    for key in ("decode_b1", f"decode_b{BATCH}"):
        print(f"| {key} | {best[2][key + '_comm_ms']:.2f} | {ruler[key + '_comm_ms']:.2f} | {best[2][key + '_step_ms']:.1f} |")
    print(f"| prefill 512 | {best[2]['prefill_512_comm_ms']:.2f} | {ruler['prefill_512_comm_ms']:.2f} | "
          f"{1e3 * p2:.1f} |")
    ranks = results[2][-1]["weight_bytes_per_rank"]
    whole = results[1][-1]["weight_bytes_per_rank"][0]
    print(f"\nweights: TP=1 {whole / 1e9:.3f} GB; TP=2 per rank {', '.join(f'{b / 1e9:.3f}' for b in ranks)} GB "
          f"(measured); ruler per device {ruler['weights_per_device'] / 1e9:.3f} GB of {ruler['weights'] / 1e9:.3f}")


if __name__ == "__main__":
    main()
