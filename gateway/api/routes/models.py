"""``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI Models API)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from gateway.api.deps import CurrentPrincipal, get_backend
from gateway.openai.schemas import ModelCard, ModelList
from gateway.openai.translate import resolve_model
from runtime.interface import Backend

router = APIRouter()


def _card(request: Request, backend: Backend) -> ModelCard:
    return ModelCard(id=backend.info.model_name, created=request.app.state.started_at)


@router.get("/v1/models")
async def list_models(request: Request, _: CurrentPrincipal,
                      backend: Annotated[Backend, Depends(get_backend)]) -> ModelList:
    return ModelList(data=[_card(request, backend)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request, _: CurrentPrincipal,
                         backend: Annotated[Backend, Depends(get_backend)]) -> ModelCard:
    resolve_model(model, backend.info, [request.app.state.settings.model_name])
    return _card(request, backend)
