"""One engine, loaded once, timing generate calls on request for benchmarks/cpu.py.

The same script runs under tuili's Python and under vLLM-CPU's venv: the two offline APIs agree
(`LLM(model=..., **options)`, `SamplingParams`, `LLM.generate` over `{"prompt_token_ids": [...]}`),
so both engines are measured by the very same code.

    python cpu_worker.py '{"engine": "tuili", "model": PATH, "options": {...}, "vocab": N, "threads": 2,
                           "prefill": 512}'

It loads the model, prints one line `READY {facts}`, then reads one JSON call per stdin line,
`[batch, prompt, max_tokens]`, and answers each with `TIMED {"seconds": s}`: the wall time of one
`generate` over `batch` fresh prompts of `prompt` random token ids (no prefix-cache hits),
`max_tokens` each. An error is a line `ERROR {...}`. The parent keeps several engines loaded at
once and calls them in turn, so that every engine sees the same moments of a host whose speed
drifts (benchmarks/cpu.py). Engines also log to stdout; the parent reads only the marked lines.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback

READY, TIMED, ERROR = "READY ", "TIMED ", "ERROR "


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        llm, generate = load(job)
    except Exception as e:  # reported, not raised: the parent prints it in the column's place
        reply(ERROR, failure(e))
        return
    if llm is None:
        reply(ERROR, {"pending": generate})
        return
    reply(READY, tuili_facts(llm, job["prefill"]) if job["engine"] == "tuili" else vllm_facts(llm))
    for line in sys.stdin:
        try:
            reply(TIMED, {"seconds": generate(*json.loads(line))})
        except Exception as e:
            reply(ERROR, failure(e))


def reply(marker: str, payload: dict) -> None:
    print(marker + json.dumps(payload), flush=True)


def failure(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def load(job: dict):
    """(llm, generate(batch, prompt, max_tokens) -> seconds), or (None, why) when tuili does not
    know an option of this column yet (a pending column, not a failure)."""
    import torch

    torch.set_num_threads(job["threads"])
    engine = job["engine"]
    if engine == "tuili":
        from tuili import LLM, SamplingParams

        extra_params, generate_kwargs = {}, {}
    else:
        from vllm import LLM, SamplingParams

        extra_params, generate_kwargs = {"detokenize": False}, {"use_tqdm": False}
    try:
        llm = LLM(model=job["model"], **job["options"])
    except TypeError as e:
        return None, str(e)
    except Exception as e:
        if "unknown LLM option" in str(e):
            return None, str(e)
        raise
    rng = random.Random(0)
    vocab = job["vocab"]

    def generate(batch: int, prompt: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt)]} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra_params)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, **generate_kwargs)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != batch * max_tokens:
            raise RuntimeError(f"{engine} produced {produced} tokens, expected {batch} x {max_tokens}")
        return elapsed

    return llm, generate


def tuili_facts(llm, prefill: int) -> dict:
    """What the parent needs for MBU and MFU: the weight bytes one decode step reads, the KV
    bytes of one token of context, and the FLOPs of a `prefill`-token prompt by tuili's cost model."""
    from tuili.perf.cost import ModelCost

    engine = llm.engine
    return {
        "weight_bytes": engine.weight_bytes(),
        "decode_weight_bytes": engine.decode_weight_bytes(),
        "kv_bytes_per_token": engine.pool.kv_bytes_per_token,
        "prefill_flops": ModelCost.from_config(engine.model_config.raw).prefill_flops(0, prefill),
        "dtype": str(engine.dtype),
    }


def vllm_facts(llm) -> dict:
    """How vLLM ran the model: compiled (its default) or eager."""
    compilation = llm.llm_engine.vllm_config.compilation_config
    return {"compilation": f"mode {compilation.mode.name}, backend {compilation.backend or 'default'}"}


if __name__ == "__main__":
    main()
