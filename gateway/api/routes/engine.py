"""``GET /admin/v1/engine``: live engine load (admin token only)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends

from gateway.api.deps import AdminPrincipal, get_backend
from runtime.interface import Backend

router = APIRouter()


@router.get("/admin/v1/engine")
async def engine_load(_: AdminPrincipal, backend: Annotated[Backend, Depends(get_backend)]) -> dict:
    """Running/waiting requests, batch capacity and the target-forward counter
    (``forward_steps``: one per engine step, i.e. per ragged target forward)."""
    return {"ready": backend.ready(), **asdict(backend.load()), "spec": asdict(backend.spec_info())}
