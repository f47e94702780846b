"""The ASGI app: Open Inference Protocol v2, /v1/predict for people, Prometheus /metrics, OpenAPI docs.

Every client mistake is a 4xx with a JSON body {"error": "..."}; inference runs off the event loop in
the dynamic batcher; the queue is bounded (503 + Retry-After) and each request has a timeout (504).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline import drift
from pipeline.config import ServeConfig
from pipeline.preprocess import Box
from pipeline.serve.access import UNAUTHORIZED_BODY, RequestContext, flush_access_log, log_request, request_id
from pipeline.serve.batcher import BatchStats, Draining, DynamicBatcher, QueueFull
from pipeline.serve.model import ServedModel
from pipeline.serve.protocol import (
    BINARY_HEADER,
    BadRequest,
    InferRequest,
    PredictRequest,
    decode_opened,
    encode_outputs,
    json_bytes,
    multipart_files,
    parse_infer_body,
    parse_predict_json,
    peek_images,
    pixel_count,
    tensor_images,
    top_classes,
)
from pipeline.serve.routes import RouteContext, errors_doc, routers

OUTPUT_NAMES = ("probabilities", "class_id")
# Requests with at most this many image pixels in all are decoded on the event loop (about 0.2 ms);
# larger ones in a worker thread.
INLINE_DECODE_PIXELS = 256 * 256


CLIENT_ERRORS = (400, 408, 413, 415, 422, 431, 503, 504)


def body_timeout_message(timeout_s: float) -> str:
    return f"request body not received within {timeout_s} s (serve.body_timeout_s)"


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes (serve.max_body_bytes)")


class BodyLimit:
    """Refuse bodies over the limit: by Content-Length up front, and while streaming otherwise; and bodies
    that do not arrive within `timeout_s` (a slow sender holds a connection and a worker's buffer: 408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                response = JSONResponse({"error": BodyTooLarge(self.max_bytes).detail}, status_code=413)
                await response(scope, receive, send)
                return
        seen = 0
        complete = False
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def limited() -> Message:
            nonlocal seen, complete
            if complete:  # after the body only a disconnect can come: no deadline on waiting for it
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(  # and close: the rest of that body must not be read as the next request
                    408,
                    body_timeout_message(self.timeout_s),
                    {"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


class Metrics:
    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        self.requests = Counter(
            "inference_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "inference_request_latency_seconds",
            "Request latency by route",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        buckets = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max_batch_size})
        self.batch_size = Histogram(
            "inference_batch_size",
            "Images per model call",
            buckets=[b for b in buckets if b <= max_batch_size],
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "inference_batch_seconds",
            "Model time per batch",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=self.registry,
        )
        # With several workers (PROMETHEUS_MULTIPROC_DIR set) a gauge is the sum over the living workers.
        self.queue = Gauge(
            "inference_queue_images",
            "Images waiting for the model",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.in_flight = Gauge(
            "inference_in_flight_requests",
            "Requests being handled",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.images = Counter("inference_images", "Images classified", registry=self.registry)
        self.errors = Counter("inference_errors", "Failed requests by kind", ["kind"], registry=self.registry)

    def record(self, route: str, status: int, seconds: float) -> None:
        """One finished request (HTTP or gRPC): its count, latency and, for a status >= 400, its error."""
        series = self._children.get((route, status))
        if series is None:  # label lookups cached: this runs on every request
            errors = self.errors.labels(str(status)) if status >= 400 else None
            series = (self.requests.labels(route, str(status)), self.latency.labels(route), errors)
            self._children[(route, status)] = series
        requests, latency, errors = series
        requests.inc()
        latency.observe(seconds)
        if errors is not None:
            errors.inc()

    def batch_stats(self) -> BatchStats:
        def on_batch(size: int, seconds: float) -> None:
            self.batch_size.observe(size)
            self.batch_seconds.observe(seconds)

        return BatchStats(on_batch=on_batch, on_queue=self.queue.set)


def drift_signals(model: ServedModel, registry: CollectorRegistry) -> drift.SignalCounts:
    """Counted in plain lists, exposed by a custom collector (cheap); with several workers through
    prometheus_client's own multiprocess metrics instead, which it sums over the workers' files."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return drift.PrometheusSignals(model.classes, model.version, registry)
    counts = drift.SignalCounts(list(model.classes))
    registry.register(drift.Collector(counts, model.version))
    return counts


class Observe:
    """Prometheus request metrics as a plain ASGI middleware (Starlette's BaseHTTPMiddleware would add a
    task and a memory stream to every request)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before any response reaches uvicorn as a 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight = self.metrics.in_flight
        in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            in_flight.dec()
            route = scope.get("route")
            self.metrics.record(getattr(route, "path", "unmatched"), status, time.perf_counter() - started)


Answer = tuple[bytes, bytes, list[tuple[bytes, bytes]]]
"""A success: its body, content type and any further headers."""
JSON_TYPE = b"application/json"
_INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self.status, self.message, self.headers = status, message, headers or {}


class HotPath:
    """The inference routes (POST /v1/predict, /v2/models/{name}[/versions/{version}]/infer) as one flat ASGI callable,
    outermost (it wraps the FastAPI app): request id, auth, body limit and deadline, metrics and the access log inline,
    the answer sent as two raw ASGI messages. The middleware stack below (RequestContext, Observe, BodyLimit) and
    FastAPI's router and Request/Response objects were a quarter of a request's CPU (the profile in docs/serving.md).
    Each protection gives the answer the stack gives: 401 (compared in constant time), 413 by Content-Length and while
    streaming, 408 + close for a slow body (one timer for the whole body), 503 + Retry-After, 504, JSON errors, the
    route's template as the metrics label. A multipart body the fast splitter does not take (`protocol.multipart_files`
    None) and every other method and path go down the stack as before: the body already read is replayed, under the same
    request id."""

    def __init__(
        self,
        app: ASGIApp,
        predict: Any,
        infer: Any,
        metrics: Metrics,
        token: str | None,
        access_log: bool,
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.predict = predict  # async (content type, body) -> Answer | None (None: the general parser's body)
        self.infer = infer  # async (name, version | None, body, binary header | None, request id) -> Answer
        self.metrics = metrics
        self.token = f"Bearer {token}".encode() if token else None
        self.access_log = access_log
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.too_large = BodyTooLarge(max_body_bytes).detail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/v1/predict":
            label, match = "/v1/predict", None
        else:
            match = _INFER_PATH.fullmatch(path)
            if match is None:
                await self.app(scope, receive, send)
                return
            label = (
                "/v2/models/{name}/infer" if match["version"] is None else "/v2/models/{name}/versions/{version}/infer"
            )
        started = time.perf_counter()
        given = authorization = content_type = binary = b""
        length = -1
        for key, value in scope["headers"]:
            if key == b"content-type":
                content_type = value
            elif key == b"content-length":
                length = int(value) if value.isdigit() else -1
            elif key == b"x-request-id":
                given = value
            elif key == b"authorization":
                authorization = value
            elif key == b"inference-header-content-length":
                binary = value
        rid = request_id(given.decode("latin-1"))
        rid_header = (b"x-request-id", rid.encode())
        status, sent, body = 500, 0, b""
        in_flight = self.metrics.in_flight
        in_flight.inc()
        try:
            try:
                if self.token is not None and not hmac.compare_digest(authorization, self.token):
                    raise _Refused(401, "", {"WWW-Authenticate": 'Bearer realm="inference"'})
                if length > self.max_body_bytes:
                    raise _Refused(413, self.too_large)
                body = await self.read_body(receive)
                if match is None:
                    answer = await self.predict(content_type.decode("latin-1"), body)
                    if answer is None:  # the general multipart parser's case: down the stack, counted there
                        status = 0
                else:
                    answer = await self.infer(
                        match["name"], match["version"], body, binary.decode("latin-1") or None, rid
                    )
                if answer is not None:
                    content, kind, extra = answer
                    status = 200
                    headers = [(b"content-type", kind), (b"content-length", b"%d" % len(content)), rid_header, *extra]
            except (HTTPException, _Refused) as exc:
                if isinstance(exc, HTTPException):
                    status, message, more = exc.status_code, str(exc.detail), exc.headers or {}
                else:
                    status, message, more = exc.status, exc.message, exc.headers
                content = UNAUTHORIZED_BODY if status == 401 else json_bytes({"error": message})
                headers = [(b"content-type", JSON_TYPE), (b"content-length", b"%d" % len(content)), rid_header]
                headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in more.items()]
            except _ClientGone:
                status = 499  # nginx's "client closed request": nothing to answer
                return
            except Exception as exc:  # as the app's handler: never a bare 500 page
                status, content = 500, json_bytes({"error": f"internal error: {type(exc).__name__}"})
                headers = [(b"content-type", JSON_TYPE), (b"content-length", b"%d" % len(content)), rid_header]
            if status:
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": content})
                sent = len(content)
        finally:
            in_flight.dec()
            if status:
                seconds = time.perf_counter() - started
                self.metrics.record(label, status, seconds)
                if self.access_log:
                    client = scope.get("client")
                    where = f"{client[0]}:{client[1]}" if client else None
                    log_request(rid, "POST", path, status, seconds, where, sent)
        if not status:
            await self.app(_with_request_id(scope, rid), _replay(body, receive), send)

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body within serve.body_timeout_s (one timer) and serve.max_body_bytes."""
        chunks: list[bytes] = []
        seen = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        raise _ClientGone()
                    chunk = message.get("body", b"")
                    seen += len(chunk)
                    if seen > self.max_body_bytes:
                        raise _Refused(413, self.too_large)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:  # and close: the rest of that body must not be read as the next request
            raise _Refused(408, body_timeout_message(self.body_timeout_s), {"Connection": "close"}) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _ClientGone(Exception):
    pass


def _with_request_id(scope: Scope, rid: str) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
    return {**scope, "headers": [*headers, (b"x-request-id", rid.encode())]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, once; then the connection's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def flag(value: Any, where: str) -> bool:
    """An OIP boolean parameter: JSON true/false (absent = false); anything else, such as the string "false",
    is a client error rather than a truthy value."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPException(400, f"{where} must be true or false, got {value!r}")
    return value


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(config: ServeConfig, model: ServedModel) -> HotPath:
    metrics = Metrics(config.max_batch_size)
    signals = drift_signals(model, metrics.registry)
    sampler = None
    if config.sample_log.dir:
        from pipeline.serve.sample_log import SampleLog

        log_config = config.sample_log
        sampler = SampleLog(
            Path(log_config.dir), log_config.rate, log_config.below_confidence,
            log_config.max_mb / config.workers, model.version, list(model.classes),
        )  # fmt: skip
    batcher = DynamicBatcher(
        model.probabilities,
        config.max_batch_size,
        config.max_delay_ms / 1000.0,
        config.max_queue_images,
        metrics.batch_stats(),
    )
    state = {"ready": False}
    token = os.environ.get(config.auth_token_env) or None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        # Warm up (first calls allocate, compile or pick kernels) before saying ready.
        await batcher.infer(np.zeros((1, 3, model.image_size, model.image_size), dtype=np.float32))
        grpc_server = None
        if config.grpc_port:  # OIP v2 over gRPC in the same process and event loop: one batcher, one model
            from pipeline.serve.grpc_server import OipCore, start_grpc

            core = OipCore(
                config=config,
                version=model.version,
                ready=lambda: state["ready"],
                live=lambda: batcher.alive,
                check_model=check_model,
                metadata=model_metadata_payload,
                infer=infer_outputs,
                token=token,
                metrics=metrics,
            )
            grpc_server = await start_grpc(core)
        state["ready"] = True
        yield
        state["ready"] = False
        if grpc_server is not None:  # refuse new calls, let those in flight finish, as HTTP does
            await grpc_server.stop(config.drain_timeout_s)
        await batcher.drain(config.drain_timeout_s)
        if sampler is not None:
            await asyncio.to_thread(sampler.close)
        flush_access_log()

    app = FastAPI(
        title=config.title or f"{config.model_name} image classifier",
        version=model.version,
        description=(
            "Open Inference Protocol v2 (KServe/Triton/MLServer REST, incl. Triton's binary tensor "
            "extension) under /v2, and a simple image API under /v1."
        ),
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(Observe, metrics=metrics)  # sees every response, 413s included
    # outermost: every answer (401, 413, 503 included) carries the request id and gets its log line
    app.add_middleware(RequestContext, token=token, access_log=config.access_log)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return _error(422, f"{where}: {first['msg']}")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:  # never a bare 500 page
        return _error(500, f"internal error: {type(exc).__name__}")

    async def run_model(
        images: np.ndarray, sizes: list[tuple[int, int]] | None = None, files: list[bytes] | None = None
    ) -> np.ndarray:
        try:
            probabilities = await batcher.infer(images, config.request_timeout_s)
            metrics.images.inc(len(images))  # classified ones only: refused or timed-out requests do not count
            signals.add_outputs(probabilities)  # the drift signals (pipeline/drift.py) of answered images only
            signals.add_images(images)
            if sizes:
                signals.add_sizes(sizes)
                if sampler is not None and files:
                    sampler.offer(files, sizes, probabilities)
            return probabilities
        except QueueFull:
            raise HTTPException(503, "server busy: inference queue is full", {"Retry-After": "1"}) from None
        except Draining:
            raise HTTPException(503, "server is shutting down", {"Retry-After": "5"}) from None
        except TimeoutError:
            raise HTTPException(504, f"inference took longer than {config.request_timeout_s} s") from None

    def check_model(name: str, version: str | None = None) -> None:
        if name != config.model_name:
            raise HTTPException(404, f"unknown model {name!r}; this server serves {config.model_name!r}")
        if version is not None and version != model.version:
            raise HTTPException(404, f"unknown version {version!r} of {name!r}; this server serves {model.version!r}")

    async def decode(items: list[tuple[bytes, Box | None]]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The model's input and each file's (width, height)."""
        try:
            opened = peek_images(items, config.max_image_pixels)  # headers only: cheap
            sizes = [image.size for image, _ in opened]
            total = pixel_count(opened)
            if total > config.max_request_pixels:
                raise BadRequest(
                    f"the request's images hold {total} pixels together, more than {config.max_request_pixels}",
                    413,
                )
            if total <= INLINE_DECODE_PIXELS:  # small images: a thread hop costs more
                return decode_opened(opened, model.framing), sizes
            # larger ones are CPU work: keep it off the event loop
            return await asyncio.to_thread(decode_opened, opened, model.framing), sizes
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None

    # ---- Open Inference Protocol v2 -------------------------------------------------------------------
    @app.get("/v2/health/live", tags=["v2"])
    async def live() -> JSONResponse:
        alive = batcher.alive or not state["ready"]  # before startup finishes the worker is not running yet
        return JSONResponse({"live": alive}, status_code=200 if alive else 503)

    @app.get("/v2/health/ready", tags=["v2"])
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": state["ready"]}, status_code=200 if state["ready"] else 503)

    @app.get("/v2", tags=["v2"])
    async def server_metadata() -> dict[str, Any]:
        return {"name": f"{config.model_name}-server", "version": model.version, "extensions": ["binary_tensor_data"]}

    @app.get(
        "/v2/models/{name}", tags=["v2"], responses=errors_doc(404, e404="no model card describes the served variant")
    )
    async def model_metadata(name: str) -> dict[str, Any]:
        check_model(name)
        return model_metadata_payload()

    def model_metadata_payload() -> dict[str, Any]:
        s = model.image_size
        return {
            "name": config.model_name,
            "versions": [model.version],
            "platform": model.backend,
            "inputs": [{"name": "images", "datatype": "FP32", "shape": [-1, 3, s, s]}],
            "outputs": [
                {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(model.classes)]},
                {"name": "class_id", "datatype": "INT64", "shape": [-1]},
            ],
            "parameters": {
                "variant": model.variant,
                "input_range": [0.0, 1.0],
                "also_accepts": "a BYTES input [N] of encoded image files",
                # How a file becomes the FP32 input: clients that send tensors must frame images the same way.
                "framing": {
                    "crop_left_top_right_bottom": list(model.framing.crop),
                    "resize": s,
                    "resize_mode": model.framing.resize,
                    "interpolation": model.framing.interpolation,
                    "reduced_jpeg_decode": model.framing.reduced_jpeg_decode,
                    "roi_margin_with_box": model.framing.roi_margin,
                },
                "classes": model.classes,
            },
        }

    @app.get("/v2/models/{name}/ready", tags=["v2"])
    async def model_ready(name: str) -> JSONResponse:
        check_model(name)
        return JSONResponse({"name": name, "ready": state["ready"]}, status_code=200 if state["ready"] else 503)

    components: dict[str, Any] = {}

    def body_schema(model_class: type[InferRequest] | type[PredictRequest]) -> dict[str, Any]:
        """The model's JSON schema, its nested definitions published as OpenAPI components."""
        schema = model_class.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model_class.__name__] = schema
        return {"$ref": f"#/components/schemas/{model_class.__name__}"}

    infer_schema = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(InferRequest)}}}
    }

    @app.post(
        "/v2/models/{name}/infer", tags=["v2"], openapi_extra=infer_schema, responses=errors_doc(404, *CLIENT_ERRORS)
    )
    async def infer(name: str, request: Request) -> Response:
        return await infer_response(name, None, request)

    async def infer_response(name: str, version: str | None, request: Request) -> Response:
        """The routes' form of infer_answer (HotPath answers these POSTs itself; the routes give the schema)."""
        body, kind, extra = await infer_answer(
            name, version, await request.body(), request.headers.get(BINARY_HEADER), request.state.request_id
        )
        return Response(body, headers={k.decode(): v.decode() for k, v in extra}, media_type=kind.decode())

    async def infer_answer(name: str, version: str | None, body: bytes, binary_header: str | None, rid: str) -> Answer:
        """An OIP v2 REST infer request's answer: JSON, or with binary outputs Triton's binary extension."""
        check_model(name, version)
        try:
            parsed, binary = parse_infer_body(body, binary_header)
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None
        values = await infer_outputs(parsed, binary)
        binary_out = flag((parsed.parameters or {}).get("binary_data_output"), "parameters.binary_data_output") or any(
            flag((o.parameters or {}).get("binary_data"), f"outputs.{o.name}.parameters.binary_data")
            for o in parsed.outputs or []
        )
        described, chunks = encode_outputs(values, binary_out)
        payload: dict[str, Any] = {
            "model_name": config.model_name,
            "model_version": model.version,
            "outputs": described,
            "id": parsed.id if parsed.id is not None else rid,
        }
        header = json_bytes(payload)
        if not binary_out:
            return header, JSON_TYPE, []
        length = (b"inference-header-content-length", b"%d" % len(header))
        return header + chunks, b"application/octet-stream", [length]

    async def infer_outputs(parsed: InferRequest, binary: bytes) -> dict[str, np.ndarray]:
        """An OIP v2 request, parsed (REST or gRPC), to the requested outputs: the one inference path."""
        try:
            inputs = tensor_images(parsed, binary, model.image_size, config.max_images_per_request)
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if isinstance(inputs[0], np.ndarray):
            probabilities = await run_model(inputs[0])
        else:
            files = [data for data in inputs if isinstance(data, bytes)]
            images, sizes = await decode([(data, None) for data in files])
            probabilities = await run_model(images, sizes, files)
        wanted = [o.name for o in parsed.outputs] if parsed.outputs else list(OUTPUT_NAMES)
        unknown = [n for n in wanted if n not in OUTPUT_NAMES]
        if unknown:
            raise HTTPException(400, f"unknown output {unknown[0]!r}; available: {', '.join(OUTPUT_NAMES)}")
        values = {"probabilities": probabilities, "class_id": probabilities.argmax(axis=1).astype(np.int64)}
        return {n: values[n] for n in wanted}

    # The same three for an explicit version: this server's only one (model_version in every answer).
    @app.get("/v2/models/{name}/versions/{version}", tags=["v2"], responses=errors_doc(404))
    async def version_metadata(name: str, version: str) -> dict[str, Any]:
        check_model(name, version)
        return await model_metadata(name)

    @app.get("/v2/models/{name}/versions/{version}/ready", tags=["v2"], responses=errors_doc(404))
    async def version_ready(name: str, version: str) -> JSONResponse:
        check_model(name, version)
        return await model_ready(name)

    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        tags=["v2"],
        openapi_extra=infer_schema,
        responses=errors_doc(404, *CLIENT_ERRORS),
    )
    async def version_infer(name: str, version: str, request: Request) -> Response:
        return await infer_response(name, version, request)

    # ---- /v1: images in, sign names out -------------------------------------------------------------
    predict_schema = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": body_schema(PredictRequest)},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"files": {"type": "array", "items": {"type": "string", "format": "binary"}}},
                    }
                },
            },
        }
    }

    @app.post(
        "/v1/predict",
        tags=["v1"],
        openapi_extra=predict_schema,
        response_model=dict[str, Any],
        responses=errors_doc(*CLIENT_ERRORS),
    )
    async def predict(request: Request) -> Response:
        quick = await predict_answer(request.headers.get("content-type", ""), await request.body())
        if quick is not None:
            return Response(quick[0], media_type="application/json")
        # a multipart body the fast splitter does not take: python-multipart (the body is cached)
        try:
            form = await request.form(max_files=config.max_images_per_request, max_fields=16)
        except HTTPException:
            raise
        except Exception as exc:  # malformed multipart bodies surface as parser errors
            raise HTTPException(400, f"malformed multipart body: {exc}") from None
        uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if not uploads:
            raise HTTPException(400, "no image files in the multipart body (use a file field, e.g. 'files')")
        items: list[tuple[bytes, Box | None]] = [(await upload.read(), None) for upload in uploads]
        return Response((await answer_images(items, config.top_k))[0], media_type="application/json")

    async def predict_answer(content_type_header: str, body: bytes) -> Answer | None:
        """/v1/predict's answer; None for a multipart body that needs the general parser (the route's job)."""
        content_type = content_type_header.split(";")[0].strip().lower()
        max_images = config.max_images_per_request
        if content_type == "multipart/form-data":
            files = multipart_files(body, content_type_header, max_images)
            if files is None:
                return None
            return await answer_images([(data, None) for data in files], config.top_k)
        if content_type == "application/json":
            try:
                items, requested_k = parse_predict_json(body, max_images)
            except BadRequest as exc:
                raise HTTPException(exc.status, str(exc)) from None
            return await answer_images(items, requested_k or config.top_k)
        raise HTTPException(
            415, f"unsupported content type {content_type or '(none)'!r}: use multipart/form-data or application/json"
        )

    # The answer's fixed part, made once.
    predict_prefix = (
        json_bytes({"model": {"name": config.model_name, "version": model.version, "variant": model.variant}})[:-1]
        + b',"predictions":'
    )

    async def answer_images(items: list[tuple[bytes, Box | None]], top_k: int) -> Answer:
        images, sizes = await decode(items)
        probabilities = await run_model(images, sizes, [data for data, _ in items])
        predictions = [{"top_k": best} for best in top_classes(probabilities, model.classes, top_k)]
        return predict_prefix + json_bytes(predictions) + b"}", JSON_TYPE, []

    async def classify(files: list[bytes], top_k: int) -> list[list[dict[str, Any]]]:
        images, sizes = await decode([(data, None) for data in files])
        return top_classes(await run_model(images, sizes, files), model.classes, top_k)

    # ---- the routes of pipeline/serve/routes (the model card, the drift reference, yours) ---------------
    for router in routers(RouteContext(config, model, classify)):
        app.include_router(router)

    @app.get("/metrics", tags=["ops"])
    async def prometheus() -> Response:
        metrics.queue.set(batcher.queued_images)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # several workers: all of them, from their shared files
            from prometheus_client import multiprocess

            combined = CollectorRegistry()
            multiprocess.MultiProcessCollector(combined)
            return Response(generate_latest(combined), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            for operation in (op for item in schema["paths"].values() for op in item.values()):
                for parameter in operation.get("parameters", []):
                    if parameter["name"] == "name" and parameter["in"] == "path":
                        parameter["schema"] = {"type": "string", "enum": [config.model_name]}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # Outside the FastAPI app itself, so that its own layers (Starlette's error middleware wrapping every send,
    # FastAPI's telemetry and body-limit middlewares) stay off the inference routes: HotPath answers every error
    # of its own. Everything else, the lifespan included, goes down to the app as before.
    return HotPath(
        app,
        predict=predict_answer,
        infer=infer_answer,
        metrics=metrics,
        token=token,
        access_log=config.access_log,
        max_body_bytes=config.max_body_bytes,
        body_timeout_s=config.body_timeout_s,
    )
