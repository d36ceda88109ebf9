"""POST /v1/responses: OpenAI's Responses API for text in and text out.

A call becomes a chat completion (its `instructions` a developer message first, its `input` the
messages after it) and runs as one; its answer is reshaped into a `response` object, or streamed
as the API's typed events, each an SSE `event:` line naming its type over a `data:` line with a
rising `sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per step that adds text),
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed (or response.incomplete when max_output_tokens cut the text). There is no
`[DONE]` sentinel in this API.

tuili keeps no state between calls, runs no tools and does no reasoning summaries, so the fields
that ask for those (`store: true`, `previous_response_id`, `conversation`, `background`, `tools`,
`include`, `reasoning`, `prompt`, ...) are refused by name rather than ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuili.engine.request import RequestOutput
from tuili.server.errors import as_api_error
from tuili.server.generation import Backend, Generation, start_chat
from tuili.server.protocol import (
    _NEUTRAL,
    ChatCompletionRequest,
    JsonSchemaFormat,
    UnsupportedFieldError,
    _refuse_meaningful_extras,
    _Request,
    _short,
)

# Fields of OpenAI's request that tuili does not honour, with their neutral values (see
# protocol._refuse_meaningful_extras: null, [], {} and these are accepted).
_RESPONSES_REFUSED: dict[str, object] = {
    "previous_response_id": _NEUTRAL, "conversation": _NEUTRAL, "background": False, "tools": _NEUTRAL,
    "tool_choice": "auto", "include": _NEUTRAL, "reasoning": _NEUTRAL, "prompt": _NEUTRAL,
    "max_tool_calls": _NEUTRAL, "top_logprobs": 0, "truncation": "disabled", "context_management": _NEUTRAL,
}
_INPUT_ROLES = ("user", "assistant", "system", "developer")


class InputText(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["input_text", "output_text"] = Field(description="output_text: an earlier assistant turn's text")
    text: str


class InputMessage(_Request):
    """An input item: one message (OpenAI's EasyInputMessage, or an input message item)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class TextFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="only the default")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="a string, or a list of messages")
    instructions: str | None = Field(None, description="a system (developer) message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="null: up to the context length")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    store: bool | None = Field(None, description="tuili stores nothing: false or null")
    metadata: dict[str, str] | None = Field(None, description="echoed back")
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    parallel_tool_calls: bool | None = None
    user: str | None = Field(None, description="accepted and ignored")

    def check_supported(self) -> None:
        extra = dict(self.model_extra or {})
        if extra.get("tool_choice") in ("none", "auto"):  # both ask for nothing without tools
            del extra["tool_choice"]
        _refuse_meaningful_extras(extra, _RESPONSES_REFUSED)
        if self.store:
            raise UnsupportedFieldError("store", "store=true is not supported: tuili keeps no responses; "
                                        "send store=false (and the whole conversation as input)")

    def messages(self) -> list[dict[str, Any]]:
        """The chat the call asks to continue: instructions first, then the input's messages."""
        messages = [{"role": "developer", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise _input_error("input=[] is invalid: expected a string or at least one message")
        for index, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind != "message":
                raise _input_error(f"input[{index}] has type {_short(kind)}: tuili takes only messages of text")
            parts = item.get("content")
            if isinstance(parts, list):
                for part in parts:
                    part_type = part.get("type") if isinstance(part, dict) else None
                    if part_type not in ("input_text", "output_text"):
                        raise _input_error(f"input[{index}] has a content part of type {_short(part_type)}: "
                                           "expected input_text (tuili models take text only)")
            try:
                message = InputMessage.model_validate(item)
            except ValidationError as error:
                raise _input_error(f"input[{index}]={_short(item)} is invalid: expected a message with a role in "
                                   f"{', '.join(_INPUT_ROLES)} and text content ({error.errors()[0]['msg']})"
                                   ) from None
            content = message.content if isinstance(message.content, str) else [
                {"type": "text", "text": part.text} for part in message.content]
            messages.append({"role": message.role, "content": content})
        return messages

    def response_format(self) -> dict[str, Any] | None:
        form = self.text.format if self.text is not None else None
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return {"type": "json_object"}
        schema = JsonSchemaFormat.model_validate({"name": form.name, "schema": form.schema_, "strict": form.strict})
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True)}


def _input_error(message: str) -> UnsupportedFieldError:
    return UnsupportedFieldError("input", message)


# ---- the response object ------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: bool = False
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


# ---- a call in flight ----------------------------------------------------------------------


class _Call:
    """One /v1/responses call: its request, its chat generation and the ids its answer uses."""

    def __init__(self, request: ResponsesRequest, gen: Generation) -> None:
        self.request = request
        self.gen = gen
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, text: str | None, finish_reason: str | None, final: RequestOutput | None) -> ResponseObject:
        """The response object: in progress (text None), or finished with `text`."""
        request = self.request
        status = "in_progress" if text is None else _STATUS.get(finish_reason or "stop", "completed")
        output = [] if text is None else [OutputMessage(
            id=self.message_id, status="incomplete" if status != "completed" else "completed",
            content=[OutputText(text=text)])]
        usage = None
        if final is not None:
            chat = self.gen.usage([final])
            usage = ResponseUsage(
                input_tokens=chat.prompt_tokens, output_tokens=chat.completion_tokens, total_tokens=chat.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=chat.prompt_tokens_details.cached_tokens))
        form = request.text.format if request.text is not None and request.text.format is not None else None
        return ResponseObject(
            id=self.response_id, created_at=self.created, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if finish_reason == "length" else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens, model=self.gen.model,
            output=output, temperature=request.temperature, top_p=request.top_p,
            text={"format": form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}},
            metadata=request.metadata or {}, usage=usage,
        )

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


