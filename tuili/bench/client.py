"""One streaming request to an OpenAI-compatible endpoint, timed chunk by chunk.

The client asks for `stream_options.include_usage` so that token counts are the server's own.
Whatever goes wrong is recorded on the request, never raised: a benchmark counts failures by kind.

Failure kinds: `connect` (no connection), `timeout`, `http_<status>` (a non-2xx answer),
`disconnected` (the connection broke mid-stream), `malformed_sse` (an event that is not a JSON chunk
of the expected shape), `stream_error` (an error object inside the stream), `incomplete` (the body
ended without `data: [DONE]`), `no_output` (a complete stream that carried no text), `client_error`
(anything else, with its repr).
"""

from __future__ import annotations

import json
import time

import httpx

from tuili.bench.metrics import RequestRecord
from tuili.bench.sse import SSEParser
from tuili.bench.tokens import LocalTokenizer

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class StreamFailure(Exception):
    """Raised inside `send` to stop reading a stream; becomes the record's error."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def completion_prompt(messages: list[dict]) -> str:
    """The text a completions endpoint gets for a conversation: the contents joined by blank lines.

    Each turn's prompt therefore starts with the previous turn's prompt and reply, as with chat.
    """
    return "\n\n".join(m["content"] for m in messages)


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body itself."""
    try:
        error = json.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace") or "(empty body)"


class OpenAIStreamClient:
    def __init__(self, http: httpx.AsyncClient, root_url: str, endpoint: str, model: str, *,
                 api_key: str | None = None, extra_body: dict | None = None, ignore_eos: bool = False,
                 tokenizer: LocalTokenizer | None = None) -> None:
        self.http = http
        self.url = root_url + ENDPOINT_PATHS[endpoint]
        self.endpoint = endpoint
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra_body = dict(extra_body or {})
        if ignore_eos:
            self.extra_body["ignore_eos"] = True
        self.tokenizer = tokenizer

    def payload(self, messages: list[dict], max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = completion_prompt(messages)
        body.update(self.extra_body)
        return body

    async def send(self, record: RequestRecord, messages: list[dict], origin: float) -> None:
        """Send one streaming request and fill `record` in; `origin` is the run's perf_counter zero."""
        body = self.payload(messages, record.max_tokens)
        t0 = time.perf_counter()
        record.start_s = t0 - origin
        try:
            await self._stream(record, body, t0)
            await self._count_tokens(record, body)
            record.ok = True
        except StreamFailure as failure:
            record.error_kind, record.error = failure.kind, str(failure)
        except httpx.ConnectError as exc:
            record.error_kind, record.error = "connect", f"cannot connect to {self.url}: {exc or 'refused'}"
        except httpx.TimeoutException as exc:
            record.error_kind, record.error = "timeout", f"{type(exc).__name__} after {time.perf_counter() - t0:.1f} s"
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            record.error_kind, record.error = "disconnected", f"connection broke mid-stream: {exc}"
        except Exception as exc:  # a benchmark must outlive any single request (CancelledError passes)
            record.error_kind, record.error = "client_error", repr(exc)
        if record.e2el_s is None:
            record.e2el_s = time.perf_counter() - t0

    async def _stream(self, record: RequestRecord, body: dict, t0: float) -> None:
        async with self.http.stream("POST", self.url, json=body, headers=self.headers) as response:
            if response.status_code // 100 != 2:
                raise StreamFailure(f"http_{response.status_code}", error_message(await response.aread()))
            parser = SSEParser()
            pieces: list[str] = []
            async for line in response.aiter_lines():
                now = time.perf_counter() - t0
                data = parser.feed(line)
                if data is not None and self._handle(record, data, now, pieces):
                    break
            else:
                data = parser.close()
                if data is None or not self._handle(record, data, time.perf_counter() - t0, pieces):
                    raise StreamFailure("incomplete", "the stream ended without 'data: [DONE]'")
        record.text = "".join(pieces)
        if not record.chunk_times_s:
            raise StreamFailure("no_output", "the stream ended without any text")
        record.ttft_s = record.chunk_times_s[0]

    def _handle(self, record: RequestRecord, data: str, now: float, pieces: list[str]) -> bool:
        """Take one event's data; True once it is the final `[DONE]`."""
        if data.strip() == "[DONE]":
            record.e2el_s = now
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise StreamFailure("malformed_sse", f"event data is not JSON: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamFailure("malformed_sse", f"event data is not a JSON object: {data[:200]!r}")
        if "error" in chunk:
            raise StreamFailure("stream_error", error_message(data.encode()))
        usage = chunk.get("usage")
        # The final usage chunk may omit "choices"; every other chunk must carry the list.
        choices = chunk.get("choices", [] if isinstance(usage, dict) else None)
        if not isinstance(choices, list):
            raise StreamFailure("malformed_sse", f"chunk has no 'choices' list: {data[:200]!r}")
        if choices:
            text = self._text(choices[0], data)
            if text:
                record.chunk_times_s.append(now)
                pieces.append(text)
            record.finish_reason = choices[0].get("finish_reason") or record.finish_reason
        if isinstance(usage, dict):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                record.cached_tokens = details.get("cached_tokens")
        return False

    def _text(self, choice: object, data: str) -> str | None:
        if not isinstance(choice, dict):
            raise StreamFailure("malformed_sse", f"a choice is not a JSON object: {data[:200]!r}")
        if self.endpoint == "completions":
            text = choice.get("text")
        else:
            delta = choice.get("delta") or {}
            # Reasoning models stream their thinking in a separate field; it is output all the same.
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if text is not None and not isinstance(text, str):
            raise StreamFailure("malformed_sse", f"chunk text is not a string: {data[:200]!r}")
        return text

    async def _count_tokens(self, record: RequestRecord, body: dict) -> None:
        """Prefer the server's usage; else count locally; else one token per text-bearing chunk."""
        if isinstance(record.output_tokens, int):
            record.token_source = "usage"
        elif self.tokenizer is not None:
            prompt = completion_prompt(body["messages"]) if "messages" in body else body["prompt"]
            record.output_tokens = await self.tokenizer.count(record.text)
            record.prompt_tokens = await self.tokenizer.count(prompt)
            record.token_source = "tokenizer"
        else:
            record.output_tokens = len(record.chunk_times_s)
            record.token_source = "chunks"
