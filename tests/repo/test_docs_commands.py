"""Docs that run: every fenced shell (and python) block in ``docs/*.md`` and ``README.md`` is
executed against the session's ``live_server`` (real model, uvicorn), or is marked
``<!-- docs-test: skip — why -->`` right before its fence (``tests/support/docs_blocks.py``).

What a block runs with — the only substitutions, each a placeholder the docs write:

* the documented address ``http://127.0.0.1:8000`` → the live server's base URL;
* the documented key placeholder ``sk-sg-...`` → a key issued for this test on the live
  server's database (``issue_key``);
* ``$SPARKGATE_ADMIN_TOKEN`` → the live server's admin token;
* ``$SPARKGATE_DATABASE_URL`` → a fresh, migrated SQLite database, so that the CLI
  examples (``sparkgate tiers create gold …``) start from nothing like a new install;
* ``sparkgate`` → this checkout's CLI (the interpreter's bin directory first on ``PATH``).

A shell block runs in ``bash`` with ``set -euo pipefail``, a python block in this
interpreter, each in a temporary directory and bounded by :data:`BLOCK_TIMEOUT_S`; ``curl``
is run as ``curl --fail-with-body -sS``, so any answer other than 2xx fails the block, and
no output may carry an OpenAI ``{"error": …}`` object. A shell block may only use :data:`RUNNABLE` programs: anything else (``make``, ``docker``,
``pip``, training runs, benches) must be marked skipped, so a new doc can neither rot
silently nor make this test start a long job. The flags of the project's own CLIs in
skipped blocks are checked by parsing them (``dry_parse``: argparse only, nothing runs).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.crud.keys import issue_key
from gateway.db.migrate import upgrade
from tests.support.docs_blocks import DOCS, LINKED, ROOT, all_blocks, broken_links, commands, dry_parse, own_cli, stray_markers

BASE_URL = "http://127.0.0.1:8000"
KEY_PLACEHOLDER = "sk-sg-..."
BLOCK_TIMEOUT_S = 60
RUNNABLE = {"curl", "sparkgate", "export", "echo"}
PREAMBLE = """set -euo pipefail
curl() { command curl --fail-with-body --silent --show-error --max-time 60 "$@"; }
"""

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.runs and b.skip is None]
SKIPPED = [b for b in BLOCKS if b.runs and b.skip is not None]


def test_docs_have_runnable_blocks_and_every_block_says_what_it_is():
    """Bare fences would let commands escape this test; a skip marker needs a reason and
    must sit right before a shell block."""
    assert len(DOCS) >= 10 and len(RUN) >= 3, [b.where for b in RUN]
    bare = [b.where for b in BLOCKS if not b.info]
    assert not bare, f"give these fenced blocks an info string (bash to run them, text otherwise): {bare}"
    stray = [f"{p.relative_to(ROOT)}:{n}" for p in DOCS for n in stray_markers(p)]
    assert not stray, f"docs-test markers not right before a shell or python block: {stray}"


def test_relative_links_name_files_of_the_checkout():
    """A moved doc, report or plot must not leave a dangling link (docs/history/'s logs are
    exempt: they keep the links of their time)."""
    assert not any(p.is_relative_to(ROOT / "docs" / "history") for p in DOCS)
    assert not any(p.is_relative_to(ROOT / "docs" / "reports") for p in DOCS)
    broken = {str(p.relative_to(ROOT)): bad for p in LINKED if (bad := broken_links(p))}
    assert not broken, broken


@pytest.mark.parametrize("block", [b for b in RUN if b.shell], ids=[b.where for b in RUN if b.shell])
def test_every_unmarked_shell_block_uses_only_runnable_programs(block):
    progs = sorted({Path(argv[0]).name for argv in commands(block.text)} - RUNNABLE)
    assert not progs, (f"{block.where} runs {progs}, which this test does not run: mark the block "
                       f"'<!-- docs-test: skip — why -->' or make it runnable")


@pytest.mark.model
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_block_runs_against_the_live_server(block, live_server, tmp_path):
    key = asyncio.run(issue_key(live_server.database_url, "docs-tenant", user_label="docs"))
    cli_db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    upgrade(cli_db)
    script = block.text.replace(BASE_URL, live_server.base_url).replace(KEY_PLACEHOLDER, key)
    env = {**os.environ, "SPARKGATE_ADMIN_TOKEN": live_server.admin_token, "SPARKGATE_DATABASE_URL": cli_db,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    argv = ["bash", "-c", PREAMBLE + script] if block.shell else [sys.executable, "-c", script]
    r = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, f"{block.where} exited {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    assert '{"error"' not in r.stdout.replace(" ", ""), f"{block.where}: {r.stdout[-1500:]}"


def test_skipped_blocks_name_a_reason_and_our_own_clis_parse_their_flags():
    assert all(len(b.skip) >= 8 for b in SKIPPED), [(b.where, b.skip) for b in SKIPPED]
    cmds = [(b.where, cli) for b in SKIPPED for argv in commands(b.text) if (cli := own_cli(argv))]
    assert len(cmds) >= 10, cmds  # the bench and drafter-training commands
    errors = {f"{where}: {' '.join([cli[1], *cli[2]])}": err
              for (where, cli), err in zip(cmds, dry_parse([c for _, c in cmds])) if err is not None}
    assert not errors, errors
