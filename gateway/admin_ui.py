"""The admin UI at ``/admin``: the static build of ``admin_ui/`` (``admin_ui/dist``).

The pages are public static files (no data in them); every number comes from
``/admin/v1/...`` with the admin token the browser keeps in ``sessionStorage``, so a
tenant key gets 403 there and the UI says so. Served with a strict Content-Security-
Policy (scripts, styles and requests from this origin only, no framing). Without a
build the pages answer 503 with how to build them.

``python -m gateway.admin_ui --check`` exits 1 when ``admin_ui/dist`` is missing or was
built from other sources (the Makefile rebuilds it then).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # FastAPI is imported in install() only: the --check below runs on a bare python3
    from fastapi import FastAPI

SOURCE = Path(__file__).resolve().parents[1] / "admin_ui"
DIST = SOURCE / "dist"
# Inputs of the build; ``admin_ui/scripts/build-info.mjs`` hashes the same list the same way.
HASHED_FILES = ("index.html", "package.json", "package-lock.json", "tsconfig.json", "vite.config.ts")
HASHED_DIRS = ("src",)

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def source_hash(root: Path = SOURCE) -> str:
    """sha256 over ``path\\0sha256(content)\\n`` of every build input, sorted by path."""
    files = [root / f for f in HASHED_FILES] + sorted(p for d in HASHED_DIRS for p in (root / d).rglob("*") if p.is_file())
    lines = sorted(f"{p.relative_to(root).as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def build_is_current() -> bool:
    try:
        info = json.loads((DIST / "build-info.json").read_text())
        return (DIST / "index.html").is_file() and info.get("source_sha256") == source_hash()
    except (OSError, ValueError):
        return False


def install(app: FastAPI, dist: Path = DIST) -> None:
    """Serve ``dist`` at ``/admin/`` (``index.html``) and ``/admin/assets/*``."""
    from fastapi.responses import FileResponse, PlainTextResponse, RedirectResponse
    from starlette.staticfiles import StaticFiles

    class Assets(StaticFiles):
        """Hashed file names: cache forever."""

        async def get_response(self, path, scope):
            response = await super().get_response(path, scope)
            if response.status_code == 200:
                response.headers["cache-control"] = "public, max-age=31536000, immutable"
            response.headers.update(SECURITY_HEADERS)
            return response

    index = dist / "index.html"

    @app.get("/admin", include_in_schema=False)
    async def admin_redirect() -> RedirectResponse:
        return RedirectResponse("/admin/", status_code=308)

    @app.get("/admin/", include_in_schema=False)
    async def admin_index():
        if not index.is_file():
            return PlainTextResponse("The admin UI is not built: run `make admin-ui` (needs Node >= 20.19 and npm).",
                                     status_code=503)
        return FileResponse(index, media_type="text/html", headers={"cache-control": "no-cache", **SECURITY_HEADERS})

    if (dist / "assets").is_dir():
        app.mount("/admin/assets", Assets(directory=dist / "assets"), name="admin-assets")


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        ok = build_is_current()
        print("admin_ui/dist is current" if ok else "admin_ui/dist is missing or stale")
        return 0 if ok else 1
    if argv == ["--hash"]:
        print(source_hash())
        return 0
    print("usage: python -m gateway.admin_ui --check | --hash", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
