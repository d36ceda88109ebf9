"""/v1/completions and /v1/chat/completions: an API call in, engine requests out, and their
outputs back as one OpenAI response or as Server-Sent Events.

A completions call with several prompts becomes one engine request per prompt; choice
`i * n + j` is prompt i's j-th sample, as in OpenAI's API. Streams send, per choice, the text
each step added (the engine's text is cumulative, so a delta is the new suffix) and end with
`data: [DONE]`; concatenated, the deltas are exactly the non-streamed text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tuili.engine.request import CompletionOutput, PositionLogprobs, RequestOutput
from tuili.errors import RequestError
from tuili.sampling import SamplingParams
from tuili.server.driver import EngineDriver, Submission
from tuili.server.errors import ApiError, as_api_error
from tuili.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaToolCall,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tuili.server.structured import structured_outputs
from tuili.server.tokenization import PromptTokenizer
from tuili.server.tools import (
    ToolPlan,
    ToolStream,
    new_call_id,
    parser_for_template,
    plan_tools,
    template_messages,
    template_renders_tools,
)

DONE = "data: [DONE]\n\n"

# vLLM writes a -inf logprob (a token the model rules out) as this: JSON has no infinity.
_LOGPROB_FLOOR = -9999.0


@dataclass
class Backend:
    """What the generation endpoints run on."""

    driver: EngineDriver
    tokenizer: PromptTokenizer
    model_names: tuple[str, ...]  # what `model` may name (--served-model-name); the first is the default
    max_model_len: int
    max_sequences_per_request: int = 256  # prompts x n of one call (--max-sequences-per-request)
    tool_call_parser: str = "auto"  # --tool-call-parser; "auto": the one the chat template's format needs

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tool_parser(self) -> str:
        if self.tool_call_parser != "auto":
            return self.tool_call_parser
        return parser_for_template(self.tokenizer.chat_template)


def check_sequences(backend: Backend, prompts: int, n: int) -> None:
    """Refuse a call that asks for more sequences (prompts x n) than one call may: 200 prompts
    x n=128 in 1.4 KB of JSON would otherwise hold everyone else's requests for a minute."""
    if prompts * n > backend.max_sequences_per_request:
        what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        error = RequestError(
            f"{what} is {prompts * n} sequences, more than the {backend.max_sequences_per_request} one request "
            "may ask for (the server's --max-sequences-per-request): split it into smaller requests"
        )
        error.field = "n"  # the param the answer names
        raise error


