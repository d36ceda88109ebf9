"""The engine's step loop: requests in, one scheduled forward per step, outputs out.

    add_request() -> Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update()
                  -> append sampled tokens, detokenize, check stop conditions -> RequestOutput

Not thread-safe: a server drives it from one thread (see tuili/server).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from tuili.config import (
    KV_CACHE_DTYPES,
    EngineConfig,
    ModelConfig,
    packed_compute_dtype,
    resolve_device,
    resolve_dtype,
)
from tuili.engine.kv_cache import BlockManager
from tuili.engine.request import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    Sequence,
)
from tuili.engine.runner import ModelRunner, kv_bytes_per_block
from tuili.engine.scheduler import Scheduler, SchedulerOutput
from tuili.errors import RequestError, TuiliError
from tuili.layers.sampler import SampledToken
from tuili.models.loader import load_model
from tuili.perf.cost import ModelCost
from tuili.perf.formats import canonical_dtype
from tuili.perf.hardware import current_hardware
from tuili.perf.meter import UtilizationMeter
from tuili.platform import Platform
from tuili.sampling import SamplingParams
from tuili.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


@dataclass
class EngineStats:
    """Counters since the engine started."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache misses, recomputes)


@dataclass
class _SequenceText:
    """Output-side state of one sequence: its text so far and how it is produced."""

    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    texts: dict[int, _SequenceText] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


