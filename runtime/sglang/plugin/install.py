"""Install the SLA plugin into a Python environment's site-packages (stdlib only).

Two files are written into the target ``site-packages`` directory:

* ``sparkgate_sla_plugin.pth`` — one line, ``import sparkgate_sla_boot``. ``site``
  executes ``import`` lines of ``.pth`` files at every interpreter start-up
  (https://docs.python.org/3/library/site.html), so every process of that environment —
  including SGLang's ``multiprocessing`` spawn children — runs the boot module.
* ``sparkgate_sla_boot.py`` — loads ``runtime/sglang/plugin/sla_hook.py`` of *this*
  checkout by absolute path and calls ``activate()``; errors are reported on stderr and
  never stop the interpreter. ``SPARKGATE_SLA_PLUGIN=0`` skips it.

Nothing is copied from this repository: the boot file points at the checkout, so the
checkout must be visible at the same path to SGLang (in Docker: mount it read-only).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

PTH_NAME = "sparkgate_sla_plugin.pth"
BOOT_NAME = "sparkgate_sla_boot.py"
HOOK_FILE = Path(__file__).resolve().with_name("sla_hook.py")

_BOOT_TEMPLATE = '''"""Written by sparkgate (runtime/sglang/plugin/install.py): activates the SLA plugin.

Delete this file and {pth} to uninstall; SPARKGATE_SLA_PLUGIN=0 disables it.
"""
import os as _os
import sys as _sys

HOOK = {hook!r}

if _os.environ.get("SPARKGATE_SLA_PLUGIN", "1") != "0":
    try:
        import importlib.util as _u

        _spec = _u.spec_from_file_location("sparkgate_sla_hook", HOOK)
        _mod = _u.module_from_spec(_spec)
        _sys.modules["sparkgate_sla_hook"] = _mod
        _spec.loader.exec_module(_mod)
        _mod.activate()
    except Exception as _e:  # never break the interpreter
        _sys.modules.pop("sparkgate_sla_hook", None)
        _sys.stderr.write("sparkgate SLA plugin inactive: %r\\n" % (_e,))
'''


def boot_source(hook: Path | str = HOOK_FILE) -> str:
    """Text of ``sparkgate_sla_boot.py`` pointing at ``hook`` (an absolute path)."""
    return _BOOT_TEMPLATE.format(hook=str(Path(hook).resolve()), pth=PTH_NAME)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install(site_dir: Path | str, hook: Path | str = HOOK_FILE) -> list[Path]:
    """Write the boot module and the ``.pth`` into ``site_dir`` (idempotent).

    Returns:
        The two written paths (boot module first).

    Raises:
        FileNotFoundError: ``site_dir`` or the hook file does not exist.
    """
    site = Path(site_dir)
    if not site.is_dir():
        raise FileNotFoundError(f"site-packages directory {site} does not exist")
    if not Path(hook).is_file():
        raise FileNotFoundError(f"SLA hook {hook} not found")
    boot, pth = site / BOOT_NAME, site / PTH_NAME
    _write_atomic(boot, boot_source(hook))  # the module first, so the .pth never dangles
    _write_atomic(pth, "import sparkgate_sla_boot\n")
    return [boot, pth]


def uninstall(site_dir: Path | str) -> list[Path]:
    """Remove both files from ``site_dir``; returns those that existed."""
    removed = []
    for name in (PTH_NAME, BOOT_NAME):
        p = Path(site_dir) / name
        if p.exists():
            p.unlink()
            removed.append(p)
    return removed


def is_installed(site_dir: Path | str) -> bool:
    site = Path(site_dir)
    return (site / PTH_NAME).is_file() and (site / BOOT_NAME).is_file()


def site_packages_of(python: str) -> Path:
    """``purelib`` site-packages directory of the interpreter ``python`` (runs it once).

    Raises:
        subprocess.CalledProcessError / FileNotFoundError: ``python`` cannot be run.
    """
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPARKGATE_SLA_PLUGIN": "0"},
    )
    return Path(out.stdout.strip())
