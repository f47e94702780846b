"""GET /v1/drift-reference: what `pipeline monitor --drift` compares live traffic with."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from starlette.exceptions import HTTPException

from pipeline.serve.protocol import json_bytes
from pipeline.serve.routes import RouteContext, errors_doc


def router(ctx: RouteContext) -> APIRouter:
    routes = APIRouter(tags=["v1"])

    @routes.get(
        "/v1/drift-reference",
        response_model=dict[str, Any],
        responses=errors_doc(404, e404="no drift reference was counted on the served variant"),
    )
    async def drift_reference() -> Response:
        """What the served variant saw and answered on the original test files, in the buckets of /metrics'
        drift signals (pipeline/monitoring/drift.py): what `pipeline monitor --drift` compares live traffic with."""
        if ctx.model.drift_reference is None:
            raise HTTPException(
                404, "no drift reference was counted on the served variant: run `pipeline evaluate` before serving"
            )
        return Response(json_bytes(ctx.model.drift_reference.model_dump(mode="json")), media_type="application/json")

    return routes