def default_kv_cache_memory(device: torch.device) -> int:
    """2 GiB on a CPU (ample for the small models CPU serving targets; set kv_cache_memory
    for more); on a GPU 90% of the memory still free after the weights, less a reserve of
    1 GiB for activations."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * 0.9) - (1 << 30), 0)
    return 2 << 30


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.platform = Platform.detect(self.device)
        self.dtype = resolve_dtype(config.dtype, self.platform)
        torch.manual_seed(config.seed)
        loaded = load_model(
            config.model, self.dtype, self.platform, config.max_model_len, config.quantization,
            packed_compute_dtype(config.dtype, self.device, self.dtype),
        )
        self.weights_quantized = loaded.quantized
        self.model_config: ModelConfig = loaded.config
        self.model_path = loaded.path
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        cfg = self.model_config

        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        block_bytes = kv_bytes_per_block(cfg, config.block_size, self.kv_dtype)
        budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
        num_blocks = budget // block_bytes
        pool_tokens = num_blocks * config.block_size
        max_len = config.max_model_len or cfg.max_position_embeddings
        if config.max_model_len is None and pool_tokens < max_len:
            logger.info("capping max_model_len at %d: the KV pool holds %d tokens", pool_tokens, pool_tokens)
            max_len = pool_tokens
        if pool_tokens < max_len or num_blocks < 1:
            raise TuiliError(
                f"kv_cache_memory={budget} bytes holds {pool_tokens} tokens, fewer than "
                f"max_model_len={max_len}: raise kv_cache_memory or lower max_model_len"
            )
        self.max_model_len = max_len
        self.num_blocks = num_blocks
        self.eos_token_ids = set(cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())

        num_host_blocks = config.kv_offload_memory // block_bytes if config.enable_prefix_caching else 0
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(
            loaded.model, num_blocks, config.block_size, self.dtype, self.device, self.eos_token_ids, num_host_blocks,
            self.kv_dtype, max_len, config.enforce_eager,
        )
        self.stats = EngineStats()
        self.meter = self._build_meter(config.hardware)
        self._requests: dict[str, _Request] = {}
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.last_step: SchedulerOutput | None = None

    def _build_meter(self, hardware: str | None) -> UtilizationMeter:
        """Live MFU/MBU against this device's spec: a preset or spec file when named, else the
        last `tuili probe` of this machine, else a quick estimate (marked as such)."""
        cost = ModelCost.from_config(self.model_config.raw)
        spec = current_hardware(self.device.type, hardware)
        kv_per_token = kv_bytes_per_block(self.model_config, 1, self.kv_dtype)
        return UtilizationMeter(
            cost, spec, self.runner.weight_bytes(), kv_per_token, compute_dtype=canonical_dtype(str(self.dtype)),
            decode_weight_bytes=self.runner.decode_weight_bytes() if self.weights_quantized else None,
        )

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request; raises RequestError (nothing queued) when it is bad."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize_prompt(prompt)
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model was loaded without one")
        now = time.monotonic()
        req = _Request(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=now))
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_counter),
                request_id=request_id,
                index=index,
                token_ids=list(token_ids),
                prompt_len=len(token_ids),
                params=params,
                arrival_time=now,
            )
            req.seqs.append(seq)
            req.texts[seq.seq_id] = self._new_text_state(token_ids, params)
        self._requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        return request_id

    def _tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RequestError(f"prompt dict needs 'prompt_token_ids', got keys {sorted(prompt)}")
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "this model has no tokenizer files: give prompts as {'prompt_token_ids': [...]}"
                )
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise RequestError(f"prompt of type {type(prompt).__name__} is invalid: expected str, token ids or dict")
        if not ids or (isinstance(prompt, str) and not prompt):
            raise RequestError("prompt is empty: expected at least one token")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < vocab))
            raise RequestError(f"prompt token id {bad!r} is invalid: expected integers in [0, {vocab})")
        return text, list(ids)

    def _new_text_state(self, prompt_ids: list[int], params: SamplingParams) -> _SequenceText:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        matcher = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output) if params.stop_strings else None
        return _SequenceText(detok, matcher, logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; return the outputs of requests that progressed."""
        out = self.scheduler.schedule()
        self.last_step = out
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        now = time.monotonic()
        for item in out.scheduled:
            metrics = self._requests[item.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = item.seq.num_cached_tokens or 0
            seq = item.seq
            self.stats.prompt_tokens_computed += max(0, min(item.start + item.num_tokens, seq.prompt_len) - item.start)
        started = time.perf_counter()
        self.runner.copy_blocks(out.copies)
        sampled = self.runner.execute(out.scheduled)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a step without sampling returns before the GPU is done
        self.meter.record_step(*out.split_prefill_decode(), time.perf_counter() - started)
        self.scheduler.update(out)

        touched: dict[str, _Request] = {}
        sampling_seqs = [item.seq for item in out.scheduled if item.samples]
        now = time.monotonic()
        for seq, token in zip(sampling_seqs, sampled, strict=True):
            req = self._requests[seq.request_id]
            req.metrics.first_token_time = req.metrics.first_token_time or now
            self._append_token(req, seq, token)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
            outputs.append(self._output(req))
        return outputs

    def _append_token(self, req: _Request, seq: Sequence, token: SampledToken) -> None:
        params, state = seq.params, req.texts[seq.seq_id]
        seq.token_ids.append(token.token_id)
        if state.logprobs is not None:
            entry = dict(token.top_logprobs or {})
            entry[token.token_id] = token.logprob
            state.logprobs.append(entry)
            state.cumulative_logprob += token.logprob or 0.0

        n_out = seq.num_output_tokens
        may_stop = n_out >= params.min_tokens
        hit_eos = not params.ignore_eos and token.token_id in self.eos_token_ids
        hit_stop_id = token.token_id in params.stop_token_ids
        if state.detokenizer is not None and not ((hit_eos or hit_stop_id) and may_stop):
            delta = state.detokenizer.add(token.token_id)
            if state.stop_matcher is not None:
                delta, stopped = state.stop_matcher.feed(delta)
                state.text += delta
                if stopped and may_stop:
                    state.stop_reason = state.stop_matcher.matched
                    return self._finish(seq, "stop", flush_text=False)
            else:
                state.text += delta

        if may_stop and (hit_eos or hit_stop_id):
            state.stop_reason = token.token_id if hit_stop_id else None
            self._finish(seq, "stop")
        elif (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, flush_text: bool = True) -> None:
        """Retire `seq`. Text the stop-string matcher held back (it could have begun a stop
        string) is released unless a stop string actually matched."""
        req = self._requests.get(seq.request_id)
        if req is not None and flush_text:
            # Bytes of a character the last token left incomplete, then any held-back tail.
            state = req.texts[seq.seq_id]
            tail = state.detokenizer.flush() if state.detokenizer is not None else ""
            if state.stop_matcher is not None:
                tail, stopped = state.stop_matcher.feed(tail)
                if stopped:
                    state.stop_reason = state.stop_matcher.matched
                else:
                    tail += state.stop_matcher.flush()
            state.text += tail
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)

    def _output(self, req: _Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            state = req.texts[seq.seq_id]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=state.text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    logprobs=state.logprobs,
                    cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
                    stop_reason=state.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            metrics=req.metrics,
        )

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage
