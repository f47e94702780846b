"""The ASGI app: Open Inference Protocol v2, /v1/predict for people, Prometheus /metrics, OpenAPI docs.

`create_app` assembles it: the one inference path (inference.py) behind FastAPI's routes, the request rules
(auth.py, guard.py) applied by the middleware stack (access.RequestContext, metrics.Observe, guard.BodyLimit) to every
request and, on the inference routes, inline by HotPath (hotpath.py), which it returns in front of the app. Every
client mistake is a 4xx with a JSON body {"error": "..."} (refusal.py); inference runs off the event loop in the
dynamic batcher; the queue is bounded (503 + Retry-After) and each request has a timeout (504).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from pipeline.config import ServeConfig
from pipeline.images.preprocess import Box
from pipeline.serve.access import RequestContext, flush_access_log
from pipeline.serve.auth import BearerAuth
from pipeline.serve.guard import BodyLimit, Guard
from pipeline.serve.hotpath import HotPath
from pipeline.serve.inference import Inference
from pipeline.serve.metrics import Observe
from pipeline.serve.model import ServedModel
from pipeline.serve.protocol import BINARY_HEADER, InferRequest, PredictRequest
from pipeline.serve.refusal import answer_refusals_as_json
from pipeline.serve.routes import RouteContext, errors_doc, routers

CLIENT_ERRORS = (400, 408, 413, 415, 422, 431, 503, 504)


def _lifespan(core: Inference, auth: BearerAuth) -> Any:
    config = core.config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        core.batcher.start()
        # Warm up (first calls allocate, compile or pick kernels) before saying ready.
        size = core.model.image_size
        await core.batcher.infer(np.zeros((1, 3, size, size), dtype=np.float32))
        grpc_server = None
        if config.grpc_port:  # OIP v2 over gRPC in the same process and event loop: one batcher, one model
            from pipeline.serve.grpc_server import OipCore, start_grpc

            grpc_server = await start_grpc(
                OipCore(
                    config=config,
                    version=core.model.version,
                    ready=lambda: core.ready,
                    live=lambda: core.batcher.alive,
                    check_model=core.check_model,
                    metadata=core.model_metadata,
                    infer=core.infer_outputs,
                    auth=auth,
                    metrics=core.metrics,
                )
            )
        core.ready = True
        yield
        core.ready = False
        if grpc_server is not None:  # refuse new calls, let those in flight finish, as HTTP does
            await grpc_server.stop(config.drain_timeout_s)
        await core.batcher.drain(config.drain_timeout_s)
        if core.sampler is not None:
            await asyncio.to_thread(core.sampler.close)
        flush_access_log()

    return lifespan


class Schemas:
    """Request bodies' JSON schemas, their nested definitions collected as OpenAPI components."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def ref(self, model_class: type[InferRequest] | type[PredictRequest]) -> dict[str, Any]:
        schema = model_class.model_json_schema(ref_template="#/components/schemas/{model}")
        self.components.update(schema.pop("$defs", {}))
        self.components[model_class.__name__] = schema
        return {"$ref": f"#/components/schemas/{model_class.__name__}"}


def _oip_server_routes(app: FastAPI, core: Inference) -> None:
    """Open Inference Protocol v2's health and server metadata (open: no token)."""

    @app.get("/v2/health/live", tags=["v2"])
    async def live() -> JSONResponse:
        alive = core.batcher.alive or not core.ready  # before startup finishes the worker is not running yet
        return JSONResponse({"live": alive}, status_code=200 if alive else 503)

    @app.get("/v2/health/ready", tags=["v2"])
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": core.ready}, status_code=200 if core.ready else 503)

    @app.get("/v2", tags=["v2"])
    async def server_metadata() -> dict[str, Any]:
        name = core.config.model_name
        return {"name": f"{name}-server", "version": core.model.version, "extensions": ["binary_tensor_data"]}


def _oip_routes(app: FastAPI, core: Inference, schemas: Schemas) -> None:
    """Open Inference Protocol v2 (KServe, Triton, MLServer clients): the model's metadata, readiness and inference."""

    @app.get(
        "/v2/models/{name}", tags=["v2"], responses=errors_doc(404, e404="no model card describes the served variant")
    )
    async def model_metadata(name: str) -> dict[str, Any]:
        core.check_model(name)
        return core.model_metadata()

    @app.get("/v2/models/{name}/ready", tags=["v2"])
    async def model_ready(name: str) -> JSONResponse:
        core.check_model(name)
        return JSONResponse({"name": name, "ready": core.ready}, status_code=200 if core.ready else 503)

    async def infer_response(name: str, version: str | None, request: Request) -> Response:
        """The routes' form of infer_answer (HotPath answers these POSTs itself; the routes give the schema)."""
        body, kind, extra = await core.infer_answer(
            name, version, await request.body(), request.headers.get(BINARY_HEADER), request.state.request_id
        )
        return Response(body, headers={k.decode(): v.decode() for k, v in extra}, media_type=kind.decode())

    infer_schema = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schemas.ref(InferRequest)}}}
    }

    @app.post(
        "/v2/models/{name}/infer", tags=["v2"], openapi_extra=infer_schema, responses=errors_doc(404, *CLIENT_ERRORS)
    )
    async def infer(name: str, request: Request) -> Response:
        return await infer_response(name, None, request)

    # The same three for an explicit version: this server's only one (model_version in every answer).
    @app.get("/v2/models/{name}/versions/{version}", tags=["v2"], responses=errors_doc(404))
    async def version_metadata(name: str, version: str) -> dict[str, Any]:
        core.check_model(name, version)
        return await model_metadata(name)

    @app.get("/v2/models/{name}/versions/{version}/ready", tags=["v2"], responses=errors_doc(404))
    async def version_ready(name: str, version: str) -> JSONResponse:
        core.check_model(name, version)
        return await model_ready(name)

    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        tags=["v2"],
        openapi_extra=infer_schema,
        responses=errors_doc(404, *CLIENT_ERRORS),
    )
    async def version_infer(name: str, version: str, request: Request) -> Response:
        return await infer_response(name, version, request)


