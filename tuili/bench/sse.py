"""Server-Sent Events: turn the lines of a response body into the `data` payloads of its events.

The rules are the WHATWG event-stream ones that matter for OpenAI-style streams: an event is a run
of field lines ended by a blank line; `data:` lines are joined with "\\n"; one space after the colon
is dropped; lines starting with ":" are comments; other fields (event, id, retry) are ignored. One
deliberate leniency: an event left pending when the body ends is still delivered, so a server that
omits the final blank line after `data: [DONE]` is not counted as failing.
"""

from __future__ import annotations


class SSEParser:
    """Feed it lines (without their line ending); it returns each event's data once it is complete."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Consume one line; return the finished event's data when `line` ends an event."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def close(self) -> str | None:
        """The body ended: return the data of an event still pending, if any."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data
