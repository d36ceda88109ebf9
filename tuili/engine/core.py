"""The engine's step loop: requests in, one scheduled forward per step, outputs out.

    add_request() -> Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update()
                  -> OutputProcessor.append() (detokenize, stop checks) -> RequestOutput
                  -> a StepRecord to each observer (tuili/engine/stats.py)

The KV pool's size is planned once (tuili/engine/pool.py); `stats()` snapshots the counters.
Not thread-safe: a server drives it from one thread (see tuili/server).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch
from torch import nn

from tuili.config import (
    EngineConfig,
    ModelConfig,
    packed_compute_dtype,
    resolve_device,
    resolve_dtype,
)
from tuili.engine.block_manager import BlockManager
from tuili.engine.output_processor import OutputProcessor, RequestState
from tuili.engine.pacing import StepPacer
from tuili.engine.pool import plan_pool
from tuili.engine.request import RequestMetrics, RequestOutput, Sequence
from tuili.engine.runner import ModelRunner, RunnerConfig
from tuili.engine.scheduler import Scheduler, SchedulerOutput
from tuili.engine.spec.build import build_speculator
from tuili.engine.spec.draft import DraftModel
from tuili.engine.spec.mtp import MTPProposer
from tuili.engine.state_checkpoints import StateCheckpoints
from tuili.engine.state_slots import StateSlots
from tuili.engine.stats import EngineStats, StepObserver, StepRecord
from tuili.engine.stopping import StopTokens
from tuili.errors import RequestError
from tuili.layers.grammar import GrammarCompiler
from tuili.models.loader import load_model
from tuili.parallel import group as tensor_parallel
from tuili.parallel.pipeline import PipelineStage, join_stage
from tuili.parallel.pipeline_runner import PipelineModelRunner
from tuili.parallel.runner import ParallelModelRunner
from tuili.parallel.shard import TensorShard
from tuili.platform import Platform
from tuili.pooling import PoolerConfig
from tuili.sampling import SamplingParams
from tuili.tokenizer import Tokenizer

Prompt = str | list[int] | dict

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        # Tensor parallelism (tuili/parallel): this process is one rank; rank 0 runs the engine,
        # the other ranks only its forwards (ParallelModelRunner.serve). On GPUs each rank takes
        # the GPU of its local rank.
        # Pipeline parallelism (tuili/parallel/pipeline.py) uses the same group and processes:
        # each rank is a stage, rank 0 the first.
        # Both: world = TP x PP ranks, each stage a tensor-parallel group of its own.
        self.parallel: tensor_parallel.TensorParallelGroup | None = None
        self.stage: PipelineStage | None = None
        self.stage_tensor_group: tensor_parallel.TensorParallelGroup | None = None
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if tp * pp > 1:
            kind = "pipeline-parallel" if pp > 1 else "tensor-parallel"
            self.parallel = tensor_parallel.join(tp * pp, self.device, config, kind)
            self.device = self.parallel.device
        if self.parallel is not None and pp > 1:
            self.stage, self.stage_tensor_group = join_stage(self.parallel, tp, pp)
        self.platform = Platform.detect(self.device, config.batch_invariant)
        self.dtype = resolve_dtype(config.dtype, self.platform)
        torch.manual_seed(config.seed)
        try:
            self._build(config)
        except BaseException as e:
            if self.parallel is not None:  # the other ranks would wait for this one forever
                self.parallel.fail(f"rank {self.parallel.rank} failed to start: {e}")
            raise

    def _build(self, config: EngineConfig) -> None:
        loaded = load_model(
            config.model, self.dtype, self.platform, config.max_model_len, config.quantization,
            packed_compute_dtype(config.dtype, self.device, self.dtype),
            self._tensor_parallel(), self.stage,
        )
        self.weights_quantized = loaded.quantized
        self.model_config: ModelConfig = loaded.config
        self.model_path = loaded.path
        self.tokenizer: Tokenizer | None = loaded.tokenizer

        # The KV pool holds this rank's KV heads (the network's config; the model's when whole).
        # Rank 0 holds the most, so its plan fits every rank: all take it.
        self.pool = plan_pool(loaded.model.config, config, self.dtype, self.device)
        if self.model_config.is_hybrid and config.enable_prefix_caching and not self.pool.num_state_checkpoints:
            # A cached prefix gives the KV of the full-attention layers but not the linear
            # layers' state after it: without a checkpoint to restore, a hit would continue
            # from the wrong state.
            logger.info(
                "prefix caching is off for %s: the KV budget leaves no room for a linear-attention "
                "state checkpoint (%d bytes); raise kv_cache_memory", self.model_config.architecture,
                self.pool.state_bytes_per_slot,
            )  # fmt: skip
            config = dataclasses.replace(config, enable_prefix_caching=False)
            self.config = config
            self.pool = plan_pool(loaded.model.config, config, self.dtype, self.device)
        if self.stage is not None:  # each stage planned for its own layers: the smallest pool fits all
            assert self.parallel is not None
            plans = self.parallel.gather_objects(self.pool)
            self.pool = self.parallel.broadcast(min(plans, key=lambda p: p.num_blocks) if plans else None)
        elif self.parallel is not None:
            self.pool = self.parallel.broadcast(self.pool)
        self.max_model_len = self.pool.max_model_len
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else set()
        stop_tokens = StopTokens(frozenset(self.model_config.eos_token_ids) | tokenizer_eos)
        self.eos_token_ids = stop_tokens.eos_token_ids
        # Structured output needs the tokenizer's vocabulary; a model without one cannot have it.
        self.grammars = GrammarCompiler(
            self.tokenizer.hf_tokenizer, self.model_config.vocab_size, self.eos_token_ids
        ) if self.tokenizer is not None else None
        self.block_manager = BlockManager(
            self.pool.num_blocks, self.pool.block_size, config.enable_prefix_caching, self.pool.num_host_blocks,
        )
        # A hybrid model runs at most as many sequences as the plan reserved state slots for,
        state_slots = StateSlots(self.pool.num_state_slots) if self.pool.num_state_slots else None
        # and restores a cached prefix's linear-attention state from a checkpoint.
        checkpoints = StateCheckpoints(
            self.pool.num_state_checkpoints, self.pool.block_size, config.state_checkpoint_interval,
            self.pool.num_host_checkpoints,
        ) if self.pool.num_state_checkpoints else None  # fmt: skip
        max_num_seqs = min(config.max_num_seqs, self.pool.num_state_slots or config.max_num_seqs)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, max_num_seqs, state_slots, checkpoints,
        )  # fmt: skip
        # Several ranks replay CPU graphs only when their all-reduce is one a graph records (the
        # shared-memory one, tuili/parallel/shm.py); pipeline stages run eagerly.
        eager_ranks = self.parallel is not None and (self.parallel.link is None or self.stage is not None)
        runner_config = RunnerConfig(self.device, self.dtype, stop_tokens, config.enforce_eager or eager_ranks, self.grammars)
        self.runner: ModelRunner
        if self.parallel is None:
            self.runner = ModelRunner(loaded.model, self.pool, runner_config)
        elif self.stage is not None:
            self.runner = PipelineModelRunner(loaded.model, self.pool, runner_config, self.parallel)
        else:
            self.runner = ParallelModelRunner(loaded.model, self.pool, runner_config, self.parallel)
        self.outputs = OutputProcessor(self.tokenizer, stop_tokens, self.max_model_len)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = build_speculator(
                config, self.model_config, self.model_path, self.pool, self.platform, self.dtype, stop_tokens,
                self.runner,
            )
        self._observers: list[StepObserver] = []
        self._synchronize = False  # an observer wants device time and the device runs asynchronously
        self.pacer = StepPacer(config.max_itl_stretch) if config.max_itl_stretch is not None else None
        if self.pacer is not None:
            self.add_observer(self.pacer)
        self._requests: dict[str, RequestState] = {}
        # Final outputs of requests aborted between steps, handed out by the next step() so
        # that a caller waiting for every request to finish (LLM.generate) sees them end.
        self._aborted: list[RequestOutput] = []
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self._prompt_tokens_computed = 0
        self._generation_tokens = 0
        self._num_steps = 0
        self._num_preemptions = 0

    def _tensor_parallel(self) -> tuple[TensorShard, tensor_parallel.TensorParallelGroup] | None:
        """This rank's tensor-parallel shard and the group its layers communicate in (the whole
        group, or under pipeline parallelism its stage's); None without tensor parallelism."""
        if self.stage_tensor_group is not None:
            return self.stage_tensor_group.shard, self.stage_tensor_group
        if self.parallel is not None and self.stage is None:
            return self.parallel.shard, self.parallel
        return None

    @property
    def model(self) -> nn.Module:
        """The loaded network, for inspection (perf's byte counts, tests); the runner drives it."""
        return self.runner.model

    def weight_bytes(self) -> int:
        """Bytes of the weights held, each storage once (ModelRunner.weight_bytes)."""
        return self.runner.weight_bytes()

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (ModelRunner.decode_weight_bytes)."""
        return self.runner.decode_weight_bytes()

    def communication_seconds(self) -> float:
        """Seconds this rank spent in tensor-parallel collectives (all-reduces and the logits
        gather) or, under pipeline parallelism, blocked in its sends and receives between stages
        (waits for a neighbour stage included) since the start; 0 on one device."""
        stage = self.stage_tensor_group.comm_seconds if self.stage_tensor_group is not None else 0.0
        return self.parallel.comm_seconds + stage if self.parallel is not None else 0.0

    def healthy(self) -> bool:
        """False once a tensor-parallel rank is lost: no step can run any more."""
        return self.parallel is None or self.parallel.failure is None

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at exit); nothing to do on one device."""
        if self.parallel is not None:
            self.parallel.stop()

    def draft_weight_bytes(self) -> int:
        """Bytes of weights one forward of the speculative draft model or MTP step reads (0 without one)."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        return proposer.weight_bytes() if isinstance(proposer, (DraftModel, MTPProposer)) else 0

    def add_observer(self, observer: StepObserver) -> None:
        """Hand every later step's StepRecord to `observer` (tuili/engine/stats.py)."""
        self._observers.append(observer)
        self._synchronize = self.device.type == "cuda" and any(o.wants_device_time for o in self._observers)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters. Like the engine, not thread-safe:
        call it on the thread that steps the engine."""
        blocks = self.block_manager
        return EngineStats(
            num_requests=len(self._requests),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            kv_cache_usage=blocks.usage,
            prefix_cache=dataclasses.replace(blocks.stats),
            prompt_tokens_computed=self._prompt_tokens_computed,
            generation_tokens=self._generation_tokens,
            num_steps=self._num_steps,
            num_preemptions=self._num_preemptions,
            spec=dataclasses.replace(self.speculator.stats) if self.speculator is not None else None,
            state_checkpoints=checkpoints.snapshot() if (checkpoints := self.scheduler.checkpoints) else None,
        )

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    group: str | None = None, pooling: PoolerConfig | None = None) -> str:
        """Validate and queue a request; raises RequestError (nothing queued) when it is bad.

        `group` names who the request is scheduled fairly against (the server gives every
        request of one API call the call's id); requests without one share one group, which
        the scheduler serves first come, first served. With `pooling` it is an embedding
        request: its prompt is computed (prefill only, batched with everything else) and its
        one output is the pooled vector (`RequestOutput.embedding`); `params` is not used."""
        if pooling is not None:
            return self._add_embedding(prompt, pooling, request_id, group)
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize_prompt(prompt)
        truncated = params.truncate(token_ids, self.max_model_len)
        if len(truncated) < len(token_ids):  # the prompt reported back is the one that ran
            token_ids = truncated
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer else None
        self._check_logit_controls(params)
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model was loaded without one")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise RequestError("structured outputs need a tokenizer; this model was loaded without one")
            self.grammars.compile(params.structured_outputs)  # refused here if it does not compile; cached
        now = time.monotonic()
        req = RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=now),
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_counter),
                request_id=request_id,
                index=index,
                token_ids=list(token_ids),
                prompt_len=len(token_ids),
                params=params,
                arrival_time=now,
                group=group or "",
            )
            req.seqs.append(seq)
            req.texts[seq.seq_id] = self.outputs.new_text(token_ids, params)
        self._requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        return request_id

    def _add_embedding(self, prompt: Prompt, pooling: PoolerConfig, request_id: str | None, group: str | None) -> str:
        if self.parallel is not None:
            raise RequestError(
                "embeddings are not supported with tensor_parallel_size > 1 or pipeline_parallel_size > 1: "
                "run the model whole"
            )
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize_prompt(prompt)
        if len(token_ids) > self.max_model_len:  # nothing is generated: the prompt may fill the context
            raise RequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: shorten it"
            )
        params = SamplingParams(max_tokens=1)
        now = time.monotonic()
        req = RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=now))
        seq = Sequence(
            seq_id=next(self._seq_counter), request_id=request_id, index=0, token_ids=list(token_ids),
            prompt_len=len(token_ids), params=params, arrival_time=now, group=group or "", pooling=pooling,
        )  # fmt: skip
        req.seqs.append(seq)
        self._requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _check_logit_controls(self, params: SamplingParams) -> None:
        """Tokenize the request's bad words and refuse token ids beyond the vocabulary."""
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words need a tokenizer; this model was loaded without one")
            tokenizer = self.tokenizer
            params.tokenize_bad_words(lambda word: tokenizer.encode(word, add_special_tokens=False),
                                      self.model_config.vocab_size)
        else:
            params.check_token_ids(self.model_config.vocab_size)

    def _tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TokensPrompt {"prompt_token_ids": [...]} or TextPrompt {"prompt": text}
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or not prompt:
                raise RequestError(
                    f"prompt dict with keys {sorted(prompt)} is invalid: expected 'prompt' (text) or "
                    "'prompt_token_ids' (tuili takes no other prompt inputs)"
                )
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif isinstance(prompt["prompt"], str):
                return self._tokenize_prompt(prompt["prompt"])
            else:
                raise RequestError(f"prompt dict's 'prompt'={prompt['prompt']!r} is invalid: expected text")
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

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored.

        The next step() returns its final output: what it generated so far, finished, with
        finish_reason "abort" on the sequences that had not finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._retire(seq, "abort")
        req.metrics.finished_time = time.monotonic()
        self._aborted.append(self.outputs.output(req))

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: requests to run, or aborted requests' final outputs to return."""
        return bool(self._requests or self._aborted)

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; return the outputs of requests that progressed, after
        the final outputs of requests aborted since the last step."""
        aborted, self._aborted = self._aborted, []
        started = time.perf_counter()
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        out = self.scheduler.schedule(self.pacer.prefill_limit() if self.pacer is not None else None)
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending")
            return aborted
        now = time.monotonic()
        prompt_tokens = 0
        for item in out.scheduled:
            seq = item.seq
            metrics = self._requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens or 0
            prompt_tokens += max(0, min(item.start + item.num_tokens, seq.prompt_len) - item.start)
        forward_started = time.perf_counter()
        captures = self.runner.graph_captures()
        self.runner.copy_blocks(out.copies)
        result = self.runner.execute(out.scheduled, proposals)
        sampled = result.sampled
        if self.speculator is not None:  # MTP's pass over the step's hidden states is the step's time too
            self.speculator.proposer.observe(out.scheduled, sampled)
        if self._synchronize:
            torch.cuda.synchronize(self.device)  # a step without sampling returns before the GPU is done
        finished = time.perf_counter()
        seconds = finished - started  # the proposals' time is the step's too
        accepted = None
        if self.speculator is not None:
            steady = self.runner.graph_captures() == captures  # else not a cost adaptive k may fit
            accepted = self.speculator.record(out, sampled, finished - forward_started, steady)
        self.scheduler.update(out, accepted)

        for scored in result.prompt_logprobs:
            self.outputs.add_prompt_logprobs(self._requests[scored.seq.request_id], scored)
        touched: dict[str, RequestState] = {}
        pooled = self.runner.take_pooled()
        if pooled:
            for item in out.scheduled:
                vector = pooled.get(item.seq.seq_id)
                if vector is not None:  # an embedding's prompt is done: it ends with its vector
                    req = self._requests[item.seq.request_id]
                    req.embedding = vector
                    self._retire(item.seq, "stop")
                    touched[req.request_id] = req
        sampling_seqs = [item.seq for item in out.scheduled if item.samples]
        now = time.monotonic()
        num_sampled = 0
        for seq, tokens in zip(sampling_seqs, sampled, strict=True):
            req = self._requests[seq.request_id]
            req.metrics.first_token_time = req.metrics.first_token_time or now
            for token in tokens:  # several when proposals were kept; a stop among them ends it there
                num_sampled += 1
                reason = self.outputs.append(seq, req.texts[seq.seq_id], token)
                if reason is not None:
                    self._retire(seq, reason)
                    break
            touched[req.request_id] = req
        outputs = aborted
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
            outputs.append(self.outputs.output(req))

        self._prompt_tokens_computed += prompt_tokens
        self._generation_tokens += num_sampled
        self._num_steps += 1
        self._num_preemptions += len(out.preempted)
        if self._observers:
            self._report(out, prompt_tokens, num_sampled, seconds, proposals, accepted)
        return outputs

    def _report(self, out: SchedulerOutput, prompt_tokens: int, num_sampled: int, seconds: float,
                proposals: dict | None, accepted: dict | None) -> None:
        chunks, decodes = out.split_prefill_decode()
        record = StepRecord(
            prefill_chunks=chunks, decode_context_lens=decodes, num_sampled=num_sampled,
            num_preempted=len(out.preempted), prompt_tokens_computed=prompt_tokens, seconds=seconds,
            synchronized=self._synchronize or self.device.type != "cuda",
            verify_chunks=out.verify_chunks(), num_accepted=sum(accepted.values()) if accepted else 0,
            draft_forwards=max((len(p.token_ids) for p in proposals.values()), default=0)
            if proposals and self.speculator is not None and self.speculator.config.method != "ngram" else 0,
        )
        for observer in self._observers:
            observer.on_step(record)

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Free a finished or aborted sequence's blocks and per-sequence state now."""
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
