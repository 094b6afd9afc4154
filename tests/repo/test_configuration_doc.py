"""One source of truth per setting (issue 26, item 3).

The gateway's settings are derived from ``EngineConfig``/``SGLangConfig``; every
``SPARKGATE_*`` variable is read in one place; ``docs/configuration.md`` is generated from
the code and every ``SPARKGATE_*`` name the repository mentions is one of its variables.
"""

from __future__ import annotations

import os
import re
import subprocess
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from gateway.core.config import SHARED, Settings
from runtime.config import EngineConfig
from runtime.sglang.client import SGLangConfig
from runtime.upstream.config import UpstreamConfig
from tests.support.configuration_doc import DOC, REGENERATE, markdown

ROOT = Path(__file__).resolve().parents[2]

#: modules of gateway/ and runtime/ that may touch ``os.environ``, and why
ENV_READERS = {
    "runtime/config.py": "the runtime's SPARKGATE_* variables (runtime.config.ENV)",
    "runtime/sglang/plugin/sla_hook.py": "the SLA plugin's, in the SGLang servers' processes",
    "runtime/sglang/plugin/install.py": "the plugin's boot file and install check",
    "runtime/sglang/launch.py": "copies the environment for the SGLang server it starts",
    "runtime/kernels/cpu/gguf_cpu.py": "PATH, so torch finds ninja to build the kernels",
}


def _changed(hint: object, default: object, name: str) -> tuple[str, object]:
    """An environment string for a field of type ``hint`` and the value it must parse to,
    different from ``default``."""
    kinds = set(typing.get_args(hint)) or {hint}
    if bool in kinds:
        return ("false", False) if default else ("true", True)
    if int in kinds or float in kinds:
        value = (default or 0) + (3 if int in kinds else 0.25)
        return str(value), value
    narrowed = Settings.model_fields.get(name)  # a field the gateway narrows to a Literal (dtype, spec_method, …)
    if narrowed is not None and typing.get_origin(narrowed.annotation) is typing.Literal:
        value = next(c for c in typing.get_args(narrowed.annotation) if c not in (default, "auto"))
        return value, value
    return f"value-of-{name}", f"value-of-{name}"


def _set_all(monkeypatch, config: type, prefix: str) -> dict[str, object]:
    """Set ``SPARKGATE_<prefix><FIELD>`` (``SPARKGATE_<FIELD>`` for :data:`SHARED`) for every
    field of ``config`` to a non-default value; return the expected field values."""
    hints, expected = typing.get_type_hints(config), {}
    for f in fields(config):
        setting = f.name if f.name in SHARED else prefix + f.name
        text, expected[f.name] = _changed(hints[f.name], f.default, f.name)
        monkeypatch.setenv(f"SPARKGATE_{setting.upper()}", text)
    return expected


@pytest.fixture()
def clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("SPARKGATE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_every_engine_field_is_a_setting_that_reaches_the_engine_config(clean_env):
    """Each ``EngineConfig`` field is read from ``SPARKGATE_<FIELD>`` and passed through:
    a new engine field needs no line in the gateway."""
    # the server's two differences: it profiles at start-up, and it speculates where that pays
    assert Settings(_env_file=None).engine_config() == EngineConfig(profile_on_start=True, spec_method="auto")
    expected = _set_all(clean_env, EngineConfig, "")
    assert Settings(_env_file=None).engine_config() == EngineConfig(**expected)


def test_every_sglang_field_is_a_setting_that_reaches_the_sglang_config(clean_env):
    """Each ``SGLangConfig`` field is read from ``SPARKGATE_SGLANG_<FIELD>`` (the shared
    ones, e.g. ``max_context``, from the unprefixed setting), URLs as a comma list."""
    expected = _set_all(clean_env, SGLangConfig, "sglang_")
    clean_env.setenv("SPARKGATE_SGLANG_URLS", "http://a:1, http://b:2")
    clean_env.setenv("SPARKGATE_BACKEND", "sglang")
    config = Settings(_env_file=None).backend_config()
    assert config == SGLangConfig(**expected | {"urls": ("http://a:1", "http://b:2")})
    assert config.max_context == Settings(_env_file=None).engine_config().max_context == 3 + 8192


def test_every_upstream_field_is_a_setting_that_reaches_the_upstream_config(clean_env):
    """Each ``UpstreamConfig`` field is read from ``SPARKGATE_UPSTREAM_<FIELD>`` (the shared
    ones unprefixed), URLs and keys as comma lists, with ``SPARKGATE_BACKEND=openai``."""
    expected = _set_all(clean_env, UpstreamConfig, "upstream_")
    clean_env.setenv("SPARKGATE_UPSTREAM_URLS", "http://a:1, http://b:2")
    clean_env.setenv("SPARKGATE_UPSTREAM_KEYS", "sk-a,sk-b")
    clean_env.setenv("SPARKGATE_BACKEND", "openai")
    config = Settings(_env_file=None).backend_config()
    assert config == UpstreamConfig(**expected | {"urls": ("http://a:1", "http://b:2"), "keys": ("sk-a", "sk-b")})
    assert config.max_context == 3 + 8192 and config.request_timeout_s == 600.25


def test_configuration_doc_is_generated_from_the_code():
    """``docs/configuration.md`` lists every setting with the type, default and meaning of the code."""
    assert DOC.read_text(encoding="utf-8") == markdown(), f"docs/configuration.md is stale; regenerate: {REGENERATE}"
    text = markdown()
    assert all(f"| `SPARKGATE_{name.upper()}` |" in text for name in Settings.model_fields)
    assert "| `SPARKGATE_DATABASE_URL` | str | `sqlite+aiosqlite:///<cache_dir>/sparkgate.db` |" in text  # no machine path
    assert "| `SPARKGATE_PROFILE_ON_START` | bool | `true` |" in text and "| `SPARKGATE_KERNELS` | str | `auto` |" in text


def test_every_sparkgate_name_in_the_repository_is_a_documented_variable():
    """Docs, compose files, Dockerfile, CI, code and tests name only variables that exist
    (``docs/history/`` keeps old names); ``SPARKGATE_SLA_*``-style prefixes must match one."""
    known = set(re.findall(r"`(SPARKGATE_[A-Z0-9_]+)`", markdown()))
    out = subprocess.run(["git", "grep", "-I", "-o", "-h", "-E", r"SPARKGATE_[A-Z0-9_]*", "--", ".",
                          ":(exclude)docs/history"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    mentioned = set(out.stdout.split())
    unknown = {m for m in mentioned if m not in known and not (m.endswith("_") and any(k.startswith(m) for k in known))}
    assert not unknown, f"SPARKGATE_ names that are no variable (docs/configuration.md): {sorted(unknown)}"
    assert {"SPARKGATE_DTYPE", "SPARKGATE_CACHE_DIR", "SPARKGATE_SLA_PLUGIN"} <= mentioned


def test_only_the_config_modules_read_the_environment():
    """``SPARKGATE_*`` variables are read in one place each: ``Settings`` (pydantic), or the
    ``ENV`` tables of ``runtime/config.py`` and the SGLang plugin; no other module of the
    gateway or the runtime touches ``os.environ``."""
    readers = {str(p.relative_to(ROOT)) for d in ("gateway", "runtime") for p in (ROOT / d).rglob("*.py")
               if re.search(r"os\.environ|getenv\(", p.read_text(encoding="utf-8"))}
    assert readers == set(ENV_READERS)
