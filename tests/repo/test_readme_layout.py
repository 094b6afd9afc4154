"""README's "What is where" table matches the tree: every path it names exists, and every
package folder of runtime/, gateway/ and training/ is named."""

from __future__ import annotations

import re

from tests.support import ROOT


def layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## What is where", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", first)
        base = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        # `gateway/main.py`, `cli.py`: a bare file name lies beside the first path
        out += [names[0]] + [n if "/" in n else base + n for n in names[1:]]
    return out


def test_every_path_in_the_table_exists():
    paths = layout_paths()
    assert len(paths) >= 20
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_every_package_folder_is_in_the_table():
    named = set(p.rstrip("/") for p in layout_paths())
    folders = sorted(
        str(d.relative_to(ROOT)) for top in ("runtime", "gateway", "training")
        for d in [ROOT / top, *(ROOT / top).iterdir()] if d.is_dir() and (d / "__init__.py").exists()
    )
    covered = [f for f in folders if f in named or any(n.startswith(f + "/") for n in named)]
    assert sorted(set(folders) - set(covered)) == []
