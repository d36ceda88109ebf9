"""Tensor parallelism on CPU with gloo and real processes (tuili/parallel).

- TP=2 and TP=3 against TP=1 in float32 on random checkpoints written by `save_pretrained`:
  logits of a batch of prompts within a tight tolerance and 32+ greedy tokens identical, on a
  Qwen3 shape with 12 query / 4 KV heads (TP=3: KV groups split 2/1/1), an intermediate size
  of 200 (not a multiple of 3) and biases on q/k/v/o, and on a tied-embedding Llama;
- every rank's weight bytes, measured by the rank itself: about 1/N of the whole;
- `tuili serve -tp 2`: serves; a killed worker fails the request in flight, the server exits
  with status 1 within seconds and leaves no process; SIGTERM stops every rank;
- two "nodes" on this machine through `torchrun --nnodes 2 --nproc-per-node 1` and a c10d
  rendezvous on localhost: rank 0 serves a request, and SIGTERM to both launchers ends it all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams
from tuili.config import ModelConfig
from tuili.engine.request import Sequence
from tuili.engine.scheduler import ScheduledSeq
from tuili.errors import TuiliError
from tuili.parallel.shard import TensorShard, attention_split

PROMPTS = [[5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13], [42], list(range(30, 53)), [7, 7, 7, 200, 201]]
COMMON = dict(vocab_size=320, hidden_size=96, num_hidden_layers=2, max_position_embeddings=4096,
              initializer_range=0.1, rms_norm_eps=1e-6)
CHECKPOINTS = {
    "qwen3-12q-4kv-ffn200": (transformers.Qwen3Config, dict(
        intermediate_size=200, num_attention_heads=12, num_key_value_heads=4, head_dim=16,
        attention_bias=True, tie_word_embeddings=False)),
    "llama-tied": (transformers.LlamaConfig, dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}
# One prefill step for all prompts, then decodes: the fewest steps (paging and chunking are the
# single-rank tests' business; here only the split is new).
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tuili.models.default_model import default_model_path

    paths = {"smollm2-gguf": default_model_path()}
    for name, (config_class, extra) in CHECKPOINTS.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **extra)).save_pretrained(path)
        paths[name] = path
    return paths


def _run(llm: LLM) -> tuple[torch.Tensor, list[list[int]]]:
    """Every prompt token's logits in one prefill, then 32 greedy tokens per prompt."""
    engine, batch = llm.engine, []
    for i, ids in enumerate(PROMPTS):
        seq = Sequence(seq_id=10_000 + i, request_id=str(i), index=0, token_ids=list(ids), prompt_len=len(ids),
                       params=SamplingParams())
        engine.block_manager.grow(seq, len(ids))
        batch.append(ScheduledSeq.next_chunk(seq, len(ids)))
    logits = engine.runner.logits(batch)
    for item in batch:
        engine.block_manager.free(item.seq)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return logits, [o.outputs[0].token_ids for o in outs]


# SmolLM2 (the real GGUF, dequantized to float32): a tied Llama with 9 query / 3 KV heads, split 2/1.
# Ranks on one machine talk through shared memory (tuili/parallel/shm.py) and replay their decode
# steps from CPU graphs; without the native kernels (as on a machine with no C compiler) they stay
# on gloo and run eagerly, which must agree too.
@pytest.mark.parametrize(("name", "tp", "transport"), [
    ("qwen3-12q-4kv-ffn200", 2, "shared memory"), ("qwen3-12q-4kv-ffn200", 3, "shared memory"),
    ("smollm2-gguf", 2, "shared memory"), ("qwen3-12q-4kv-ffn200", 2, "gloo"),
])
def test_tensor_parallel_matches_one_rank(checkpoints, name, tp, transport, monkeypatch):
    if transport == "gloo":
        monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    whole = LLM(str(checkpoints[name]), **ENGINE)
    ref_logits, ref_tokens = _run(whole)
    whole_bytes = whole.engine.weight_bytes()
    del whole
    llm = LLM(str(checkpoints[name]), tensor_parallel_size=tp, **ENGINE)
    try:
        logits, tokens = _run(llm)
        per_rank = llm.engine.runner.weight_bytes_per_rank()
        comm = llm.engine.communication_seconds()
        linked = llm.engine.parallel.link is not None
        graphs = llm.engine.runner.graphs
        replayed = bool(graphs.captured_batch_sizes()) if graphs is not None else False
    finally:
        llm.engine.close()
    # float32 sums in another order: a few ulps of the largest logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-4)
    assert tokens == ref_tokens and all(len(t) == 32 for t in tokens)
    # Each rank holds its share: the shards add up to the whole plus the replicated norms, and
    # no rank holds much more than 1/N (an uneven attention split gives rank 0 more: 2 of 4 KV
    # groups at TP=3, 2 of SmolLM2's 3 at TP=2).
    assert len(per_rank) == tp
    assert whole_bytes <= sum(per_rank) <= whole_bytes * 1.02
    assert max(per_rank) <= whole_bytes / tp * 1.3, (per_rank, whole_bytes)
    assert comm > 0
    assert linked == (transport == "shared memory")
    # Decode steps replayed CPU graphs with the all-reduces inside them (shared memory only).
    assert replayed == (transport == "shared memory")


def test_a_packed_gguf_weight_is_cut_by_rows_and_by_whole_blocks():
    from tuili.layers.quant.formats import quantize_int4, quantize_int8, quantize_int8_group
    from tuili.parallel.shard import narrow

    weight = torch.randn(48, 128)
    for quantized in (quantize_int4(weight, 32), quantize_int8_group(weight, 32), quantize_int8(weight)):
        whole = quantized.dequantize()
        torch.testing.assert_close(narrow(quantized, 0, 16, 40).dequantize(), whole[16:40], rtol=0, atol=0)
        torch.testing.assert_close(narrow(quantized, 1, 32, 96).dequantize(), whole[:, 32:96], rtol=0, atol=0)
    with pytest.raises(TuiliError, match="cut its groups of 32"):
        narrow(quantize_int4(weight, 32), 1, 16, 64)


def test_kv_heads_split_by_whole_groups_or_replicated():
    cfg = ModelConfig.from_hf_config({**transformers.Qwen3Config(**COMMON, **CHECKPOINTS["qwen3-12q-4kv-ffn200"][1]).to_dict(),
                                      "architectures": ["Qwen3ForCausalLM"]})
    assert [attention_split(cfg, TensorShard(r, 3)).num_kv_heads for r in range(3)] == [2, 1, 1]
    assert [attention_split(cfg, TensorShard(r, 3)).num_heads for r in range(3)] == [6, 3, 3]
    # 8 ranks over 4 KV heads: each KV head on 2 ranks, which split its 3 query heads... unevenly: refused.
    with pytest.raises(TuiliError, match="tensor_parallel_size=8 cannot split 4 KV heads"):
        attention_split(cfg, TensorShard(0, 8))
    wide = cfg.__class__(**{**cfg.__dict__, "num_heads": 16})  # 4 query heads per KV head
    split = [attention_split(wide, TensorShard(r, 8)) for r in range(8)]
    assert [(s.kv_start, s.q_start, s.num_heads) for s in split[:3]] == [(0, 0, 2), (0, 2, 2), (1, 4, 2)]


# ---- processes --------------------------------------------------------------------------












def test_serve_survives_nothing_of_a_lost_worker(checkpoints, tmp_path, served_ranks):
    """A killed worker: the request in flight fails, /health stops answering 200, the server
    exits 1 within seconds and no process is left; a plain SIGTERM stops every rank (status 0)."""
    log = tmp_path / "serve.log"
    server = served_ranks.serve(checkpoints["llama-tied"], log, "--tensor-parallel-size", "2")
    try:
        url = served_ranks.wait_for_url([log], [server])
        assert served_ranks.complete(url).status_code == 200
        served_ranks.kill_a_worker_mid_request(server, url, log, "tensor-parallel worker rank 1")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()

    server = served_ranks.serve(checkpoints["llama-tied"], log, "--tensor-parallel-size", "2")
    try:
        url = served_ranks.wait_for_url([log], [server])
        assert served_ranks.complete(url).status_code == 200
        ranks = served_ranks.children(server.pid)
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        deadline = time.monotonic() + 10
        while served_ranks.alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served_ranks.alive(ranks) == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_torchrun(checkpoints, tmp_path, served_ranks):
    port = _free_port()
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tuili-test",
               "-m", "tuili.cli", "serve", "--model", str(checkpoints["llama-tied"]), "--dtype", "float32",
               "--kv-cache-memory", "16MiB", "--port", "0", "--served-model-name", "m", "--shutdown-grace", "2",
               "--tensor-parallel-size", "2"]
    nodes = [subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              cwd=tempfile.gettempdir()) for log in logs]
    try:
        url = served_ranks.wait_for_url(logs, nodes)
        answer = served_ranks.complete(url)
        assert answer.status_code == 200, answer.text
        whole = LLM(str(checkpoints["llama-tied"]), **ENGINE)
        expected = whole.generate({"prompt_token_ids": [5, 17, 250]},
                                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        assert answer.json()["usage"]["completion_tokens"] == len(expected) == 8
        ranks = [pid for node in nodes for pid in served_ranks.children(node.pid)]
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait(60)
        deadline = time.monotonic() + 10
        while served_ranks.alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served_ranks.alive(ranks) == []
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
