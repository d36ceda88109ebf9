"""Tool calling: what a chat request's tools do to its prompt, its decoding and its answer.

* **The prompt.** The tools reach the chat template (``tools=[...]``), as do assistant messages'
  ``tool_calls`` (their arguments as objects, as templates expect) and ``role: tool`` results.
  A template that renders no tools (SmolLM2's, say) gets them as a system message in the
  Hermes format instead (Qwen's own wording), tool results as ``<tool_response>`` user turns
  and earlier calls as ``<tool_call>`` text, so that any chat model can be asked.
* **The decoding.** ``tool_choice`` "auto" (the default with tools) leaves the model free and
  parses what it wrote; "none" parses nothing; "required" and a named function are enforced
  by a grammar (tuili/layers/grammar.py), as vLLM does: a named call's output *is* its
  arguments, JSON of the function's parameter schema; "required" outputs a JSON array of
  ``{"name", "parameters"}`` objects, one of the tools each (at most one with
  ``parallel_tool_calls: false``).
* **The answer.** A parser for the format the model was taught (``ToolParser``: Hermes / Qwen
  ``<tool_call>`` JSON, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), chosen from the chat
  template or by ``--tool-call-parser``, turns the text into content and calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tuili.errors import RequestError
from tuili.sampling import StructuredOutputsParams
from tuili.server.protocol import ChatCompletionRequest, Tool

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A call from a decoded {"name": ..., "arguments" | "parameters": {...}} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """Text -> content and calls, for one model family's format. `marker` is where calls begin:
    a stream sends text up to it as content and holds back a tail that may begin it."""

    marker = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def content_prefix(self, text: str) -> str:
        """The longest prefix of a partial `text` that is surely content whatever follows."""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at]
        for keep in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-keep:]):
                return text[:-keep]
        return text


class HermesParser(ToolParser):
    """Hermes 2 Pro, Qwen 2.5 / 3 and others: ``<tool_call>{"name", "arguments"}</tool_call>``,
    any number of them, after optional content (a last block may lack its closing tag when the
    model stopped right after it). Any block that is not such a JSON object makes the whole
    text content, as vLLM does."""

    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(_content(text))
        calls = []
        for body in self._block.findall(text, at):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return Parsed(_content(text))
            calls.append(call)
        return Parsed(_content(text[:at]), calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3's JSON tool calls: the whole answer is ``{"name": ...,
    "parameters": {...}}`` (several joined by ``;``), maybe after ``<|python_tag|>``. An answer
    that is not entirely such calls is content."""

    marker = "{"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed(_content(text))
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return Parsed(_content(text))
            call = _call(obj, "parameters")
            if call is None:
                return Parsed(_content(text))
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return Parsed(None, calls)

    def content_prefix(self, text: str) -> str:
        # Calls are the whole answer: nothing is surely content until the answer is not a call.
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(stripped):
            return ""
        return text


class MistralParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]``: a JSON list of {"name", "arguments"} (v0.3 templates), or
    ``name[ARGS]{...}`` after each marker (v11 and later). Needs special tokens in the text:
    a request parsed with it keeps them (skip_special_tokens is turned off)."""

    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(_content(text))
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        for piece in text[at:].split(self.marker)[1:]:
            piece = piece.strip()
            try:
                if "[ARGS]" in piece and not piece.startswith("["):
                    name, _, arguments = piece.partition("[ARGS]")
                    obj, _ = decoder.raw_decode(arguments.strip())
                    call = _call({"name": name.strip(), "arguments": obj})
                    found = [call] if call is not None else None
                else:
                    obj, _ = decoder.raw_decode(piece)
                    items = obj if isinstance(obj, list) else [obj]
                    found = [_call(item) for item in items]
            except ValueError:
                return Parsed(_content(text))
            if not found or any(call is None for call in found):
                return Parsed(_content(text))
            calls += found
        return Parsed(_content(text[:at]), calls)


_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool format needs (hermes for a template without one,
    which gets tuili's Hermes-format tool prompt)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


# ---- the prompt -----------------------------------------------------------------------------


_HERMES_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      renders_tools: bool) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: tool calls' arguments as objects; for a
    template that renders no tools, the tools, calls and results written into the text."""
    result = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
        if not renders_tools:
            if message.get("tool_calls"):
                calls = "\n".join(
                    "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                 ensure_ascii=False) + "\n</tool_call>"
                    for c in message.pop("tool_calls")
                )
                message["content"] = "\n".join(filter(None, [_text(message.get("content")), calls]))
            if message["role"] == "tool":
                message = {"role": "user",
                           "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
            message.pop("tool_call_id", None)
        result.append(message)
    if tools and not renders_tools:
        listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        prompt = _HERMES_PROMPT.format(tools=listing)
        if result and result[0]["role"] in ("system", "developer"):
            result[0] = {**result[0], "content": _text(result[0].get("content")) + "\n\n" + prompt}
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's call with its arguments decoded (templates write `arguments |
    tojson`); arguments that are not a JSON object are refused, naming the call."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except ValueError as error:
        raise RequestError(
            f"tool call {call['id']!r} has arguments that are not JSON ({error}): expected a JSON object as text"
        ) from error
    return {**call, "function": {**function, "arguments": arguments}}


# ---- one request ----------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a chat request's tools mean for it."""

    tools: list[dict[str, Any]]  # as the template takes them
    choice: str  # "none", "auto", "required", or "named"
    parser: ToolParser
    parser_name: str
    named: str | None = None  # the forced function's name (choice "named")
    structured: StructuredOutputsParams | None = None  # the grammar forcing a call

    def parse(self, text: str) -> Parsed:
        """The answer's content and calls."""
        if self.choice == "none":
            return Parsed(text)
        if self.choice == "named":
            return Parsed(None, [ParsedCall(self.named or "", text)])
        if self.choice == "required":
            return _parse_required(text)
        return self.parser.parse(text)


def plan_tools(request: ChatCompletionRequest, parser_name: str) -> ToolPlan | None:
    """The request's tool plan (None when it has no tools); RequestError naming a bad field."""
    tools: list[Tool] = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", f"tool_choice={_describe(choice)} needs tools: give the functions it may call")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise _bad("tools", f"tools name the function {duplicate!r} twice: expected distinct names")
    plan = ToolPlan(
        tools=[tool.model_dump(exclude_none=True) for tool in tools],
        choice="auto" if choice is None else choice if isinstance(choice, str) else "named",
        parser=_PARSERS[parser_name](), parser_name=parser_name,
    )
    schemas = {tool.function.name: tool.function.parameters or {"type": "object", "properties": {}}
               for tool in tools}
    if plan.choice == "named":
        plan.named = choice.function.name
        if plan.named not in schemas:
            raise _bad("tool_choice", f"tool_choice names the function {plan.named!r}, which is not among the tools "
                                      f"({', '.join(names)})")
        plan.structured = StructuredOutputsParams(json=schemas[plan.named])
    elif plan.choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not request.parallel_tool_calls:
            array["maxItems"] = 1
        plan.structured = StructuredOutputsParams(json=array)
    return plan


def _parse_required(text: str) -> Parsed:
    try:
        items = json.loads(text)
    except ValueError:
        return Parsed(_content(text))  # cut short by max_tokens: the text as it is
    calls = [_call(item, "parameters") for item in items] if isinstance(items, list) else [None]
    if any(call is None for call in calls):
        return Parsed(_content(text))
    return Parsed(None, calls)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())


def _bad(field_name: str, message: str) -> RequestError:
    error = RequestError(message)
    error.field = field_name
    return error


# ---- streams --------------------------------------------------------------------------------


@dataclass
class ToolStream:
    """What one streamed choice has sent: content as soon as it is surely content, a named
    call's arguments as they are written, every other call once the answer is complete (only
    then is it certain the text is a call); so the deltas add up to the non-streamed answer."""

    plan: ToolPlan
    content_sent: int = 0
    arguments_sent: int = 0
    call_id: str = field(default_factory=new_call_id)

    def deltas(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool-call deltas to send) for the choice's text so far."""
        plan = self.plan
        if plan.choice == "named":
            calls = []
            if self.arguments_sent == 0 and (text or finished):
                calls.append({"index": 0, "id": self.call_id, "type": "function",
                              "function": {"name": plan.named, "arguments": ""}})
            if len(text) > self.arguments_sent:
                calls.append({"index": 0, "function": {"arguments": text[self.arguments_sent:]}})
                self.arguments_sent = len(text)
            return "", calls
        if plan.choice == "none":
            return self._content(text), []
        if not finished:
            return self._content("" if plan.choice == "required" else plan.parser.content_prefix(text)), []
        parsed = plan.parse(text)
        content = self._content(parsed.content or "")
        calls = [{"index": i, "id": new_call_id(), "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}
                 for i, call in enumerate(parsed.calls)]
        return content, calls

    def _content(self, surely: str) -> str:
        delta = surely[self.content_sent:]
        self.content_sent = max(self.content_sent, len(surely))
        return delta
