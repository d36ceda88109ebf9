"""Counting tokens without downloading anything: the server's /tokenize, or a local tokenizer file.

The server's own count is preferred because it is the served model's tokenizer by definition; a
local `tokenizer.json` (the `tokenizers` library, no transformers import) is the fallback for
servers without /tokenize and for streams that carry no usage.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import httpx

from tuili.errors import TuiliError


class TokenCounter(Protocol):
    name: str

    async def count(self, text: str) -> int: ...


class ServerTokenizer:
    """POST {root}/tokenize as vLLM, SGLang and tuili serve answer it: {"count": n, "tokens": [...]}."""

    name = "server"

    def __init__(self, http: httpx.AsyncClient, root_url: str, model: str,
                 headers: dict[str, str] | None = None) -> None:
        self._http = http
        self._url = f"{root_url}/tokenize"
        self._model = model
        self._headers = headers or {}

    async def count(self, text: str) -> int:
        response = await self._http.post(
            self._url, json={"model": self._model, "prompt": text, "add_special_tokens": False},
            headers=self._headers)
        response.raise_for_status()
        body = response.json()
        if isinstance(body.get("count"), int):
            return body["count"]
        if isinstance(body.get("tokens"), list):
            return len(body["tokens"])
        raise ValueError(f"/tokenize answered {str(body)[:200]!r}: expected a 'count' or 'tokens' field")

    async def available(self) -> bool:
        """Whether the server answers /tokenize in the expected shape (any failure means no)."""
        try:
            return await self.count("hello world") > 0
        except (httpx.HTTPError, ValueError, AttributeError):
            return False


class LocalTokenizer:
    """A `tokenizer.json` file, or a directory holding one (a Hugging Face checkpoint directory)."""

    name = "tokenizer"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TuiliError(f"--tokenizer {str(path)!r} is invalid: expected a tokenizer.json file "
                             "or a directory that holds one")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise TuiliError(f"--tokenizer {str(file)!r} could not be read as a tokenizer.json: {exc}") from None

    def count_sync(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    async def count(self, text: str) -> int:
        return await asyncio.to_thread(self.count_sync, text)
