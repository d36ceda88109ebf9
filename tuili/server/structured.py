"""What a completions or chat request asks its output to match, in the engine's terms.

Three spellings reach one `StructuredOutputsParams` (tuili/sampling.py), and a request may use
only one of them:

* OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the schema is
  always enforced, ``strict`` or not; without a schema, any JSON object); ``text`` is none;
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""

from __future__ import annotations

from typing import Any

from tuili.errors import RequestError
from tuili.sampling import StructuredOutputsParams
from tuili.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError


def structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; RequestError naming the field when it is bad."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        asked.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
    if request.structured_outputs is not None:
        given = request.structured_outputs
        if given.whitespace_pattern is not None:
            raise UnsupportedFieldError(
                "structured_outputs", "structured_outputs.whitespace_pattern is not supported by tuili: leave it out"
            )
        fields = {"json": given.json_, "regex": given.regex, "choice": given.choice, "grammar": given.grammar,
                  "json_object": given.json_object}
        asked.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    for name, value in request.guided_fields().items():
        asked.append((name, {name.removeprefix("guided_"): value}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        error = RequestError(f"{names} each constrain the output: give only one of them")
        error.field = asked[1][0]
        raise error
    name, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields)
    except RequestError as error:
        error.field = name
        raise
