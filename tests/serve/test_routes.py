"""A server route is one file and one line in ROUTES: in a copy of the package, a toy route (POST /v1/top1: one image
in the body, its best class out) answers through the server's decoding and model, and the server's protections
and metrics apply to it as to every route."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from pipeline.serve.routes import ROUTES
from tests.helpers.package_copy import package_with
from tests.helpers.server import start_server

TOY_ROUTE = '''
"""POST /v1/top1: one encoded image as the body, its best class out."""

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException

from pipeline.serve.routes import RouteContext, errors_doc


def router(ctx: RouteContext) -> APIRouter:
    routes = APIRouter(tags=["v1"])

    @routes.post("/v1/top1", responses=errors_doc(400, 413, 415))
    async def top1(request: Request) -> dict[str, object]:
        body = await request.body()
        if not body:
            raise HTTPException(400, "send one image file as the request body")
        (best,) = await ctx.classify([body], 1)
        return {"name": best[0]["name"], "probability": best[0]["probability"]}

    return routes
'''
TABLE_LINE = '    "top1": "pipeline.serve.routes.top1:router",  # POST /v1/top1\n'


def test_the_table_serves_the_card_and_the_drift_reference() -> None:
    assert list(ROUTES) == ["model-card", "drift-reference"]


def test_a_new_route_is_one_file_and_one_line(models_dir: Path, tmp_path: Path) -> None:
    from pipeline.serve.client import encode

    code = package_with(tmp_path / "code", "serve/routes/top1.py", TOY_ROUTE, "serve/routes/__init__.py",
                        '    "drift-reference":', TABLE_LINE)  # fmt: skip

    server = start_server(models_dir, tmp_path, {"max_body_bytes": 64 * 1024}, env={"PYTHONPATH": str(code)})
    try:
        image = encode(np.ascontiguousarray(server.test_images[0]))
        answer = httpx.post(f"{server.url}/v1/top1", content=image, timeout=30)
        assert answer.status_code == 200, answer.text
        predicted = httpx.post(f"{server.url}/v1/predict", files={"files": ("x.png", image)}, timeout=30).json()
        assert answer.json()["name"] == predicted["predictions"][0]["top_k"][0]["name"]  # the same model's answer
        for body, status in ((b"", 400), (b"not an image", 400), (b"\0" * (128 * 1024), 413)):
            refused = httpx.post(f"{server.url}/v1/top1", content=body, timeout=30)
            assert refused.status_code == status and "error" in refused.json(), (status, refused.text)
        assert "/v1/top1" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
        assert 'route="/v1/top1"' in httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
