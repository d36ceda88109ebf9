"""How every failure becomes an OpenAI-shaped error response.

The body is always `{"error": {"message", "type", "param", "code"}}` and the message names
the bad value and what was expected; nothing of a traceback ever reaches a client (an
unexpected exception is logged on the server and answered with a generic 500).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tuili.errors import RequestError
from tuili.server.driver import EngineError, QueueFullError, ShuttingDownError
from tuili.server.protocol import ErrorInfo, ErrorResponse, UnsupportedFieldError

logger = logging.getLogger(__name__)

# Parts of a pydantic error location that name a union member rather than a field:
# "str", "list[int]", "TextPart", "function-after[...]".
_SCALAR_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper())


class ApiError(Exception):
    """An error answer: HTTP status plus the OpenAI error fields."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def bad_request(error: Exception, fields: set[str] = frozenset()) -> ApiError:
    """A 400 for an engine or SamplingParams refusal, whose message starts with the field it is
    about ("max_tokens=-1 is invalid: ...", "prompt has 9000 tokens ..."); `param` names that
    field when it is one of the request's `fields`."""
    param = getattr(error, "field", None)
    if param is None:
        first_word = re.match(r"[a-z_]+", str(error))
        param = first_word.group() if first_word and first_word.group() in fields else None
    return ApiError(400, str(error), param=param)


def as_api_error(error: Exception, fields: set[str] = frozenset()) -> ApiError:
    """The answer to an exception raised while serving a request for `fields`."""
    if isinstance(error, ApiError):
        return error
    # Only tuili's own refusals of the request are the client's fault. Any other exception,
    # ValueError included, is a bug on this side: a generic 500, the details in the log.
    if isinstance(error, (RequestError, UnsupportedFieldError)):
        return bad_request(error, fields)
    if isinstance(error, QueueFullError):
        return ApiError(503, str(error), type="server_error", code="queue_full")
    if isinstance(error, ShuttingDownError):
        return ApiError(503, str(error), type="server_error", code="shutting_down")
    if isinstance(error, EngineError):
        return ApiError(500, str(error), type="server_error")
    logger.error("unexpected error while serving a request", exc_info=error)
    return ApiError(500, "internal server error (the server log has the details)", type="server_error")


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    path = [str(part) for part in first["loc"][1:] if not _is_type_tag(part)]
    field = ".".join(path)
    if not field:
        return ApiError(400, f"the request body is invalid: {first['msg']} (expected a JSON object)")
    if first["type"] == "missing":
        return ApiError(400, f"{field} is required", param=path[0])
    # A union (e.g. prompt: str | list[str] | ...) reports one error per member; show a few.
    same_field = [e for e in errors if e["loc"][1:2] == first["loc"][1:2]]
    messages = list(dict.fromkeys(e["msg"] for e in same_field))[:3]
    return ApiError(400, f"{field}={_short(first.get('input'))} is invalid: {'; or '.join(messages)}", param=path[0])


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own answers: unknown route (404), wrong method (405), body too large (413).
        code = {404: "not_found", 405: "method_not_allowed", 408: "body_timeout",
                413: "request_too_large"}.get(exc.status_code)
        message = {
            400: "the request body could not be read: expected a JSON object in UTF-8",  # e.g. bad UTF-8
            404: f"{request.url.path} is not an endpoint of this server",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        error = ApiError(exc.status_code, message, code=code)
        response = error.response()
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
