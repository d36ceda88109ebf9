"""`tuili generate` and `tuili chat`, plus the engine and sampling flags other commands reuse."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tuili.engine.request import RequestOutput
from tuili.errors import TuiliError


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: expected e.g. 2GiB, 512MiB or a byte count")
    number, unit, binary = match.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** "_KMGT".index(unit.upper() or "_"))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="working dtype (auto: bf16 on CPUs where tuili's kernels run, else float32; bf16/fp16 on GPU)")
    group.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when present)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    group.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one step, decodes plus prefill chunks (default 512)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once (default 64)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's, capped by the KV pool)")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                       help="KV pool size, e.g. 2GiB (default: 2GiB on CPU, 90%% of free memory on GPU)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV of prompt prefixes computed before (on by default)")
    group.add_argument("--kv-offload-memory", type=parse_bytes, default=0,
                       help="host memory for prefix-cache blocks evicted from the KV pool, e.g. 4GiB (default 0: off)")
    group.add_argument("--state-checkpoint-interval", type=int, default=4,
                       help="hybrid models' prefix cache: checkpoint the linear-attention state every N KV "
                       "blocks of a prompt (default 4: every 64 tokens at block size 16)")
    group.add_argument("--hardware", default=None,
                       help="hardware preset or spec file that MFU/MBU are measured against "
                       "(default: this machine's `tuili probe` result, else a quick estimate)")
    group.add_argument("--quantization", default=None, choices=["int8", "int4"],
                       help="quantize a float checkpoint's linears at load: int8 per output channel, or int4 "
                       "in groups of 32 with scale and zero point (GGUF Q4_0/Q4_1/Q5_x/Q8_0 and K-quant linears run as stored "
                       "without this flag)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                       help="KV cache storage: auto = the working dtype; fp8 = float8 e4m3 with a scale per KV "
                       "head, set from the first keys/values written (half of bf16's bytes, a quarter of fp32's)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CPU decode graphs (replayed kernel calls, see "
                       "docs/kernels.md)")
    group.add_argument("--max-itl-stretch", type=float, default=None, metavar="X",
                       help="while sequences decode, cut the prompt chunks of a step so it takes about X times a "
                       "decode-only step (measured as the engine runs); 0 = no limit but --max-num-batched-tokens "
                       "(default: 2 for tuili serve, 0 otherwise)")
    group.add_argument("--seed", type=int, default=0, help="global seed for unseeded sampling (default 0)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over N ranks (heads, FFN channels, vocabulary; torch.distributed, "
                       "gloo on CPU, NCCL on GPU). Alone, this process starts the other N-1 ranks on this "
                       "machine; under torchrun every process runs the same command and rank 0 does the work "
                       "(default 1; docs/engine.md, \"Tensor parallelism\")")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="split the model's layers into M stages, one rank each (contiguous layers; the "
                       "first stage embeds, the last projects the logits), micro-batches in flight between "
                       "them; started as --tensor-parallel-size is; with it, each stage is a group of N ranks (N x M in all) "
                       "(default 1; docs/engine.md, \"Pipeline parallelism\")")
    group.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                       help="let each step pick its fastest kernels by row count: a request's output may then "
                       "depend on what else is in the batch, on prefix-cache hits and on chunking (default: "
                       "batch invariant, see docs/engine.md)")
    group.add_argument("--speculative-config", type=parse_json_object, default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s dict: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                       '(prompt_lookup_min/max), \'{"model": "PATH", "num_speculative_tokens": 3}\' for a draft model, '
                       '\'{"model": "self", "quantization": "int4", "num_speculative_tokens": 3}\' for the target '
                       'quantized as its own draft; "adaptive": false keeps k fixed (docs/engine.md)')
    group.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=parse_json_object,
                       default=None, metavar="JSON",
                       help='embeddings (/v1/embeddings), vLLM\'s dict: \'{"pooling_type": "MEAN", "normalize": '
                       'true}\'; pooling_type LAST (the last prompt token\'s final hidden state, the default) or '
                       "MEAN (over the prompt); normalize (default true) scales the vector to unit L2 norm")


def parse_json_object(text: str) -> dict:
    """argparse type: a JSON object (the value of --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching, kv_offload_memory=args.kv_offload_memory,
        state_checkpoint_interval=args.state_checkpoint_interval,
        hardware=args.hardware, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, seed=args.seed,
        max_itl_stretch=args.max_itl_stretch or None,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        batch_invariant=args.batch_invariant,
        speculative_config=args.speculative_config,
        pooler_config=args.pooler_config,
    )


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens,
                       help=f"tokens to generate at most (default {default_max_tokens})")
    group.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS/stop may end it")
    group.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1 disables")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def sampling_params(args: argparse.Namespace):
    from tuili.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def register(subparsers) -> None:
    gen = subparsers.add_parser(
        "generate", help="generate from a prompt (streamed) or a JSONL file of prompts (batched)",
        description="Generate text offline. --prompt streams one completion to the terminal; "
        "--prompts-file runs a JSONL file (one {\"prompt\": ...}, {\"prompt_token_ids\": [...]} or "
        "{\"messages\": [...]} per line) through continuous batching and writes JSONL results.",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompts-file", type=Path, help="JSONL file of prompts")
    gen.add_argument("--output", type=Path, default=None, help="where --prompts-file results go (default: stdout)")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap --prompt as a user message in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="interactive chat that keeps the conversation history",
                                 description="Chat with the model in the terminal. Commands: /reset clears "
                                 "the history, /exit (or Ctrl-D) quits.")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, default_max_tokens=512)
    chat.set_defaults(func=run_chat)


