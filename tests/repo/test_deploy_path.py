"""docs/deploy.md "From one machine to many" shows the commands the scale-out tests run: the
router's argv and flags, each replica's argv and environment, and HAProxy's configuration come
from ``tests/support/scaleout.py``, which the tests use to start them."""

from __future__ import annotations

import re

from tests.support.docs_blocks import ROOT, blocks, commands
from tests.support.scaleout import HAPROXY_CFG, replica_command, replica_env, router_command

DOC = ROOT / "docs" / "deploy.md"


def section_blocks():
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## From one machine to many")
    end = text.index("\n## ", start + 1)
    first, last = text[:start].count("\n") + 1, text[:end].count("\n") + 1
    return [b for b in blocks(DOC) if first <= b.line <= last]


def argvs() -> list[list[str]]:
    return [argv for b in section_blocks() if b.shell for argv in commands(b.text)]


def test_router_command_is_the_tests():
    routers = [a for a in argvs() if "sglang_router.launch_router" in a]
    assert len(routers) == 1
    workers = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert routers[0] == router_command(30000, workers, 29000, python="python")


def test_replica_commands_and_environment_are_the_tests():
    replicas = [a for a in argvs() if "gateway.main:create_app" in a]
    assert [a[1:] for a in replicas] == [replica_command(p, python="x")[1:] for p in (8001, 8002)]
    assert {a[0] for a in replicas} == {".venv/bin/python"}
    text = "\n".join(b.text for b in section_blocks() if b.shell)
    exported = set(re.findall(r"\b(SPARKGATE_[A-Z_]+)=", text))
    env = replica_env("postgresql+asyncpg://x/y", "a", "m", ROOT, ["http://r"], "p:",
                      sglang_health_path="/readiness", sglang_health_interval_s=1)
    needed = {k for k in env if k.startswith("SPARKGATE_")} | {"SPARKGATE_REPLICA_ID"}
    assert needed <= exported, sorted(needed - exported)


def test_haproxy_config_is_the_tests():
    cfgs = [b.text for b in section_blocks() if b.info == "text" and b.text.startswith("global")]
    servers = "    server ra 127.0.0.1:8001\n    server rb 127.0.0.1:8002"
    assert cfgs == [HAPROXY_CFG.format(port=8000, servers=servers).strip("\n")]
