"""Stored Responses API responses: save, read back, delete — always within one tenant.

A response is saved when it completes (or is cut by ``max_output_tokens``) and the request
had ``store`` true (the default). Every read takes the caller's tenant: a response of
another tenant is indistinguishable from one that does not exist (``None`` / ``False``).
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import StoredResponse


async def save_response(session: AsyncSession, tenant: str, response: dict, input_items: list[dict]) -> None:
    """Store ``response`` (a response object: ``id``, ``model``, ``status``, ``output`` …) with
    the conversation it answered (normalised ``input_items``) for ``tenant``; commit."""
    body = {k: v for k, v in response.items() if k != "output"}
    session.add(StoredResponse(id=response["id"], tenant=tenant, model=response["model"], status=response["status"],
                               previous_response_id=response.get("previous_response_id"), input_items=input_items,
                               output_items=response["output"], body=body))
    await session.commit()


async def get_response(session: AsyncSession, response_id: str, tenant: str) -> StoredResponse | None:
    """The tenant's stored response ``response_id``, or None (unknown, or another tenant's)."""
    return await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id,
                                                              StoredResponse.tenant == tenant))


def response_object(row: StoredResponse) -> dict:
    """The response object as it was returned when it was created."""
    return {**row.body, "output": row.output_items}


async def delete_response(session: AsyncSession, response_id: str, tenant: str) -> bool:
    """Delete the tenant's stored response; False when there was none (or it is another tenant's)."""
    result = await session.execute(delete(StoredResponse).where(StoredResponse.id == response_id,
                                                                StoredResponse.tenant == tenant))
    await session.commit()
    return result.rowcount > 0