def _load(args: argparse.Namespace):
    from tuili import LLM

    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    print(
        f"tuili: {engine.model_path.name} on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
        f"KV pool {engine.pool.num_tokens} tokens",
        file=sys.stderr,
    )
    return llm


def _attach_meter(llm):
    """Live MFU/MBU of this run, against --hardware (else this machine's probe, else an estimate)."""
    from tuili.perf.meter import UtilizationMeter

    meter = UtilizationMeter.for_engine(llm.engine)
    llm.engine.add_observer(meter)
    return meter


def _stream(llm, prompt, params) -> Iterator[tuple[str, RequestOutput]]:
    """Yield (new text, output so far) for one request as the engine produces it."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    shown = 0
    try:
        while True:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                yield text[shown:], out
                shown = len(text)
                if out.finished:
                    return
    finally:
        engine.abort_request(request_id)


def worker_rank_status(args: argparse.Namespace) -> int | None:
    """Under torchrun, a rank other than 0 only runs rank 0's forwards: its exit status (0 when
    rank 0 stopped it, 1 when a rank was lost); None on rank 0 and on one device."""
    from tuili.config import EngineConfig
    from tuili.parallel.worker import is_worker_rank, run_worker

    config = EngineConfig(**engine_kwargs(args))
    return run_worker(config) if is_worker_rank(config) else None


def _parallel_summary(llm, meter) -> str | None:
    """The tensor- or pipeline-parallel communication line of the run summary (None on one device)."""
    engine = llm.engine
    if engine.parallel is None:
        return None
    comm, steps = engine.communication_seconds(), max(engine.stats().num_steps, 1)
    summary = meter.summary()
    busy = summary.prefill_seconds + summary.decode_seconds
    share = f", {100 * comm / busy:.1f}% of step time" if busy > 0 else ""
    if engine.stage is not None:
        stage = engine.stage
        ranks = f" x {stage.tp} tensor-parallel ranks" if stage.tp > 1 else ""
        return (f"pipeline parallel: {stage.world} stages{ranks}, rank 0 spent {comm:.3f} s sending hidden states, "
                f"waiting for and receiving logits{' and in its stage collectives' if ranks else ''} over {steps} "
                f"steps ({1e3 * comm / steps:.2f} ms/step{share})")
    return (f"tensor parallel: {engine.parallel.world} ranks, rank 0 spent {comm:.3f} s in all-reduces and the "
            f"logits gather over {steps} steps ({1e3 * comm / steps:.2f} ms/step{share})")


def run_generate(args: argparse.Namespace) -> int:
    status = worker_rank_status(args)
    if status is not None:
        return status
    try:
        params = sampling_params(args)
        llm = _load(args)
        meter = _attach_meter(llm)
        if args.prompt is not None:
            prompt = args.prompt
            if args.chat_template:
                prompt = {"prompt_token_ids": llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])}
            start, out = time.perf_counter(), None
            for delta, snapshot in _stream(llm, prompt, params):
                out = snapshot
                print(delta, end="", flush=True)
            print()
            generated = len(out.outputs[0].token_ids)
            print(f"tuili: {len(out.prompt_token_ids)} prompt + {generated} generated tokens in "
                  f"{time.perf_counter() - start:.2f}s ({out.outputs[0].finish_reason})", file=sys.stderr)
        else:
            _generate_file(llm, args.prompts_file, args.output, params)
        print(meter.summary().format(), file=sys.stderr)
        _print_speculation(llm)
        parallel = _parallel_summary(llm, meter)
        if parallel:
            print(parallel, file=sys.stderr)
        llm.engine.close()
        return 0
    except TuiliError as e:
        print(f"tuili: error: {e}", file=sys.stderr)
        return 2


def _print_speculation(llm) -> None:
    spec = llm.engine.stats().spec
    if spec is not None:
        print(
            f"speculative ({spec.method}): {spec.num_accepted_tokens} of {spec.num_proposed_tokens} proposed tokens "
            f"accepted ({spec.acceptance_rate:.1%}), {spec.tokens_per_verification:.2f} tokens per verifying step "
            f"({spec.num_verifications} verifications)",
            file=sys.stderr,
        )


def _read_prompts(path: Path, tokenizer) -> list:
    if not path.is_file():
        raise TuiliError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise TuiliError(f"{path}:{number} is not valid JSON: {e}") from e
        if isinstance(item, dict) and "messages" in item:
            if tokenizer is None:
                raise TuiliError(f"{path}:{number} has messages but the model has no tokenizer")
            prompts.append({"prompt_token_ids": tokenizer.apply_chat_template(item["messages"])})
        elif isinstance(item, dict) and ("prompt" in item or "prompt_token_ids" in item):
            prompts.append(item["prompt"] if "prompt_token_ids" not in item else {"prompt_token_ids": item["prompt_token_ids"]})
        else:
            raise TuiliError(f"{path}:{number}: expected an object with 'prompt', 'prompt_token_ids' or 'messages'")
    return prompts


def _generate_file(llm, path: Path, output: Path | None, params) -> None:
    prompts = _read_prompts(path, llm.engine.tokenizer)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)  # a bar of finished prompts, with tokens/s
    elapsed = time.perf_counter() - start
    sink = output.open("w") if output else sys.stdout
    try:
        for result in results:
            for completion in result.outputs:
                sink.write(json.dumps({
                    "prompt": result.prompt, "index": completion.index, "text": completion.text,
                    "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                }, ensure_ascii=False) + "\n")
    finally:
        if output:
            sink.close()
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    output_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    cache = llm.engine.stats().prefix_cache
    print(
        f"tuili: {len(results)} requests, {prompt_tokens} prompt + {output_tokens} output tokens in {elapsed:.2f}s "
        f"({output_tokens / elapsed:.1f} output tok/s); prefix cache hit rate {cache.hit_rate:.1%} "
        f"({cache.device_hit_tokens} tokens from the KV pool, {cache.host_hit_tokens} from host memory)",
        file=sys.stderr,
    )


def run_chat(args: argparse.Namespace) -> int:
    try:
        params = sampling_params(args)
        llm = _load(args)
        tokenizer = llm.engine.tokenizer
        if tokenizer is None:
            raise TuiliError("chat needs a model with a tokenizer and chat template")
        history = [{"role": "system", "content": args.system}] if args.system else []
        print("tuili chat — /reset clears the history, /exit quits", file=sys.stderr)
        while True:
            try:
                user = input("> ")
            except EOFError:
                print()
                return 0
            if user.strip() == "/exit":
                return 0
            if user.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            if not user.strip():
                continue
            history.append({"role": "user", "content": user})
            ids = tokenizer.apply_chat_template(history)
            reply, out, start = "", None, time.perf_counter()
            for delta, snapshot in _stream(llm, {"prompt_token_ids": ids}, params):
                reply, out = reply + delta, snapshot
                print(delta, end="", flush=True)
            print()
            generated = len(out.outputs[0].token_ids)
            print(
                f"[{len(ids)} prompt tokens, {out.metrics.num_cached_tokens} from cache; {generated} generated "
                f"in {time.perf_counter() - start:.1f}s]",
                file=sys.stderr,
            )
            history.append({"role": "assistant", "content": reply})
    except TuiliError as e:
        print(f"tuili: error: {e}", file=sys.stderr)
        return 2
