"""The OpenAI API's request and response bodies, as pydantic models.

Requests are validated *strictly* (no "5" for 5, no 1 for true), as OpenAI's own API does,
so a wrong field type is a 400 naming the field rather than a silent coercion. The ranges
declared here are OpenAI's (and vLLM's for its extra fields) and are part of the published
OpenAPI schema; `tuili.sampling.SamplingParams` checks the sampling fields again when the
engine builds them, so the two must agree (a test sends the boundary values to both).

Fields OpenAI defines that tuili cannot honour (suffix, best_of) are
declared so that a request using them is refused with a clear 400 instead of being answered
as if they had been applied. Fields of OpenAI's and vLLM's that change what a request means
(`functions`, `guided_whitespace_pattern`, `chat_template`, ...: `_REFUSED`)
are refused by name too, unless they carry their neutral value (null, an empty list, ...).
Other unknown fields are ignored, as vLLM does, so clients that send extra vendor fields keep
working.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from tuili.errors import RequestError

# extra="allow" keeps unknown fields in `model_extra`, where check_supported looks for the
# ones it must refuse; the rest are ignored.
_REQUEST_CONFIG = ConfigDict(strict=True, extra="allow")

# Fields that change a request's meaning and that tuili does not implement yet: a request that
# gives one a value other than its neutral one (null, [], {}, and the listed values) is refused
# by name. Ignoring them would answer a different question than the one asked.
_NEUTRAL = object()

# Stop strings per request and characters per stop string (OpenAI allows 4 strings; vLLM has
# no limit): enough for any template's turn markers, and a bounded cost per step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_SAMPLING_REFUSED: dict[str, object] = {
    "functions": _NEUTRAL, "function_call": "none",
    "prediction": _NEUTRAL, "use_beam_search": False,
    "logits_processors": _NEUTRAL, "return_tokens_as_token_ids": False,
    # vLLM's structured-output options beyond what tuili's grammar engine (xgrammar) takes.
    "guided_whitespace_pattern": _NEUTRAL, "structural_tag": _NEUTRAL, "guided_decoding_backend": "xgrammar",
}
_COMPLETION_REFUSED = {**_SAMPLING_REFUSED, "tools": _NEUTRAL, "tool_choice": "none",
                       "parallel_tool_calls": _NEUTRAL}
# vLLM's older spellings of structured_outputs' fields: honoured (see _SamplingFields.structured).
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_CHAT_REFUSED = {**_SAMPLING_REFUSED, "echo": False, "chat_template": _NEUTRAL, "chat_template_kwargs": _NEUTRAL,
                 "continue_final_message": False, "documents": _NEUTRAL}
_TOKENIZE_REFUSED = {"tools": _NEUTRAL, "chat_template": _NEUTRAL, "chat_template_kwargs": _NEUTRAL,
                     "continue_final_message": False, "documents": _NEUTRAL}


def _refuse_meaningful_extras(extra: dict[str, Any] | None, refused: dict[str, object]) -> None:
    """Raise UnsupportedFieldError for the first field of `refused` that `extra` gives a
    non-neutral value; every vLLM `guided_*` field counts as one of them."""
    for name, value in (extra or {}).items():
        if name in refused:
            neutral = refused[name]
        elif name.startswith("guided_") and name not in _GUIDED_FIELDS:
            neutral = _NEUTRAL
        else:
            continue
        if value is None or value == [] or value == {} or (neutral is not _NEUTRAL and value == neutral):
            continue
        raise UnsupportedFieldError(
            name, f"{name}={_short(value)} is not supported by tuili yet: leave it out (or null)"
        )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UnsupportedFieldError(RequestError):
    """A request used an OpenAI field tuili does not implement; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# ---- errors ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------


