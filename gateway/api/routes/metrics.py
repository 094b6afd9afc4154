"""``GET /metrics``: Prometheus exposition of :mod:`gateway.observability.metrics` (admin token only).

Mounted by :func:`gateway.observability.metrics.install` unless ``SPARKGATE_METRICS_PORT`` moves the
endpoint to its own unauthenticated listener.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gateway.api.deps import AdminPrincipal

router = APIRouter()


@router.get("/metrics")
async def metrics(_: AdminPrincipal) -> Response:
    """Every ``sparkgate:*`` series plus prometheus-client's process/GC collectors."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
