"""FATHOM_LOG_FORMAT=json: a real web process writes one JSON object per line, and a request's
lines carry the id its response returned in X-Request-Id."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.platform.conftest import WebServer, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_line_is_json_and_names_the_request_id_the_response_returned(monkeypatch, tmp_path):
    monkeypatch.setenv("FATHOM_LOG_FORMAT", "json")
    server = WebServer(free_port(), tmp_path / "web.log")
    server.start()
    try:
        chat = {"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}
        fresh = httpx.post(f"{server.url}/v1/chat/completions", json=chat)
        given = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-4f2a.7"})
        insane = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "a<b> " + "x" * 200})
        api = httpx.get(f"{server.url}/api/runs/")  # a Django view: no login, a 401 logged by Django
    finally:
        server.stop()

    assert fresh.status_code == 401
    assert len(fresh.headers["x-request-id"]) == 32  # a fresh uuid4, hex
    assert given.headers["x-request-id"] == "trace-4f2a.7"  # the caller's own, kept
    assert len(insane.headers["x-request-id"]) == 32  # replaced, never echoed
    assert api.status_code in (401, 403) and api.headers["x-request-id"]

    lines = [line for line in (tmp_path / "web.log").read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, uvicorn's own included
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)
    by_id = {r["request_id"]: r for r in records if "request_id" in r and r["logger"] == "fathom.v1"}
    for response in (fresh, given, insane):
        line = by_id[response.headers["x-request-id"]]
        assert line["status"] == 401 and line["endpoint"] == "chat" and line["duration_s"] >= 0
    django_lines = [r for r in records if r.get("request_id") == api.headers["x-request-id"]]
    assert django_lines and django_lines[0]["logger"] == "django.request"
