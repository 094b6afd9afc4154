"""``sparkgate`` CLI: keys create/list/revoke, db upgrade/downgrade, serve bootstrap."""

from __future__ import annotations

import asyncio


from gateway import cli
from gateway.db import migrate
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat, http, make_settings, sqlite_url


def test_keys_create_prints_a_key_that_authenticates(cli_env, capsys):
    assert cli.main(["keys", "create", "--tenant", "cli-co", "--user", "ops"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("sk-sg-") and "\n" not in key and key[:12] in err
    r, backend = http(cli_env, key, json=chat())
    assert r.status_code == 200
    assert backend.requests[0].tenant == "cli-co" and backend.requests[0].user == "ops"


def test_keys_list_and_revoke(cli_env, capsys):
    cli.main(["keys", "create", "--tenant", "t1"])
    key = capsys.readouterr().out.strip()
    assert cli.main(["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert key[:12] in listing and "t1" in listing and "active" in listing and key not in listing
    assert cli.main(["keys", "revoke", key[:12]]) == 0
    assert "revoked" in capsys.readouterr().out
    cli.main(["keys", "list"])
    assert "revoked" in capsys.readouterr().out
    r, _ = http(cli_env, key, "GET", "/v1/models")
    assert r.status_code == 401
    assert cli.main(["keys", "revoke", "sk-sg-zzzzzz"]) == 1


def test_db_downgrade_and_upgrade_commands(cli_env):
    assert cli.main(["db", "downgrade", "base"]) == 0
    assert asyncio.run(migrate.current_revision_async(cli_env)) is None
    assert cli.main(["db", "upgrade"]) == 0
    assert asyncio.run(migrate.current_revision_async(cli_env)) == migrate.head_revision()


def test_serve_migrates_bootstraps_a_key_once_and_runs_uvicorn(tmp_path, monkeypatch, capsys):
    url = sqlite_url(tmp_path / "fresh" / "sparkgate.db")  # not migrated, dir does not exist yet
    monkeypatch.setenv("SPARKGATE_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr("gateway.main.build_backend", lambda settings: FakeBackend())
    grace = []
    monkeypatch.setattr("uvicorn.run", lambda app, host, port, timeout_graceful_shutdown=None:
                        (calls.append((app, host, port)), grace.append(timeout_graceful_shutdown)))

    assert cli.main(["serve", "--port", "9123"]) == 0
    out = capsys.readouterr().out
    key = next(word for word in out.split() if word.startswith("sk-sg-"))
    assert "curl http://127.0.0.1:9123/v1/chat/completions" in out
    assert f'-H "Authorization: Bearer {key}"' in out
    assert f'OpenAI(base_url="http://127.0.0.1:9123/v1", api_key="{key}")' in out
    assert f'"model": "{MODEL}"' in out
    app, host, port = calls[0]
    assert (host, port) == ("127.0.0.1", 9123) and app.state.settings.database_url == url
    assert grace[0] == app.state.settings.shutdown_timeout_s == 30.0  # graceful SIGTERM drain
    assert http(url, key, "GET", "/v1/models")[0].status_code == 200

    assert cli.main(["serve"]) == 0  # second run: a key exists, nothing printed
    assert "sk-sg-" not in capsys.readouterr().out
    assert calls[1][2] == 8000


def test_quickstart_uses_loopback_for_wildcard_host():
    text = cli.quickstart("sk-sg-x", make_settings("sqlite+aiosqlite://", host="0.0.0.0", port=8080))
    assert "http://127.0.0.1:8080/v1" in text and "0.0.0.0" not in text


def test_bench_subcommand_lists_and_runs_the_bench_scripts(capsys, tmp_path, monkeypatch):
    from gateway import cli

    assert cli.main(["bench"]) == 0
    listed = capsys.readouterr().out
    assert "serve_bench" in listed and "dtype_bench" in listed
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert "unknown benchmark 'no_such_bench'" in capsys.readouterr().err
    # a script runs as __main__ with its own argv, and its exit code comes back
    (tmp_path / "echo_bench.py").write_text(
        "import json, sys\nif __name__ == '__main__':\n    print(json.dumps(sys.argv[1:]))\n    sys.exit(int(sys.argv[-1]))\n")
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path)
    assert cli.main(["bench", "echo_bench", "--x", "3"]) == 3
    assert capsys.readouterr().out.strip() == '["--x", "3"]'
    assert cli.main(["bench", "echo_bench", "0"]) == 0
