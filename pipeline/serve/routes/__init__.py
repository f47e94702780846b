"""Server routes beside the inference ones: one module each with a `router(ctx) -> APIRouter`, one line in ROUTES.

A route gets what the server serves (`RouteContext`: the settings, the model, and `classify` to run image files
through the same decoding, batcher and model as /v1/predict). The app includes every router of the table behind
its middleware: the request id and access log, the token, the body limit and timeout, and the Prometheus
observation apply to them as to every route; errors are JSON {"error": ...} (raise starlette's HTTPException).
docs/extending.md has the checklist. The inference routes themselves (/v1/predict, /v2/.../infer) are answered by
`HotPath` in hotpath.py, before FastAPI's layers, for speed (with the same request rules).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fastapi import APIRouter

    from pipeline.config import ServeConfig
    from pipeline.serve.model import ServedModel

ROUTES: dict[str, str] = {
    "model-card": "pipeline.serve.routes.model_card:router",  # GET /v1/model-card
    "drift-reference": "pipeline.serve.routes.drift_reference:router",  # GET /v1/drift-reference
}


@dataclass(frozen=True)
class RouteContext:
    """What a route may use of the running server."""

    config: ServeConfig
    model: ServedModel
    classify: Callable[[list[bytes], int], Awaitable[list[list[dict[str, Any]]]]]
    """Image files (encoded bytes), top k -> per file its k best classes ({"class_id", "name", "probability"}),
    through /v1/predict's decoding, limits and batcher (a client mistake raises an HTTPException, 4xx)."""


class Route(Protocol):
    def __call__(self, ctx: RouteContext) -> APIRouter: ...


def routers(ctx: RouteContext) -> list[APIRouter]:
    """Every router of the table, in its order."""
    return [pkgutil.resolve_name(target)(ctx) for target in ROUTES.values()]


def errors_doc(*codes: int, **described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives: every one is JSON {"error": "..."}; `described`
    (e.g. e404="...") overrides the usual description of a code."""
    what = {
        400: "bad input (undecodable image, wrong shape, dtype or count, a box outside the image)",
        404: "unknown model name",
        408: "request headers or body not received in time",
        413: "body, image or request pixels over the limits",
        415: "unsupported content type or image format",
        422: "request does not match the schema",
        431: "request headers too large",
        503: "queue full or shutting down (Retry-After)",
        504: "inference took longer than serve.request_timeout_s",
    } | {int(k[1:]): v for k, v in described.items()}
    schema = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
    return {code: {"description": what[code], "content": {"application/json": {"schema": schema}}} for code in codes}