def check_model(backend: Backend, model: str | None) -> str:
    """The served name `model` asks for (None: the default one); 404 for a name not served."""
    if model is None:
        return backend.model_name
    if model not in backend.model_names:
        served = ", ".join(repr(name) for name in backend.model_names)
        raise ApiError(
            404, f"model {model!r} does not exist: this server serves {served}",
            param="model", code="model_not_found",
        )
    return model


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    logprobs: int | None, tools: ToolPlan | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters; raises ValueError naming a field whose value is out of range.
    `prompt_logprobs`: what echo needs when the request gives none itself. max_tokens 0 (echo
    only) samples one token, which the response leaves out."""
    structured = structured_outputs(request)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            error = RequestError(f"tool_choice={tools.choice!r} forces a tool call, which a response format or "
                                 "structured output cannot also constrain: give only one of them")
            error.field = "tool_choice"
            raise error
        structured = tools.structured
    # Mistral's [TOOL_CALLS] is a special token: the parser must see it in the text.
    keep_special = tools is not None and tools.choice == "auto" and tools.parser_name == "mistral"
    return SamplingParams(
        n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
        max_tokens=1 if max_tokens == 0 else max_tokens, min_tokens=request.min_tokens, stop=request.stop,
        stop_token_ids=request.stop_token_ids, include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos, logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs if request.prompt_logprobs is not None else prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens and not keep_special, structured_outputs=structured,
        logit_bias=request.logit_bias_ids(), allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
    )


def check_length(field: str, prompt_ids: list[int], max_tokens: int | None, max_model_len: int) -> None:
    """Refuse a prompt that, with the tokens asked for, cannot fit the context (as OpenAI does)."""
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"{field} has {len(prompt_ids)} tokens but the context holds {max_model_len} "
            "(the prompt plus at least one generated token must fit): shorten it"
        )
    if max_tokens is not None and len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            f"{field} has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, {len(prompt_ids) + max_tokens} "
            f"in all, but the context holds {max_model_len}: lower max_tokens or shorten the {field}"
        )


# ---- one call in flight ---------------------------------------------------------------


@dataclass
class Generation:
    """One API call's submission and what its response needs to know."""

    kind: str  # "completion" or "chat"
    api_id: str
    model: str
    n: int
    submission: Submission
    prompt_lengths: list[int]
    logprobs: int | None  # top alternatives asked for, None for none
    token_strings: list[str] | None
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # a chat call's tools: its answers are parsed for calls
    # A completions call with echo: each prompt's text, prepended to its choices' text (and its
    # tokens to their logprobs); `echo_only` (max_tokens 0): the prompt alone, nothing generated.
    echo_texts: list[str] | None = None
    echo_only: bool = False

    def choice_index(self, output: RequestOutput, completion: CompletionOutput) -> int:
        return self.submission.request_ids.index(output.request_id) * self.n + completion.index

    def usage(self, finals: list[RequestOutput]) -> Usage:
        prompt = sum(self.prompt_lengths)
        # max_tokens 0 with echo: the one token the engine sampled is not returned, nor counted.
        completion = 0 if self.echo_only else sum(len(c.token_ids) for out in finals for c in out.outputs)
        cached = sum(out.metrics.num_cached_tokens for out in finals if out.metrics)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def start_completion(backend: Backend, request: CompletionRequest, arrival: float) -> Generation:
    request.check_supported()
    check_model(backend, request.model)
    # Echo with logprobs needs the prompt's logprobs (vLLM's rule: prompt_logprobs, else logprobs).
    echo_only = request.echo and request.max_tokens == 0
    params = sampling_params(request, request.max_tokens, request.logprobs,
                             prompt_logprobs=request.logprobs if request.echo else None)
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestError("prompt=[] is invalid: expected a string, token ids, or a non-empty list of them")
    check_sequences(backend, len(items), params.n)  # before any tokenizing
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            if params.truncate_prompt_tokens is None:
                ids = await backend.tokenizer.encode_prompt(item, "prompt", backend.max_model_len)
            else:  # a text of any length may be cut to its end (the body's size bounds it)
                ids = await backend.tokenizer.encode(item)
        else:
            ids = list(item)
            backend.tokenizer.check_ids(ids, "prompt")
        if not ids:
            raise RequestError("prompt is empty: expected at least one token")
        whole = len(ids)
        ids = params.truncate(ids, backend.max_model_len)
        check_length("prompt", ids, params.max_tokens, backend.max_model_len)
        prompts.append(ids)
        texts.append(item if isinstance(item, str) and len(ids) == whole else None)  # a cut text is not the prompt
    gen = await _submit(backend, "completion", f"cmpl-{uuid.uuid4().hex}", prompts, texts, params, arrival,
                        request.model)
    if request.echo:
        # A token-id (or truncated) prompt echoes as its decoded text, special tokens spelled out.
        gen.echo_texts = [text if text is not None else await backend.tokenizer.decode(ids, skip_special_tokens=False)
                          for text, ids in zip(texts, prompts, strict=True)]
        gen.echo_only = echo_only
    return gen


async def start_chat(backend: Backend, request: ChatCompletionRequest, arrival: float) -> Generation:
    request.check_supported()
    check_model(backend, request.model)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    top = (request.top_logprobs or 0) if request.logprobs else None
    tools = plan_tools(request, backend.tool_parser)
    params = sampling_params(request, max_tokens, top, tools)
    check_sequences(backend, 1, params.n)
    messages = [message.as_template_input() for message in request.messages]
    renders_tools = template_renders_tools(backend.tokenizer.chat_template)
    if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = template_messages(messages, tools.tools if tools else None, renders_tools)
    # The template only adds to the content, so content whose own prefix overflows the context
    # is refused before the whole chat is rendered and tokenized.
    if params.truncate_prompt_tokens is None:
        await backend.tokenizer.check_text_length(_content_text(messages), "messages", backend.max_model_len)
    ids = await backend.tokenizer.apply_chat_template(
        messages, request.add_generation_prompt, tools.tools if tools and renders_tools else None)
    ids = params.truncate(ids, backend.max_model_len)  # vLLM's rule: the rendered chat's last k tokens
    check_length("messages", ids, max_tokens, backend.max_model_len)
    gen = await _submit(backend, "chat", f"chatcmpl-{uuid.uuid4().hex}", [ids], [None], params, arrival,
                        request.model)
    gen.tools = tools
    return gen


def _content_text(messages: list[dict]) -> str:
    """The chat's message content, as one text (parts joined with newlines, as rendered)."""
    texts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif content:
            texts.extend(part["text"] for part in content)
    return "\n".join(texts)


async def _submit(backend: Backend, kind: str, api_id: str, prompts: list[list[int]], texts: list[str | None],
                  params: SamplingParams, arrival: float, model: str | None) -> Generation:
    strings = await backend.tokenizer.token_strings() if params.logprobs is not None else None
    submission = await backend.driver.submit(api_id, prompts, texts, params, arrival)
    return Generation(kind, api_id, model or backend.model_name, params.n, submission, [len(p) for p in prompts],
                      params.logprobs, strings)


