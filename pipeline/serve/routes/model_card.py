"""GET /v1/model-card: the served variant's card."""

from __future__ import annotations

from fastapi import APIRouter, Response
from starlette.exceptions import HTTPException

from pipeline.serve.routes import RouteContext, errors_doc


def router(ctx: RouteContext) -> APIRouter:
    routes = APIRouter(tags=["v1"])

    @routes.get(
        "/v1/model-card",
        response_class=Response,
        responses=errors_doc(404, e404="no model card describes the served variant"),
    )
    async def model_card() -> Response:
        """The served model's card (Markdown): intended use, data, per-class accuracy, failure modes, speed."""
        if ctx.model.card is None:
            raise HTTPException(404, "no model card describes the served variant: run `pipeline card` before serving")
        return Response(ctx.model.card, media_type="text/markdown; charset=utf-8")

    return routes
