"""Fixtures of the gateway tests (the app, client and database fixtures every folder uses are
registered once by the root conftest: tests/support/gateway_fixtures.py, tenancy_fixtures.py)."""

from __future__ import annotations

import pytest

from tests.support.tenancy_fixtures import new_pg_database


@pytest.fixture
def cli_env(db_url, tmp_path, monkeypatch):
    """The ``sparkgate`` CLI pointed at the test database ``db_url``, run from an empty folder
    (no developer ``.env``). Returns the database URL."""
    monkeypatch.setenv("SPARKGATE_DATABASE_URL", db_url)
    monkeypatch.chdir(tmp_path)
    return db_url


@pytest.fixture
def pg_empty_url():
    """A new, empty Postgres database (dropped afterwards); skipped without Postgres (fails under CI)."""
    with new_pg_database("sparkgate_mig") as url:
        yield url
