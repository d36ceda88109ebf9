"""Issue 20, "no request harms another": what one client sends cannot hurt the server or another
client, and the server tells a client nothing about its machine. Against the session's real
`tuili serve` (tests/server/conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tuili.server.cli import allowed_hosts

pytestmark = pytest.mark.slow


def _error(response: httpx.Response, status: int, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def test_models_names_the_model_not_its_path(server, auth, model_name):
    card = httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"][0]
    assert card["root"] == card["id"] == model_name
    assert not any("/" in str(value) for value in card.values()), card


def test_a_foreign_host_header_is_refused(server, auth):
    port = server.url.rsplit(":", 1)[1]
    for path in ("/health", "/v1/models"):
        message = _error(httpx.get(f"{server.url}{path}", headers={**auth, "Host": "evil.example"}), 400,
                         "host_not_allowed")
        assert "evil.example" in message and "localhost" in message
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
        assert httpx.get(f"{server.url}/v1/models", headers={**auth, "Host": host}).status_code == 200, host


def test_allowed_hosts_defaults():
    assert allowed_hosts(None, "127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(None, "::1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(None, "0.0.0.0") is None
    assert allowed_hosts("api.example.com, [::1]", "127.0.0.1") == {"api.example.com", "::1"}
    assert allowed_hosts("*", "127.0.0.1") is None


def test_a_body_must_be_declared_json(server, auth):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for declared in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = dict(auth) if declared is None else {**auth, "Content-Type": declared}
        message = _error(httpx.post(f"{server.url}/v1/completions", content=body, headers=headers), 415,
                         "unsupported_media_type")
        assert "application/json" in message and (declared is None or declared in message)
    ok = httpx.post(f"{server.url}/v1/completions", content=body, timeout=120,
                    headers={**auth, "Content-Type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text
