"""Application factory.

``create_app()`` reads :class:`Settings` from the environment and builds the embedded
engine, so the app can be served as ``uvicorn --factory gateway.main:create_app`` or
``uvicorn.run(create_app(settings), ...)`` from a test thread. The database must
already be migrated (``sparkgate db upgrade`` / :func:`gateway.db.migrate.upgrade`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from gateway.admin_ui import install as install_admin_ui
from gateway.tenancy.admission import AdmissionController
from gateway.api.bodylimit import BodyLimitMiddleware
from gateway.api.routes import admin, chat, completions, engine, health, models, responses, usage
from gateway.core.config import Settings
from gateway.core.security import AuthCache
from gateway.db.session import make_engine, make_sessionmaker
from gateway.api.error_handlers import install_error_handlers
from gateway.observability.records import RecordWriter
from gateway.observability.metrics import install as install_metrics
from gateway.observability.live import LiveState, default_replica_id
from gateway.observability.stats import RollingStats
from runtime.interface import Backend

log = logging.getLogger(__name__)


def build_backend(settings: Settings) -> Backend:
    """The embedded engine described by ``settings`` (imported lazily: tests never need it)."""
    from runtime.factory import create_backend

    return create_backend(settings.backend_config())


async def _start_backend(backend: Backend) -> None:
    try:
        await backend.start()
    except Exception:
        log.exception("the inference backend failed to start; /readyz stays 503")
        raise


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the backend in the background (``/healthz`` answers and ``/readyz`` says 503
    while the model loads), stop it and the DB pool on shutdown."""
    state = app.state
    state.backend_start = asyncio.create_task(_start_backend(state.backend))
    state.records.start()
    state.admission.start()
    state.live.start()
    try:
        yield
    finally:
        await state.admission.stop()
        await state.records.stop()  # flush buffered request records
        await state.live.stop()  # then drop out of the live replicas (records.py's sweep)
        if not state.backend_start.done():
            state.backend_start.cancel()
        with contextlib.suppress(BaseException):
            await state.backend_start
        try:
            await state.backend.stop()
        finally:
            await state.db_engine.dispose()


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: defaults to ``Settings()`` (environment / ``.env``).
        backend: any :class:`runtime.interface.Backend`; None → the embedded engine.
    """
    settings = settings or Settings()
    backend = backend if backend is not None else build_backend(settings)

    app = FastAPI(title="Sparkgate", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)  # every non-probe route needs a key
    app.state.settings = settings
    app.state.backend = backend
    app.state.db_engine = make_engine(settings.database_url)
    app.state.sessionmaker = make_sessionmaker(app.state.db_engine)
    app.state.auth_cache = AuthCache(ttl_s=settings.auth_cache_ttl_s)
    app.state.stats = RollingStats()
    app.state.admission = AdmissionController.from_settings(backend, app.state.sessionmaker, settings)
    app.state.records = RecordWriter.from_settings(app.state.sessionmaker, settings)
    app.state.replica_id = settings.replica_id or default_replica_id()
    leases = app.state.admission.leases
    app.state.live = LiveState(app.state.admission, app.state.stats, app.state.replica_id,
                               leases.client if leases is not None else None, settings.redis_prefix)
    app.state.records.replica_id = app.state.replica_id
    if leases is not None:
        app.state.records.replica_alive = app.state.live.alive
    # gateway.observability.observe: every request's outcome, once
    app.state.observers = [app.state.stats, app.state.admission, app.state.records]
    app.state.started_at = int(time.time())

    install_error_handlers(app)
    for router in (health.router, models.router, chat.router, completions.router, responses.router, engine.router,
                   admin.router, usage.router):
        app.include_router(router)
    install_metrics(app)  # Prometheus observer + /metrics (after the error handlers)
    install_admin_ui(app)  # the admin UI's static files at /admin (admin_ui/dist)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    return app
