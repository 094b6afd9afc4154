"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``)
on SQLite and on a real Postgres (fake backend): each tenant sees only its own (another
tenant's id is a 404 like an unknown one), what is stored is what was returned (streamed or
not, NUL and non-ASCII text included), ``store: false`` and deleted responses cannot be
continued, and a database that fails is a 503 on reads and ``store: false`` on writes."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from gateway.crud import records as crud_records
from gateway.crud import responses as crud_responses
from gateway.db.models import StoredResponse
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, parse_response_sse
from tests.support.tenancy_fixtures import bearer, new_key, running_app

URL = "/v1/responses"


def req(input="Say hello", **extra) -> dict:
    return {"model": MODEL, "input": input, **extra}


async def test_responses_are_stored_per_tenant(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        acme = bearer(await new_key(client, "acme", "alice"))
        globex = bearer(await new_key(client, "globex", "bob"))
        text = "Stored \x00 text, naïve ünïcode ✓"
        first = (await client.post(URL, json=req(text, instructions="Be brief.", metadata={"k": "v"}),
                                   headers=acme)).json()
        assert (await client.get(f"{URL}/{first['id']}", headers=acme)).json() == first
        async with app.state.sessionmaker() as s:
            row = await s.scalar(select(StoredResponse))
        assert (row.id, row.tenant, row.status, row.model, row.previous_response_id) == (
            first["id"], "acme", "completed", MODEL, None)
        assert row.input_items == [{"type": "message", "role": "user", "content": text}]
        assert row.output_items == first["output"] and crud_responses.response_object(row) == first

        r = await client.post(URL, json=req("Again", previous_response_id=first["id"], stream=True), headers=acme)
        second = parse_response_sse(r.text)[-1]["response"]
        assert second["previous_response_id"] == first["id"] and second["status"] == "completed"
        assert (await client.get(f"{URL}/{second['id']}", headers=acme)).json() == second
        async with app.state.sessionmaker() as s:
            row = await crud_responses.get_response(s, second["id"], "acme")
        assert row.input_items == [{"type": "message", "role": "user", "content": text},
                                   {"type": "message", "role": "assistant",
                                    "content": first["output"][0]["content"][0]["text"]},
                                   {"type": "message", "role": "user", "content": "Again"}]

        for method in ("GET", "DELETE"):  # another tenant's response is an unknown one
            for rid, headers in ((first["id"], globex), ("resp_unknown", acme)):
                r = await client.request(method, f"{URL}/{rid}", headers=headers)
                assert_openai_error(r, 404, "invalid_request_error", None, "not_found")
                assert rid in r.json()["error"]["message"]
        r = await client.post(URL, json=req("Hi", previous_response_id=first["id"]), headers=globex)
        assert_openai_error(r, 404, "invalid_request_error", "previous_response_id", "previous_response_not_found")
        await app.state.records.flush()  # the refusal left globex a rejected record
        async with app.state.sessionmaker() as s:
            rows = (await crud_records.query_records(s, limit=10, status="rejected"))[0]
        assert [(row.tenant, row.endpoint, row.error_code) for row in rows] == [
            ("globex", "responses", "previous_response_not_found")]

        unstored = (await client.post(URL, json=req("Hi", store=False), headers=acme)).json()
        assert unstored["store"] is False
        assert (await client.get(f"{URL}/{unstored['id']}", headers=acme)).status_code == 404
        r = await client.post(URL, json=req("Hi", previous_response_id=unstored["id"]), headers=acme)
        assert_openai_error(r, 404, "invalid_request_error", "previous_response_id", "previous_response_not_found")

        r = await client.delete(f"{URL}/{first['id']}", headers=acme)
        assert r.status_code == 200 and r.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        assert (await client.get(f"{URL}/{first['id']}", headers=acme)).status_code == 404
        assert (await client.delete(f"{URL}/{first['id']}", headers=acme)).status_code == 404
        r = await client.post(URL, json=req("Hi", previous_response_id=first["id"]), headers=acme)
        assert r.status_code == 404
        # the continued response keeps its own copy of the conversation
        third = await client.post(URL, json=req("More", previous_response_id=second["id"]), headers=acme)
        assert third.status_code == 200
        async with app.state.sessionmaker() as s:
            assert sorted(await s.scalars(select(StoredResponse.tenant))) == ["acme", "acme"]


async def test_a_failing_store_keeps_the_answer_and_a_failing_read_is_a_503(sqlite_db, monkeypatch):
    async def fail(*_, **__):
        raise OperationalError("SELECT 1", None, Exception("database is down"))

    async with running_app(sqlite_db) as (app, client):
        acme = bearer(await new_key(client, "acme", "alice"))
        monkeypatch.setattr(crud_responses, "save_response", fail)
        for stream in (False, True):
            r = await client.post(URL, json=req(stream=stream), headers=acme)
            obj = parse_response_sse(r.text)[-1]["response"] if stream else r.json()
            assert r.status_code == 200 and obj["status"] == "completed" and obj["store"] is False
            assert obj["output"][0]["content"][0]["text"] == "Hello there, I am a fake model."
        monkeypatch.setattr(crud_responses, "get_response", fail)
        r = await client.post(URL, json=req(previous_response_id="resp_x"), headers=acme)
        err = assert_openai_error(r, 503, "server_error", None, "store_unavailable")
        assert "retry-after" in r.headers and "unavailable" in err["message"]


@pytest.mark.parametrize("path", ["/v1/responses/resp_x", "/v1/responses"])
async def test_routes_need_a_key(client, path):
    method = "POST" if path == URL else "GET"
    r = await client.request(method, path, json=req())
    assert_openai_error(r, 401, "authentication_error", None, "invalid_api_key")