# ---- whole responses ------------------------------------------------------------------


async def complete(gen: Generation) -> CompletionResponse | ChatCompletionResponse:
    finals = await gen.submission.final()
    choices = []
    for out in finals:
        for c in out.outputs:
            index = gen.choice_index(out, c)
            if gen.kind == "completion" and gen.echo_texts is not None:
                choices.append(_echo_choice(gen, out, c, index))
            elif gen.kind == "completion":
                choices.append(CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason,
                                                logprobs=_completion_logprobs(gen, c, 0, 0),
                                                prompt_logprobs=_prompt_logprobs(out)))
            else:
                message, finish_reason = _chat_message(gen, c)
                choices.append(ChatChoice(index=index, message=message, finish_reason=finish_reason,
                                          logprobs=_chat_logprobs(gen, c, 0)))
    choices.sort(key=lambda choice: choice.index)
    if gen.kind == "completion":
        return CompletionResponse(id=gen.api_id, created=gen.created, model=gen.model, choices=choices,
                                  usage=gen.usage(finals))
    return ChatCompletionResponse(id=gen.api_id, created=gen.created, model=gen.model, choices=choices,
                                  usage=gen.usage(finals), prompt_logprobs=_prompt_logprobs(finals[0]))


def _echo_prompt(gen: Generation, out: RequestOutput) -> tuple[str, CompletionLogprobs | None, int]:
    """What echo puts before a choice's output: the prompt's text and, with logprobs, its tokens'
    entries (the first with null logprobs, as OpenAI's API had it) and the text offset after them."""
    text = gen.echo_texts[gen.submission.request_ids.index(out.request_id)]
    if gen.logprobs is None:
        return text, None, 0
    logprobs = CompletionLogprobs()
    offset = 0
    # Shorter than the prompt only when the request was aborted before its prefill ended.
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):  # noqa: B905
        offset = _add_logprob(gen, logprobs, token_id, entry, offset)
    return text, logprobs, offset


def _echo_choice(gen: Generation, out: RequestOutput, c: CompletionOutput, index: int) -> CompletionChoice:
    """A completion choice with echo: the prompt before the generated text and tokens.
    `echo_only`: the prompt alone, finish_reason "length"."""
    text, logprobs, offset = _echo_prompt(gen, out)
    if gen.echo_only:
        return CompletionChoice(index=index, text=text, finish_reason="length", logprobs=logprobs,
                                prompt_logprobs=_prompt_logprobs(out))
    if logprobs is not None:
        for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=True):
            offset = _add_logprob(gen, logprobs, token_id, entry, offset)
    return CompletionChoice(index=index, text=text + c.text, finish_reason=c.finish_reason, logprobs=logprobs,
                            prompt_logprobs=_prompt_logprobs(out))


def _chat_message(gen: Generation, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
    """A chat choice's message and finish reason: with tools, its text parsed into content and
    calls ("tool_calls" is the reason of an answer that calls, unless max_tokens cut it)."""
    if gen.tools is None:
        return ChatResponseMessage(content=c.text), c.finish_reason
    parsed = gen.tools.parse(c.text)
    calls = [ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=call.name, arguments=call.arguments))
             for call in parsed.calls]
    return ChatResponseMessage(content=parsed.content, tool_calls=calls), _finish_reason(c.finish_reason, bool(calls))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


# ---- streams --------------------------------------------------------------------------


