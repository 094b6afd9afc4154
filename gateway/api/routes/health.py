"""Liveness and readiness probes (no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.api.deps import backend_start_error

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict:
    """200 whenever the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """200 once ``backend.ready()``; 503 while the model loads (or if starting failed)."""
    if request.app.state.backend.ready():
        return JSONResponse({"status": "ready"})
    error = backend_start_error(request)
    if error is not None:
        return JSONResponse({"status": "failed", "error": repr(error)}, status_code=503)
    return JSONResponse({"status": "starting"}, status_code=503)
