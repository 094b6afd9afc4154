"""``sparkgate tiers/tenants/keys`` admin commands against a migrated SQLite database,
checked through the app (limits and tier actually applied)."""

from __future__ import annotations


from tests.support.gateway_fixtures import chat
from tests.support.gateway_fixtures import http, run


def test_tiers_tenants_keys_commands(cli_env, capsys):
    rc, out, _ = run(capsys, "tiers", "create", "gold", "--min-tps", "20", "--max-concurrent", "4", "--rpm", "120",
                     "--tpm", "50000", "--priority", "10", "--max-queue-wait", "5")
    assert rc == 0 and out.split("\n")[1].split() == ["gold", "10", "20", "4", "120", "50000", "5s"]
    assert run(capsys, "tiers", "create", "gold")[0] == 2  # exists
    rc, out, err = run(capsys, "tiers", "update", "gold", "--tpm", "none", "--rpm", "60")
    assert rc == 0 and out.split("\n")[1].split() == ["gold", "10", "20", "4", "60", "-", "5s"] and "TTL" in err
    assert run(capsys, "tiers", "update", "nope", "--rpm", "1")[0] == 1
    rc, out, _ = run(capsys, "tiers", "list")
    assert [line.split()[0] for line in out.strip().split("\n")[1:]] == ["gold", "default"]

    assert run(capsys, "tenants", "create", "acme", "--tier", "gold")[0] == 0
    assert run(capsys, "tenants", "create", "initech")[0] == 0
    assert run(capsys, "tenants", "create", "acme")[0] == 1
    assert run(capsys, "tenants", "create", "x", "--tier", "nope")[0] == 1
    rc, out, _ = run(capsys, "tenants", "list")
    assert {tuple(line.split()[:2]) for line in out.strip().split("\n")[1:]} == {("acme", "gold"), ("initech", "(default)")}
    assert run(capsys, "tenants", "set-tier", "initech", "gold")[0] == 0
    assert run(capsys, "tenants", "set-tier", "nobody", "gold")[0] == 1

    rc, out, _ = run(capsys, "keys", "create", "--tenant", "initech", "--user", "ops", "--budget", "1000", "--rpm", "7")
    key = out.strip()
    r, backend = http(cli_env, key, json=chat())
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "7"  # the key's rpm (tighter)
    assert "x-ratelimit-limit-tokens" not in r.headers  # gold's tpm was cleared (unlimited)
    assert backend.requests[0].sla_target_tokens_per_s == 20 and backend.requests[0].priority == 10  # gold now
    rc, out, _ = run(capsys, "keys", "list")
    row = next(line for line in out.split("\n") if key[:12] in line).split()
    assert row[-2:] == [str(r.json()["usage"]["total_tokens"]), "1000"]  # tokens used, budget
    assert run(capsys, "tenants", "set-tier", "initech", "default")[0] == 0
    r, backend = http(cli_env, key, json=chat())
    assert backend.requests[0].sla_target_tokens_per_s is None and backend.requests[0].priority == 0