@dataclass
class _Sent:
    """How much of one choice the stream has sent."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False
    echoed: bool = False  # echo: the prompt went out (with the choice's first chunk)
    echo_offset: int = 0  # echo with logprobs: where the generated tokens' text offsets start


async def stream(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    """The call's Server-Sent Events; an engine failure mid-stream becomes an error event."""
    sent: dict[int, _Sent] = {}
    tool_streams: dict[int, ToolStream] = {}
    if gen.kind == "chat":  # OpenAI opens each choice with its role
        for index in range(gen.n):
            yield _chat_chunk(gen, index, ChatDelta(role="assistant", content=""), None, None)
    finals: dict[str, RequestOutput] = {}
    try:
        async for outputs in gen.submission.updates():
            for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
                for c in out.outputs:
                    index = gen.choice_index(out, c)
                    progress = sent.setdefault(index, _Sent())
                    if progress.finished:
                        continue
                    delta = c.text[progress.chars:]
                    new_tokens = len(c.token_ids) - progress.tokens
                    if not delta and not c.finish_reason and not (new_tokens and gen.logprobs is not None):
                        continue
                    if gen.kind == "completion":
                        prefix, logprobs = "", None
                        if gen.echo_texts is not None and not progress.echoed:
                            prefix, logprobs, progress.echo_offset = _echo_prompt(gen, out)
                            progress.echoed = True
                        if gen.echo_only:  # the prompt alone, in one chunk
                            yield _event(CompletionResponse(
                                id=gen.api_id, created=gen.created, model=gen.model,
                                choices=[CompletionChoice(index=index, text=prefix, logprobs=logprobs,
                                                          finish_reason="length")]))
                            progress.finished = True
                            continue
                        generated = _completion_logprobs(gen, c, progress.tokens, progress.chars + progress.echo_offset)
                        if logprobs is None:
                            logprobs = generated
                        elif generated is not None:
                            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                                getattr(logprobs, name).extend(getattr(generated, name))
                        yield _event(CompletionResponse(
                            id=gen.api_id, created=gen.created, model=gen.model,
                            choices=[CompletionChoice(index=index, text=prefix + delta, logprobs=logprobs,
                                                      finish_reason=c.finish_reason)]))
                    elif gen.tools is not None:
                        tool_stream = tool_streams.setdefault(index, ToolStream(gen.tools))
                        content, calls = tool_stream.deltas(c.text, c.finish_reason is not None)
                        called = calls or tool_stream.arguments_sent
                        yield _chat_chunk(gen, index, ChatDelta(
                            content=content if content or not calls else None,
                            tool_calls=[DeltaToolCall.model_validate(call) for call in calls] or None),
                            _finish_reason(c.finish_reason, bool(called)), _chat_logprobs(gen, c, progress.tokens))
                    else:
                        yield _chat_chunk(gen, index, ChatDelta(content=delta), c.finish_reason,
                                          _chat_logprobs(gen, c, progress.tokens))
                    progress.chars, progress.tokens = len(c.text), len(c.token_ids)
                    progress.finished = c.finish_reason is not None
    except Exception as error:  # noqa: BLE001 - the stream has started: report in-band
        yield _event(ErrorResponse(error=as_api_error(error).info))
        yield DONE
        return
    if include_usage:
        usage = gen.usage([finals[request_id] for request_id in gen.submission.request_ids])
        if gen.kind == "completion":
            yield _event(CompletionResponse(id=gen.api_id, created=gen.created, model=gen.model, choices=[],
                                            usage=usage))
        else:
            yield _event(ChatCompletionChunk(id=gen.api_id, created=gen.created, model=gen.model, choices=[],
                                             usage=usage))
    yield DONE


def _event(payload) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _chat_chunk(gen: Generation, index: int, delta: ChatDelta, finish_reason: str | None,
                logprobs: ChatLogprobs | None) -> str:
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return _event(ChatCompletionChunk(id=gen.api_id, created=gen.created, model=gen.model, choices=[choice]))


# ---- logprobs -------------------------------------------------------------------------


def _completion_logprobs(gen: Generation, c: CompletionOutput, start: int, offset: int) -> CompletionLogprobs | None:
    """The legacy format for tokens[start:]; `offset` is where they begin in the choice's text.
    As OpenAI documents, each position lists the `logprobs` most likely tokens plus the chosen one."""
    if gen.logprobs is None or c.logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
        offset = _add_logprob(gen, result, token_id, entry, offset)
    return result


def _add_logprob(gen: Generation, result: CompletionLogprobs, token_id: int, entry: PositionLogprobs | None,
                 offset: int) -> int:
    """Append one position (`entry` None: a prompt's first token, which nothing predicts) with
    the `logprobs` most likely tokens and the position's own; returns the next text offset."""
    text = gen.token_strings[token_id]
    result.tokens.append(text)
    result.text_offset.append(offset)
    if entry is None:
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
    else:
        result.token_logprobs.append(max(entry[token_id].logprob, _LOGPROB_FLOOR))
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: gen.logprobs]
        top = {gen.token_strings[t]: max(lp.logprob, _LOGPROB_FLOOR) for t, lp in ranked}
        top.setdefault(text, result.token_logprobs[-1])
        result.top_logprobs.append(top)
    return offset + len(text)


def _prompt_logprobs(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field from the engine's (None when not asked for)."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=max(lp.logprob, _LOGPROB_FLOOR), rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in entry.items()
    } for entry in out.prompt_logprobs]


def _chat_logprobs(gen: Generation, c: CompletionOutput, start: int) -> ChatLogprobs | None:
    """Chat's format for tokens[start:]: each chosen token with exactly `top_logprobs` alternatives.
    `bytes` is the UTF-8 of the token's text (U+FFFD for a token that splits a character)."""
    if gen.logprobs is None or c.logprobs is None:
        return None
    strings = gen.token_strings
    content = []
    for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: gen.logprobs]
        top = [TopLogprob(token=strings[t], logprob=lp.logprob, bytes=list(strings[t].encode())) for t, lp in ranked]
        text = strings[token_id]
        content.append(TokenLogprob(token=text, logprob=entry[token_id].logprob, bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)