# An aborted request (the server shutting down) ends "cancelled", as OpenAI's cancelled responses.
_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


async def start_response(backend: Backend, request: ResponsesRequest, arrival: float) -> _Call:
    """Validate the call and queue its generation; raises RequestError naming a bad field."""
    request.check_supported()
    chat = {"model": request.model, "messages": request.messages(), "temperature": float(request.temperature),
            "top_p": float(request.top_p), "max_completion_tokens": request.max_output_tokens,
            "response_format": request.response_format()}
    try:
        chat_request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as error:  # e.g. a message with content []: the input's fault
        first = error.errors()[0]
        raise _input_error(f"input is invalid: {first['msg']}") from None
    return _Call(request, await start_chat(backend, chat_request, arrival))


async def complete_response(call: _Call) -> ResponseObject:
    (final,) = await call.gen.submission.final()
    (output,) = final.outputs
    return call.response(output.text, output.finish_reason, final)


async def stream_response(call: _Call) -> AsyncIterator[str]:
    """The call's typed events; an engine failure mid-stream becomes an `error` event."""
    created = call.response(None, None, None).model_dump()
    yield call.event("response.created", response=created)
    yield call.event("response.in_progress", response=created)
    item = OutputMessage(id=call.message_id, status="in_progress", content=[]).model_dump()
    where = {"item_id": call.message_id, "output_index": 0, "content_index": 0}
    yield call.event("response.output_item.added", output_index=0, item=item)
    yield call.event("response.content_part.added", **where, part=OutputText(text="").model_dump())
    sent, final, text = 0, None, ""
    try:
        async for outputs in call.gen.submission.updates():
            for out in outputs:
                (output,) = out.outputs
                if len(output.text) > sent:
                    yield call.event("response.output_text.delta", **where, delta=output.text[sent:], logprobs=[])
                    sent = len(output.text)
                if out.finished:
                    final, text = call.response(output.text, output.finish_reason, out), output.text
    except Exception as error:  # noqa: BLE001 - the stream has started: report in-band
        info = as_api_error(error).info
        yield call.event("error", code=info.code or info.type, message=info.message, param=info.param)
        return
    if final is None:  # the updates ended without a final output: the engine went away
        yield call.event("error", code="server_error", message="the engine stopped before the response ended",
                         param=None)
        return
    message = final.output[0]
    yield call.event("response.output_text.done", **where, text=text, logprobs=[])
    yield call.event("response.content_part.done", **where, part=message.content[0].model_dump())
    yield call.event("response.output_item.done", output_index=0, item=message.model_dump())
    ending = "response.completed" if final.status == "completed" else "response.incomplete"
    yield call.event(ending, response=final.model_dump())
