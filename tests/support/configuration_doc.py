"""``docs/configuration.md``: the table of every ``SPARKGATE_*`` variable, generated from the code.

Sources: the fields of :class:`gateway.core.config.Settings` (types and defaults from pydantic,
meanings from the ``Attributes:`` docstrings of ``Settings``, ``EngineConfig`` and
``SGLangConfig``, ``UpstreamConfig``), the runtime's :data:`runtime.config.ENV`, the SGLang plugin's
:data:`runtime.sglang.plugin.sla_hook.ENV`, and :data:`DEV_ENV` below. Regenerate::

    .venv/bin/python -m tests.support.configuration_doc --write

``tests/repo/test_configuration_doc.py`` fails when the committed file and the code disagree.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import fields
from pathlib import Path

from gateway.core.config import Settings, default_database_url
from runtime import config as runtime_config
from runtime.config import EngineConfig
from runtime.sglang.client import SGLangConfig
from runtime.sglang.plugin import sla_hook
from runtime.upstream.config import UpstreamConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python -m tests.support.configuration_doc --write"

#: Variables read only by the tests and the admin UI's dev server: name → (default, meaning).
DEV_ENV = {
    "SPARKGATE_CHECK_SGLANG_SOURCE": ("", "``1`` runs the tests that download the sglang wheel "
                                      "(``tests/runtime/sglang/test_source.py``, ``tests/runtime/sglang/test_gpu.py``)."),
    "SPARKGATE_FAST_BUDGET_S": ("", "seconds: a test not marked ``slow`` whose call takes longer fails "
                                "(``tests/support/hygiene.py``; off when unset)."),
    "SPARKGATE_SGLANG_WHEEL": ("", "a local sglang wheel for those tests instead of the download."),
    "SPARKGATE_UI_SCREENSHOTS": ("", "folder the admin-UI tests write page screenshots to (``docs/screenshots``)."),
    "SPARKGATE_URL": ("http://127.0.0.1:8000", "gateway the admin UI's dev server proxies (``admin_ui/vite.config.ts``)."),
}


def attribute_docs(*classes: type) -> dict[str, str]:
    """``{name: meaning}`` from the ``Attributes:`` sections of the classes' docstrings
    (Google style; ``a, b: text`` documents both names)."""
    docs = {}
    for cls in classes:
        section = inspect.cleandoc(cls.__doc__ or "").partition("Attributes:\n")[2]
        for names, text in re.findall(r"^ {4}(\w+(?:, \w+)*): (.*(?:\n {8}.*)*)", section, re.M):
            docs |= dict.fromkeys(names.split(", "), " ".join(text.split()))
    return docs


def _cell(value: object) -> str:
    """``value`` as Markdown table text (docstring roles and ``literals`` as code)."""
    text = re.sub(r":\w+:`", "`", str(value)).replace("``", "`").replace("typing.", "")
    return text.replace("|", "\\|")


def _shown(default: object) -> str:
    if default is None or default == []:
        return "unset"
    if isinstance(default, list):
        default = ",".join(default)
    return f"`{str(default).lower() if isinstance(default, bool) else default}`"


def _settings_rows() -> dict[str, list[tuple]]:
    """Rows ``(name, type, default, meaning)`` of the settings: gateway, engine, SGLang, upstream."""
    docs = (attribute_docs(EngineConfig, Settings) | {f"sglang_{k}": v for k, v in attribute_docs(SGLangConfig).items()}
            | {f"upstream_{k}": v for k, v in attribute_docs(UpstreamConfig).items()})
    engine = {f.name for f in fields(EngineConfig)}
    rows: dict[str, list[tuple]] = {"gateway": [], "engine": [], "sglang": [], "upstream": []}
    for name, info in Settings.model_fields.items():
        group = ("engine" if name in engine else "sglang" if name.startswith("sglang_")
                 else "upstream" if name.startswith("upstream_") else "gateway")
        kind = info.annotation.__name__ if type(info.annotation) is type else info.annotation
        default = (default_database_url.__doc__.split("``")[1] if info.default_factory is default_database_url
                   else info.get_default(call_default_factory=True))  # no machine path in the docs
        rows[group].append((name, kind, _shown(default), docs[name]))
    return rows


def markdown() -> str:
    """The text of ``docs/configuration.md``."""
    rows = _settings_rows()
    groups = [("Gateway (`gateway.core.config.Settings`; also read from `.env`)", rows["gateway"]),
              ("Embedded engine (`runtime.config.EngineConfig`'s fields)", rows["engine"]),
              ("SGLang backend (`runtime.sglang.client.SGLangConfig`'s fields)", rows["sglang"]),
              ("OpenAI-compatible upstream backend (`runtime.upstream.config.UpstreamConfig`'s fields)",
               rows["upstream"])]
    for title, table in [("Read by the runtime itself, also without the gateway (`runtime.config.ENV`)", runtime_config.ENV),
                         ("In the SGLang servers' environment: the SLA plugin (`runtime.sglang.plugin.sla_hook.ENV`)",
                          sla_hook.ENV), ("Development and tests only (`tests/support/configuration_doc.py`)", DEV_ENV)]:
        groups.append((title, [(name[len("SPARKGATE_"):].lower(), type(d).__name__, _shown(d or None), text)
                               for name, (d, text) in table.items()]))
    lines = ["# Configuration", "", "Every `SPARKGATE_*` environment variable. Generated from the code by",
             f"`{REGENERATE}`; do not edit by hand",
             "(`tests/repo/test_configuration_doc.py` fails when this file and the code disagree).", ""]
    for title, table in groups:
        lines += [f"## {title}", "", "| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
        lines += [f"| `SPARKGATE_{n.upper()}` | {_cell(k)} | {_cell(d)} | {_cell(t)} |" for n, k, d, t in table] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {REGENERATE}")
    DOC.write_text(markdown(), encoding="utf-8")
    print(f"wrote {DOC}")