def _v1_routes(app: FastAPI, core: Inference, schemas: Schemas) -> None:
    """/v1: images in, class names out."""
    multipart = {
        "type": "object",
        "properties": {"files": {"type": "array", "items": {"type": "string", "format": "binary"}}},
    }
    content = {
        "application/json": {"schema": schemas.ref(PredictRequest)},
        "multipart/form-data": {"schema": multipart},
    }

    @app.post(
        "/v1/predict",
        tags=["v1"],
        openapi_extra={"requestBody": {"required": True, "content": content}},
        response_model=dict[str, Any],
        responses=errors_doc(*CLIENT_ERRORS),
    )
    async def predict(request: Request) -> Response:
        quick = await core.predict_answer(request.headers.get("content-type", ""), await request.body())
        if quick is not None:
            return Response(quick[0], media_type="application/json")
        # a multipart body the fast splitter does not take: python-multipart (the body is cached)
        try:
            form = await request.form(max_files=core.config.max_images_per_request, max_fields=16)
        except HTTPException:
            raise
        except Exception as exc:  # malformed multipart bodies surface as parser errors
            raise HTTPException(400, f"malformed multipart body: {exc}") from None
        uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if not uploads:
            raise HTTPException(400, "no image files in the multipart body (use a file field, e.g. 'files')")
        items: list[tuple[bytes, Box | None]] = [(await upload.read(), None) for upload in uploads]
        return Response((await core.answer_images(items, core.config.top_k))[0], media_type="application/json")


def _openapi(app: FastAPI, schemas: Schemas, model_name: str) -> Any:
    """The OpenAPI document with the request bodies' components and `name` limited to the served model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(schemas.components)
            for operation in (op for item in schema["paths"].values() for op in item.values()):
                for parameter in operation.get("parameters", []):
                    if parameter["name"] == "name" and parameter["in"] == "path":
                        parameter["schema"] = {"type": "string", "enum": [model_name]}
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_app(config: ServeConfig, model: ServedModel) -> HotPath:
    core = Inference(config, model)
    # One set of request rules for every way in: HotPath applies it to the inference routes, the middleware stack
    # below to every other request, the gRPC server (started by the lifespan) checks the same token.
    guard = Guard(BearerAuth.from_env(config.auth_token_env), config.max_body_bytes, config.body_timeout_s)
    app = FastAPI(
        title=config.title or f"{config.model_name} image classifier",
        version=model.version,
        description=(
            "Open Inference Protocol v2 (KServe/Triton/MLServer REST, incl. Triton's binary tensor "
            "extension) under /v2, and a simple image API under /v1."
        ),
        lifespan=_lifespan(core, guard.auth),
    )
    app.add_middleware(BodyLimit, guard=guard)
    app.add_middleware(Observe, metrics=core.metrics)  # sees every response, 413s included
    # outermost: every answer (401, 413, 503 included) carries the request id and gets its log line
    app.add_middleware(RequestContext, auth=guard.auth, access_log=config.access_log)
    answer_refusals_as_json(app)
    schemas = Schemas()
    _oip_server_routes(app, core)
    _oip_routes(app, core, schemas)
    _v1_routes(app, core, schemas)
    # the routes of pipeline/serve/routes (the model card, the drift reference, yours)
    for router in routers(RouteContext(config, model, core.classify)):
        app.include_router(router)

    @app.get("/metrics", tags=["ops"])
    async def prometheus() -> Response:
        return Response(core.prometheus_text(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = _openapi(app, schemas, config.model_name)  # type: ignore[method-assign]
    # Outside the FastAPI app itself, so that its own layers (Starlette's error middleware wrapping every send,
    # FastAPI's telemetry and body-limit middlewares) stay off the inference routes: HotPath answers every error
    # of its own. Everything else, the lifespan included, goes down to the app as before.
    return HotPath(
        app,
        predict=core.predict_answer,
        infer=core.infer_answer,
        metrics=core.metrics,
        guard=guard,
        access_log=config.access_log,
    )
