"""The fenced code blocks of the Markdown docs (``docs/*.md``, ``README.md``), for
``tests/repo/test_docs_commands.py``.

A block whose info string is a shell (``bash``, ``sh``, ``shell``, ``console``, ``zsh``) or
``python`` is run by the test unless the nearest non-blank line before its fence is a marker

    <!-- docs-test: skip — why it cannot run in a test (a few words) -->

Every fenced block must have an info string (``text`` for diagrams and output), so commands
cannot hide in a bare ```` ``` ```` block. :func:`commands` splits a snippet into simple
commands (argv lists) so that the test can refuse programs it does not run and dry-parse the
flags of the project's own CLIs in skipped blocks (:func:`dry_parse`).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# docs/*.md only: docs/history/ (dated logs, kept unchanged) and docs/reports/ (generated output)
# hold no commands to run. Links are checked in DOCS, the reports and docs/history/README.md;
# not in the logs, which keep the links of their time.
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
LINKED = [*DOCS, *sorted((ROOT / "docs" / "reports").glob("*.md")), ROOT / "docs" / "history" / "README.md"]
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*[—–:-]+\s*(?P<why>\S.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")
# `2>&1`, `> file`, `>> file`, `< file` at the start of a word (dropped before splitting)
REDIRECT = re.compile(r"(?<!\S)\d*(?:>>?|<)(?:&\d+|\s*[^\s;&|]+)")
SEPARATORS = {";", "&", "&&", "||", "|", "(", ")", ";;"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
WRAPPERS = {"nohup": 0, "time": 0, "env": 0, "nice": 2}  # program → how many of its own args to drop


@dataclass(frozen=True)
class Block:
    """One fenced block: where it opens, its info string's first word, its text (dedented
    by the fence's indent) and the reason of a skip marker before it (None: none)."""

    path: Path
    line: int
    info: str
    text: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def shell(self) -> bool:
        return self.info in SHELLS

    @property
    def runs(self) -> bool:
        """Run by the test unless marked skipped."""
        return self.shell or self.info == "python"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order (an unclosed fence ends the file)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = SKIP.search(before)
        text = "\n".join(ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1:j])
        out.append(Block(path, i + 1, m["info"].lower(), text, marker["why"] if marker else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)]


def stray_markers(path: Path) -> list[int]:
    """Lines of skip markers that are not right before a shell or python block (stale markers)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    marked = {b.line for b in blocks(path) if b.runs and b.skip}
    out = []
    for n, ln in enumerate(lines, 1):
        if SKIP.search(ln):
            nxt = next((k for k in range(n, len(lines)) if lines[k].strip()), None)
            if nxt is None or nxt + 1 not in marked:
                out.append(n)
    return out


def broken_links(path: Path) -> list[str]:
    """Relative Markdown link targets of ``path`` (outside fenced blocks and code spans) that
    name no file or folder of the checkout; URLs and in-page anchors are not checked."""
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced = {n for b in blocks(path) for n in range(b.line, b.line + b.text.count("\n") + 3)}
    prose = "\n".join(re.sub(r"`[^`]*`", "", ln) for n, ln in enumerate(lines, 1) if n not in fenced)
    out = []
    for m in LINK.finditer(prose):
        target = m["target"].split("#")[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target) and not (path.parent / target).exists():
            out.append(m["target"])
    return out


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell snippet as argv lists: comments, redirections,
    leading ``VAR=value`` assignments and ``nohup``/``nice -n N``/``time``/``env`` wrappers
    dropped; split at newlines, ``;``, ``&``, ``&&``, ``||`` and ``|``. A quoted string
    spanning lines stays one word. Enough for the docs, not a shell parser."""
    out: list[list[str]] = []
    pending = ""
    for line in text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        lex = shlex.shlex(REDIRECT.sub(" ", pending), posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        try:
            words = list(lex)
        except ValueError:  # an open quote: the string goes on on the next line
            continue
        pending = ""
        argv: list[str] = []
        for w in [*words, ";"]:
            if w not in SEPARATORS:
                argv.append(w)
                continue
            while argv and ASSIGNMENT.match(argv[0]):
                argv.pop(0)
            while argv and argv[0] in WRAPPERS:
                del argv[:1 + WRAPPERS[argv[0]]]
            if argv:
                out.append(argv)
            argv = []
    return out


def own_cli(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``("module" | "script", target, args)`` when ``argv`` runs one of this project's
    CLIs (``sparkgate …``, ``python -m runtime.…|gateway.…|training.…``, ``python bench/….py``); else None."""
    prog = Path(argv[0]).name
    if prog == "sparkgate":
        return "module", "gateway.cli", argv[1:]
    if not re.fullmatch(r"python3?(\.\d+)?", prog) or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2 and argv[2].split(".")[0] in ("runtime", "gateway", "bench", "training"):
        return "module", argv[2], argv[3:]
    if argv[1].endswith(".py") and (ROOT / argv[1]).is_file():
        return "script", argv[1], argv[2:]
    return None


def dry_parse(cmds: list[tuple[str, str, list[str]]], timeout_s: float = 120) -> list[str | None]:
    """Run each CLI up to its ``ArgumentParser.parse_args`` in one subprocess and stop
    there: None per command whose flags parse, else argparse's error (or what went wrong
    before parsing). Nothing after the parse runs."""
    r = subprocess.run([sys.executable, "-c", "from tests.support.docs_blocks import _dry_parse_main; _dry_parse_main()"],
                       input=json.dumps(cmds), capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"dry-parse harness failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.splitlines()[-1])


class _Parsed(BaseException):
    pass


def _dry_parse_main() -> None:
    import argparse
    import contextlib
    import io
    import runpy

    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    results: list[str | None] = []
    for kind, target, args in json.loads(sys.stdin.read()):
        err = io.StringIO()
        sys.argv = [target, *args]
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                if kind == "module":
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(ROOT / target), run_name="__main__")
            results.append("exited without parsing its arguments")
        except _Parsed:
            results.append(None)
        except SystemExit as exc:
            results.append(None if exc.code in (0, None) else err.getvalue().strip()[-500:] or f"exit {exc.code}")
        except Exception as exc:  # noqa: BLE001 - reported, not raised: one bad command must not hide the others
            results.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps(results))