def _lone_surrogate(value: Any) -> str | None:
    """A description of the first lone UTF-16 surrogate in `value`'s strings, or None.

    JSON may spell one ("\\ud800"), and Python keeps it in a str, but it is not Unicode text:
    no tokenizer (nor UTF-8) can take it, so it is refused here, naming the field, rather than
    failing deep in the tokenizer."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return f"a lone surrogate {value[error.start]!r} at character {error.start}"
        return None
    if isinstance(value, list):
        items = value if value and not isinstance(value[0], int) else ()
        return next((found for item in items if (found := _lone_surrogate(item))), None)
    if isinstance(value, dict):
        return next((found for item in (*value, *value.values()) if (found := _lone_surrogate(item))), None)
    return None  # nested request models check their own fields


class _Request(BaseModel):
    """Every request body: strict types, unknown fields ignored, text that is valid Unicode."""

    model_config = _REQUEST_CONFIG

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        found = _lone_surrogate(value)
        if found is not None:
            raise ValueError(f"it holds {found}, which is not text: expected valid Unicode (complete surrogate pairs)")
        return value


class StreamOptions(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field("response", description="accepted; the output is not named")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema; none: any JSON object")
    strict: bool | None = Field(None, description="ignored: the schema is always enforced")


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self


class StructuredOutputsField(_Request):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="accepted and ignored")
    disable_fallback: bool | None = Field(None, description="accepted and ignored: xgrammar is the only backend")
    disable_additional_properties: bool | None = Field(None, description="accepted and ignored")
    whitespace_pattern: str | None = Field(None, description="not supported: must be null")


class _SamplingFields(_Request):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, description="must name the served model when given")
    temperature: float = Field(1.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128, description="choices per prompt")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and ignored")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    # vLLM's extra sampling fields.
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="only these tokens may be generated")
    bad_words: list[str] | None = Field(None, description="words never generated (vLLM's rule)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the prompt's last k tokens; -1: "
                                               "the context length")
    # Structured output (tuili/server/structured.py): OpenAI's and vLLM's ways to ask for it.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM's: each prompt token's logprob and this many most likely alternatives"
    )

    _refused = _SAMPLING_REFUSED

    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` with integer keys; raises RequestError naming a key that is not a token id."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                error = RequestError(f"logit_bias key {key!r} is invalid: expected a token id such as \"50256\"")
                error.field = "logit_bias"
                raise error
            bias[int(key)] = value
        return bias

    def guided_fields(self) -> dict[str, Any]:
        """vLLM's older guided_* fields that this request gives (not null)."""
        return {name: value for name, value in (self.model_extra or {}).items()
                if name in _GUIDED_FIELDS and value is not None}

    @field_validator("stop", mode="after")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # Every stop string is checked against every sequence's text at every step, on the
        # engine thread: 100k of them slowed every other stream 25x (issue 20).
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"it has {len(stops)} strings: expected at most {MAX_STOP_STRINGS}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"one is {longest} characters long: expected at most {MAX_STOP_CHARS}")
        return stop

    def check_supported(self) -> None:
        """Raise UnsupportedFieldError for a field tuili would otherwise silently ignore."""
        _refuse_meaningful_extras(self.model_extra, self._refused)
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: the prompt's logprobs are a whole-response field.
            raise UnsupportedFieldError("prompt_logprobs", "prompt_logprobs is not supported with stream=true")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of such lists"
    )
    max_tokens: int | None = Field(16, ge=0, description="null: up to the context length; 0 only with echo")
    logprobs: int | None = Field(None, ge=0, le=20, description="log probabilities of this many most likely tokens")
    echo: bool = Field(False, description="prepend the prompt to the text (and its tokens to logprobs)")
    suffix: str | None = Field(None, description="not supported: must be absent")
    best_of: int | None = Field(None, description="not supported beyond best_of == n")

    _refused = _COMPLETION_REFUSED

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedFieldError("max_tokens", "max_tokens=0 is only allowed with echo=true (it returns the prompt)")
        if self.suffix is not None:
            raise UnsupportedFieldError("suffix", "suffix is not supported by tuili")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", f"best_of={self.best_of} is not supported: expected best_of == n")


class TextPart(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionDefinition(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments; none: no arguments")
    strict: bool | None = Field(None, description="ignored: forced calls always follow the schema")


class Tool(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")  # only the declared fields reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer: OpenAI's newer name for system, rendered as system; tool: a tool's result")
    content: str | list[TextPart] | None = Field(None, description="null only for an assistant message")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # A user or system turn without content is a client bug, not an empty string; an
        # empty list of parts is one for every role (the template would see "").
        if self.content == []:
            raise ValueError("content=[] is invalid: expected a string or at least one text part")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: expected a string or a list of text parts")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message has tool_calls: only an assistant message may")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    def as_template_input(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="null: up to the context length")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: most likely tokens per position")
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" with tools, "none" without')
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer")

    _refused = _CHAT_REFUSED

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs=true")


class TokenizeRequest(_Request):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        _refuse_meaningful_extras(self.model_extra, _TOKENIZE_REFUSED)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token (with echo,
    per prompt token first: the prompt's first token has null logprob and top_logprobs)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` as its server writes it in ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs field: per prompt position, null for the first, then token id -> Logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _omit_null_prompt_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    """Responses carry vLLM's prompt_logprobs only when it was asked for."""
    if data.get("prompt_logprobs", ...) is None:
        del data["prompt_logprobs"]
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return _omit_null_prompt_logprobs(handler(self))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return _omit_null_prompt_logprobs(handler(self))


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: `index` says which call; the first piece of a call
    carries its id, type and name, later ones more of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: the role once, then content.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tuili"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- embeddings -----------------------------------------------------------------------

# vLLM's embedding-request fields that change the answer and that tuili does not take.
_EMBEDDING_REFUSED = {"messages": _NEUTRAL, "chat_template": _NEUTRAL, "mm_processor_kwargs": _NEUTRAL,
                      "embed_dtype": "float32"}


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings body, with vLLM's `normalize` and `add_special_tokens`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of such lists"
    )
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32 bytes")
    dimensions: int | None = Field(None, description="only the model's own size: tuili does not shorten embeddings")
    user: str | None = None
    normalize: bool | None = Field(None, description="vLLM's: L2-normalise the vector; null: the server's pooler_config")
    add_special_tokens: bool = Field(True, description="vLLM's: add the tokenizer's special tokens to text input")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's: embed each input's last k tokens; "
                                               "-1: as many as the context holds")

    def check_supported(self) -> None:
        _refuse_meaningful_extras(self.model_extra, _EMBEDDING_REFUSED)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
