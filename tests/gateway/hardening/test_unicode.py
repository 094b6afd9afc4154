"""Hardening round 2, item 1 (edge side): every free-text field of ``/v1/chat/completions``
and ``/v1/completions`` must be valid Unicode — a lone surrogate, sent as the JSON escape
``"\\ud800"``, is a 400 naming the field; ``user`` is stored, so NUL (and more than 256
characters) is refused there too. On main ``"user": "\\ud800"`` answered 200 and then
stopped the record writer for every tenant. SQLite and Postgres."""

from __future__ import annotations

import base64
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_fixtures import MODEL, chat
from tests.support.tenancy_fixtures import ADMIN_HEADERS, bearer, new_key, running_app

JSON = {"content-type": "application/json"}


def raw_json(body: dict) -> bytes:
    """``body`` as JSON bytes with every non-ASCII character escaped (``"\\ud800"`` stays a
    JSON escape, as an attacker would send it; ``json.dumps`` cannot produce it otherwise)."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.mark.parametrize("path,field,value,param", [
    ("/v1/chat/completions", "user", "\ud800", "user"),
    ("/v1/chat/completions", "user", "a\x00b", "user"),
    ("/v1/chat/completions", "user", "x" * 257, "user"),  # request_records.user is String(256)
    ("/v1/chat/completions", "stop", ["ok", "\udc80"], "stop[1]"),
    ("/v1/chat/completions", "stop", "\ud800", "stop"),
    ("/v1/chat/completions", "model", "\ud800", "model"),
    ("/v1/chat/completions", "cache_salt", "\ud800", "cache_salt"),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": "hi \ud800"}], "messages[0].content"),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
     "messages[0].content[0].text"),
    ("/v1/chat/completions", "messages", [{"role": "\ud800", "content": "x"}], "messages[0].role"),
    ("/v1/completions", "user", "\ud800", "user"),
    ("/v1/completions", "stop", ["\ud800"], "stop[0]"),
    ("/v1/completions", "prompt", ["\ud800"], "prompt[0]"),
])


async def test_text_fields_that_cannot_be_stored_are_400(sqlite_db, path, field, value, param):
    async with running_app(sqlite_db) as (app, client):
        key = await new_key(client, "acme")
        body = {"model": MODEL, "max_tokens": 4, **({"messages": chat()["messages"]} if "chat" in path
                                                    else {"prompt": "Say hello"}), field: value}
        r = await client.post(path, content=raw_json(body), headers={**bearer(key), **JSON})
        assert app.state.backend.requests == []
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value")
    assert err["message"].startswith(f"Invalid value for '{param}': ")


async def test_surrogate_user_is_400_and_the_next_request_is_recorded(tenancy_db):
    """End to end (the issue's probe): ``"user": "\\ud800"`` is refused, and the records of
    the requests after it are written (on main it answered 200 and no record was ever
    written again)."""
    async with running_app(tenancy_db) as (app, client):
        h = {**bearer(await new_key(client, "acme")), **JSON}
        bad = await client.post("/v1/chat/completions", content=raw_json(chat(user="\ud800")), headers=h)
        good = await client.post("/v1/chat/completions", content=raw_json(chat(user="end-user-é")), headers=h)
        await client.post("/admin/v1/rollups/refresh", headers=ADMIN_HEADERS)
        listed = await client.get("/v1/requests", headers=h)
        status = (await client.get("/admin/v1/tenancy/status", headers=ADMIN_HEADERS)).json()["records"]
        metrics = await client.get("/metrics", headers=ADMIN_HEADERS)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "user", bad.text
    assert good.status_code == 200
    assert [(r["id"], r["user"]) for r in listed.json()["data"]] == [(good.json()["id"], "end-user-é")]
    assert (status["written"], status["rejected"], status["buffered"]) == (1, 0, 0)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    assert fams["sparkgate:db_records_rejected"].samples[0].value == 0


async def test_a_cursor_with_nul_is_400_not_500(tenancy_db):
    """``cursor`` is decoded to a record id that is compared with the stored ids; NUL in it
    made Postgres fail (500)."""
    cursor = base64.urlsafe_b64encode("2026-01-01T00:00:00+00:00|a\x00b".encode()).decode()
    async with running_app(tenancy_db) as (app, client):
        r = await client.get("/admin/v1/requests", params={"cursor": cursor}, headers=ADMIN_HEADERS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cursor", r.text


def test_live_server_refuses_a_surrogate_user_and_keeps_recording(live_server):
    """The issue's probe against the real server (uvicorn, real model): the bad request is a
    400, and the next request's record appears in ``/v1/requests`` by itself (the
    background writer, no manual flush; polled with a deadline)."""
    import time

    import httpx

    h = {**live_server.headers(), **JSON}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with httpx.Client(base_url=live_server.base_url, timeout=300) as c:
        bad = c.post("/v1/chat/completions", content=raw_json({**body, "user": "\ud800"}), headers=h)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "user", bad.text
        good = c.post("/v1/chat/completions", content=raw_json({**body, "user": "after-the-bad-one"}), headers=h)
        assert good.status_code == 200
        deadline = time.monotonic() + 60
        while True:
            recs = c.get("/v1/requests", params={"user": "after-the-bad-one"}, headers=h).json()["data"]
            if recs or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert [r["id"] for r in recs] == [good.json()["id"]]
