"""The offline Python API, in the shape vLLM users know:

    from tuili import LLM, SamplingParams
    llm = LLM()                       # the embedded SmolLM2 model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from tuili.config import EngineConfig
from tuili.engine.core import LLMEngine, Prompt
from tuili.engine.request import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tuili.errors import RequestError, TuiliError
from tuili.pooling import PoolingParams
from tuili.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        """`model`: a Hugging Face directory or .gguf file (None: the embedded SmolLM2).
        `options`: any EngineConfig field — dtype, device, block_size, max_num_batched_tokens
        (default here OFFLINE_MAX_NUM_BATCHED_TOKENS, not the engine's 512),
        max_num_seqs, max_model_len, kv_cache_memory or gpu_memory_utilization (the KV budget
        as a fraction of the memory free after loading on a GPU, of the RAM available on a CPU;
        docs/engine.md), enable_prefix_caching,
        kv_offload_memory, quantization, kv_cache_dtype, hardware (the spec a UtilizationMeter
        built with `for_engine` judges this engine against), seed, tensor_parallel_size (N ranks:
        this process is rank 0 and starts the others; `llm.engine.close()` stops them, as exit
        does; docs/engine.md, "Tensor parallelism"), pipeline_parallel_size (M stages, started
        the same way; docs/engine.md, "Pipeline parallelism")."""
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TuiliError(f"unknown LLM option(s) {unknown}: expected some of {sorted(known)}")
        # Offline, throughput beats the latency of the decodes waiting behind a prefill: bigger
        # steps, as vLLM's LLM class also defaults to (docs/engine.md).
        options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    def get_tokenizer(self) -> PreTrainedTokenizerFast:
        """The model's Hugging Face tokenizer, as vLLM's `get_tokenizer()` returns: a transformers
        `PreTrainedTokenizerFast` built from the checkpoint's tokenizer.json (or a GGUF file's
        vocabulary), with its `eos_token_id` and chat template, so that
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` gives the text
        `chat` would run. (`llm.engine.tokenizer` is tuili's own wrapper around it: incremental
        detokenizing, the end-of-turn ids from generation_config.json, content kept as text.)"""
        if self.engine.tokenizer is None:
            raise TuiliError("this model has no tokenizer files: give prompts as {'prompt_token_ids': [...]}")
        return self.engine.tokenizer.hf_tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        *,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        All prompts are validated before any runs, so a bad one raises without side effects.
        `use_tqdm` (vLLM's argument, but off by default): True shows a tqdm bar on stderr, of
        finished prompts with the output tokens/s; a callable is used in tqdm's place.
        `on_step` (optional) sees each step's outputs; a request it aborts
        (`llm.engine.abort_request`) is returned as it stood, with finish_reason "abort".
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise RequestError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts: expected one or one per prompt"
                )
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(self.engine.add_request(prompt, params))
            if use_tqdm:
                on_step = self._progress_bar(set(ids), use_tqdm, on_step)
            try:
                return self._run(ids, on_step)
            finally:
                if use_tqdm:
                    on_step.bar.close()
        finally:
            for request_id in ids:  # no-op for finished ones; frees blocks after an exception
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        Message content is text: special-token text in it is not parsed as special tokens
        unless `content_special_tokens` (Tokenizer.apply_chat_template)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("chat needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, content_special_tokens=content_special_tokens)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        *,
        pooling: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): the final hidden states
        (after the final norm) pooled as the engine's `pooler_config` says — the last token's by
        default, L2-normalised — batched through the same scheduler as generation.

        `pooling` ("last" or "mean") overrides the engine's pooling type for this call;
        `pooling_params` (vLLM's PoolingParams) its `normalize`, and `dimensions` must be the
        model's hidden size. All prompts are validated before any runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        config = self.engine.config.pooler_config
        resolved = (pooling_params or PoolingParams()).resolve(config, self.engine.model_config.hidden_size, pooling)
        ids = []
        try:
            for prompt in prompts:
                ids.append(self.engine.add_request(prompt, pooling=resolved))
            on_step = self._progress_bar(set(ids), use_tqdm, None) if use_tqdm else None
            try:
                finals = self._run(ids, on_step)
            finally:
                if on_step is not None:
                    on_step.bar.close()
        finally:
            for request_id in ids:  # no-op for finished ones; frees blocks after an exception
                self.engine.abort_request(request_id)
        return [
            EmbeddingRequestOutput(out.request_id, out.prompt, out.prompt_token_ids, EmbeddingOutput(out.embedding),
                                   out.finished)
            for out in finals
        ]

    def _progress_bar(self, ids: set[str], use_tqdm: bool | Callable[..., Any],
                      then: Callable[[list[RequestOutput]], None] | None) -> Callable[[list[RequestOutput]], None]:
        """An on_step that advances a progress bar (its `bar` attribute), then calls `then`."""
        if callable(use_tqdm):
            make_bar = use_tqdm
        else:
            from tqdm import tqdm as make_bar
        bar = make_bar(total=len(ids), unit="req", desc="Processed prompts", file=sys.stderr, dynamic_ncols=True)
        start = time.perf_counter()
        generated_before = self.engine.stats().generation_tokens

        def on_step(outputs: list[RequestOutput]) -> None:
            generated = self.engine.stats().generation_tokens - generated_before
            bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
            bar.update(sum(1 for o in outputs if o.finished and o.request_id in ids))
            if then is not None:
                then(outputs)

        on_step.bar = bar
        return on_step

    def _run(self, ids: list[str], on_step: Callable[[list[RequestOutput]], None] | None) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            outputs = self.engine.step()
            for out in outputs:
                # Only this call's requests: a step may also return a final output of an
                # earlier call's request (one aborted when that call raised).
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
            if on_step is not None:
                on_step(outputs)
        return [final[i] for i in ids]
