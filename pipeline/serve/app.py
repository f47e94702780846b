"""The ASGI app: Open Inference Protocol v2, /v1/predict for people, Prometheus /metrics, OpenAPI docs.

Every client mistake is a 4xx with a JSON body {"error": "..."}; inference runs off the event loop in
the dynamic batcher; the queue is bounded (503 + Retry-After) and each request has a timeout (504).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
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

from pipeline.config import ServeConfig
from pipeline.images.preprocess import Box
from pipeline.monitoring import drift
from pipeline.serve.access import UNAUTHORIZED_BODY, RequestContext, flush_access_log, log_request, request_id
from pipeline.serve.batcher import BatchStats, Draining, DynamicBatcher, QueueFull
from pipeline.serve.guard import BodyLimit, ClientGone, Guard
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


def _inference_route(scope: Scope) -> tuple[str, re.Match[str] | None] | None:
    """The metrics label of an inference POST and its path's match (None for /v1/predict); None for anything else."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path = scope["path"]
    if path == "/v1/predict":
        return "/v1/predict", None
    match = _INFER_PATH.fullmatch(path)
    if match is None:
        return None
    return (
        "/v2/models/{name}/infer" if match["version"] is None else "/v2/models/{name}/versions/{version}/infer"
    ), match


@dataclass(slots=True)  # not frozen: built once per inference request, and frozen init costs a setattr per field
class _RequestHeaders:
    """The request headers HotPath reads, in one pass."""

    content_type: bytes = b""
    length: int = -1
    request_id: bytes = b""
    authorization: bytes = b""
    binary: bytes = b""

    @classmethod
    def of(cls, raw: list[tuple[bytes, bytes]]) -> _RequestHeaders:
        found: dict[str, Any] = {}
        for key, value in raw:
            name = _HEADER_FIELDS.get(key)
            if name is not None:
                found[name] = value
        if "length" in found:
            found["length"] = int(found["length"]) if found["length"].isdigit() else -1
        return cls(**found)


_HEADER_FIELDS = {
    b"content-type": "content_type",
    b"content-length": "length",
    b"x-request-id": "request_id",
    b"authorization": "authorization",
    b"inference-header-content-length": "binary",
}


def _refusal(
    exc: HTTPException | _Refused, rid_header: tuple[bytes, bytes]
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """A refusal's status, JSON body and headers, as the app's exception handlers answer it."""
    if isinstance(exc, HTTPException):
        status, message, more = exc.status_code, str(exc.detail), exc.headers or {}
    else:
        status, message, more = exc.status, exc.message, exc.headers
    content = UNAUTHORIZED_BODY if status == 401 else json_bytes({"error": message})
    headers = [(b"content-type", JSON_TYPE), (b"content-length", b"%d" % len(content)), rid_header]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in more.items()]
    return status, content, headers


class HotPath:
    """The inference routes (POST /v1/predict, /v2/models/{name}[/versions/{version}]/infer) as one flat ASGI callable,
    outermost (it wraps the FastAPI app): request id, the guard (token, body size and deadline: guard.py, the same
    checks the middleware stack applies to every other request), metrics and the access log inline, the answer sent as
    two raw ASGI messages. The middleware stack below (RequestContext, Observe, BodyLimit) and FastAPI's router and
    Request/Response objects were a quarter of a request's CPU (the profile in docs/serving.md). Each refusal is the
    answer the stack gives: 401, 413 by Content-Length and while streaming, 408 + close for a slow body, 503 +
    Retry-After, 504, JSON errors, the route's template as the metrics label. A multipart body the fast splitter does
    not take (`protocol.multipart_files` None) and every other method and path go down the stack as before: the body
    already read is replayed, under the same request id."""

    def __init__(
        self, app: ASGIApp, predict: Any, infer: Any, metrics: Metrics, guard: Guard, access_log: bool
    ) -> None:
        self.app = app
        self.predict = predict  # async (content type, body) -> Answer | None (None: the general parser's body)
        self.infer = infer  # async (name, version | None, body, binary header | None, request id) -> Answer
        self.metrics = metrics
        self.guard = guard
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _inference_route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        label, match = route
        started = time.perf_counter()
        headers = _RequestHeaders.of(scope["headers"])
        rid = request_id(headers.request_id.decode("latin-1"))
        rid_header = (b"x-request-id", rid.encode())
        status, sent, body = 500, 0, b""
        in_flight = self.metrics.in_flight
        in_flight.inc()
        try:
            try:
                body, answer = await self.answer(match, headers, rid, receive)
                if answer is None:  # the general multipart parser's case: down the stack, counted there
                    status = 0
                else:
                    content, kind, extra = answer
                    status = 200
                    response = [(b"content-type", kind), (b"content-length", b"%d" % len(content)), rid_header, *extra]
            except (HTTPException, _Refused) as exc:
                status, content, response = _refusal(exc, rid_header)
            except ClientGone:
                status = 499  # nginx's "client closed request": nothing to answer
                return
            except Exception as exc:  # as the app's handler: never a bare 500 page
                status, content = 500, json_bytes({"error": f"internal error: {type(exc).__name__}"})
                response = [(b"content-type", JSON_TYPE), (b"content-length", b"%d" % len(content)), rid_header]
            if status:
                await send({"type": "http.response.start", "status": status, "headers": response})
                await send({"type": "http.response.body", "body": content})
                sent = len(content)
        finally:
            in_flight.dec()
            if status:
                self.account(scope, label, rid, status, time.perf_counter() - started, sent)
        if not status:
            await self.app(_with_request_id(scope, rid), _replay(body, receive), send)

    async def answer(
        self, match: re.Match[str] | None, headers: _RequestHeaders, rid: str, receive: Receive
    ) -> tuple[bytes, Answer | None]:
        """The body read and its answer, or a refusal raised (_Refused, HTTPException)."""
        if not self.guard.authorized(headers.authorization):
            raise _Refused(401, "", {"WWW-Authenticate": 'Bearer realm="inference"'})
        self.guard.check_length(headers.length)
        body = await self.guard.read_body(receive)
        if match is None:
            return body, await self.predict(headers.content_type.decode("latin-1"), body)
        binary = headers.binary.decode("latin-1") or None
        return body, await self.infer(match["name"], match["version"], body, binary, rid)

    def account(self, scope: Scope, label: str, rid: str, status: int, seconds: float, sent: int) -> None:
        """A finished request's metrics and access-log line."""
        self.metrics.record(label, status, seconds)
        if self.access_log:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else None
            log_request(rid, "POST", scope["path"], status, seconds, where, sent)


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


class Inference:
    """The one inference path every route and the gRPC server share: the model behind the dynamic batcher, its
    Prometheus metrics and drift signals, the optional sample log, and the answers' formats."""

    def __init__(self, config: ServeConfig, model: ServedModel) -> None:
        self.config, self.model = config, model
        self.metrics = Metrics(config.max_batch_size)
        self.signals = drift_signals(model, self.metrics.registry)
        self.sampler = None
        if config.sample_log.dir:
            from pipeline.serve.sample_log import SampleLog

            log_config = config.sample_log
            self.sampler = SampleLog(
                Path(log_config.dir), log_config.rate, log_config.below_confidence,
                log_config.max_mb / config.workers, model.version, list(model.classes),
            )  # fmt: skip
        self.batcher = DynamicBatcher(
            model.probabilities,
            config.max_batch_size,
            config.max_delay_ms / 1000.0,
            config.max_queue_images,
            self.metrics.batch_stats(),
        )
        self.ready = False
        self.token = os.environ.get(config.auth_token_env) or None
        # /v1/predict's answer begins the same way every time: made once
        self.predict_prefix = (
            json_bytes({"model": {"name": config.model_name, "version": model.version, "variant": model.variant}})[:-1]
            + b',"predictions":'
        )

    async def run_model(
        self, images: np.ndarray, sizes: list[tuple[int, int]] | None = None, files: list[bytes] | None = None
    ) -> np.ndarray:
        try:
            probabilities = await self.batcher.infer(images, self.config.request_timeout_s)
        except QueueFull:
            raise HTTPException(503, "server busy: inference queue is full", {"Retry-After": "1"}) from None
        except Draining:
            raise HTTPException(503, "server is shutting down", {"Retry-After": "5"}) from None
        except TimeoutError:
            raise HTTPException(504, f"inference took longer than {self.config.request_timeout_s} s") from None
        self.metrics.images.inc(len(images))  # classified ones only: refused or timed-out requests do not count
        self.signals.add_outputs(
            probabilities
        )  # the drift signals (pipeline/monitoring/drift.py) of answered images only
        self.signals.add_images(images)
        if sizes:
            self.signals.add_sizes(sizes)
            if self.sampler is not None and files:
                self.sampler.offer(files, sizes, probabilities)
        return probabilities

    def check_model(self, name: str, version: str | None = None) -> None:
        served = self.config.model_name
        if name != served:
            raise HTTPException(404, f"unknown model {name!r}; this server serves {served!r}")
        if version is not None and version != self.model.version:
            raise HTTPException(
                404, f"unknown version {version!r} of {name!r}; this server serves {self.model.version!r}"
            )

    async def decode(self, items: list[tuple[bytes, Box | None]]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The model's input and each file's (width, height)."""
        config, framing = self.config, self.model.framing
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
                return decode_opened(opened, framing), sizes
            # larger ones are CPU work: keep it off the event loop
            return await asyncio.to_thread(decode_opened, opened, framing), sizes
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None

    def model_metadata(self) -> dict[str, Any]:
        model, s = self.model, self.model.image_size
        return {
            "name": self.config.model_name,
            "versions": [model.version],
            "platform": model.backend,
            "inputs": [{"name": "images", "datatype": "FP32", "shape": [-1, 3, s, s]}],
            "outputs": [
                {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(model.classes)]},
                {"name": "class_id", "datatype": "INT64", "shape": [-1]},
            ],
            "parameters": {
                "variant": model.variant,
                **({"registry": model.registry.as_dict()} if model.registry else {}),
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

    async def infer_answer(
        self, name: str, version: str | None, body: bytes, binary_header: str | None, rid: str
    ) -> Answer:
        """An OIP v2 REST infer request's answer: JSON, or with binary outputs Triton's binary extension."""
        self.check_model(name, version)
        try:
            parsed, binary = parse_infer_body(body, binary_header)
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None
        values = await self.infer_outputs(parsed, binary)
        binary_out = flag((parsed.parameters or {}).get("binary_data_output"), "parameters.binary_data_output") or any(
            flag((o.parameters or {}).get("binary_data"), f"outputs.{o.name}.parameters.binary_data")
            for o in parsed.outputs or []
        )
        described, chunks = encode_outputs(values, binary_out)
        payload: dict[str, Any] = {
            "model_name": self.config.model_name,
            "model_version": self.model.version,
            "outputs": described,
            "id": parsed.id if parsed.id is not None else rid,
        }
        header = json_bytes(payload)
        if not binary_out:
            return header, JSON_TYPE, []
        length = (b"inference-header-content-length", b"%d" % len(header))
        return header + chunks, b"application/octet-stream", [length]

    async def infer_outputs(self, parsed: InferRequest, binary: bytes) -> dict[str, np.ndarray]:
        """An OIP v2 request, parsed (REST or gRPC), to the requested outputs: the one inference path."""
        try:
            inputs = tensor_images(parsed, binary, self.model.image_size, self.config.max_images_per_request)
        except BadRequest as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if isinstance(inputs[0], np.ndarray):
            probabilities = await self.run_model(inputs[0])
        else:
            files = [data for data in inputs if isinstance(data, bytes)]
            images, sizes = await self.decode([(data, None) for data in files])
            probabilities = await self.run_model(images, sizes, files)
        wanted = [o.name for o in parsed.outputs] if parsed.outputs else list(OUTPUT_NAMES)
        unknown = [n for n in wanted if n not in OUTPUT_NAMES]
        if unknown:
            raise HTTPException(400, f"unknown output {unknown[0]!r}; available: {', '.join(OUTPUT_NAMES)}")
        values = {"probabilities": probabilities, "class_id": probabilities.argmax(axis=1).astype(np.int64)}
        return {n: values[n] for n in wanted}

    async def predict_answer(self, content_type_header: str, body: bytes) -> Answer | None:
        """/v1/predict's answer; None for a multipart body that needs the general parser (the route's job)."""
        content_type = content_type_header.split(";")[0].strip().lower()
        max_images, top_k = self.config.max_images_per_request, self.config.top_k
        if content_type == "multipart/form-data":
            files = multipart_files(body, content_type_header, max_images)
            if files is None:
                return None
            return await self.answer_images([(data, None) for data in files], top_k)
        if content_type == "application/json":
            try:
                items, requested_k = parse_predict_json(body, max_images)
            except BadRequest as exc:
                raise HTTPException(exc.status, str(exc)) from None
            return await self.answer_images(items, requested_k or top_k)
        raise HTTPException(
            415, f"unsupported content type {content_type or '(none)'!r}: use multipart/form-data or application/json"
        )

    async def answer_images(self, items: list[tuple[bytes, Box | None]], top_k: int) -> Answer:
        images, sizes = await self.decode(items)
        probabilities = await self.run_model(images, sizes, [data for data, _ in items])
        predictions = [{"top_k": best} for best in top_classes(probabilities, self.model.classes, top_k)]
        return self.predict_prefix + json_bytes(predictions) + b"}", JSON_TYPE, []

    async def classify(self, files: list[bytes], top_k: int) -> list[list[dict[str, Any]]]:
        images, sizes = await self.decode([(data, None) for data in files])
        return top_classes(await self.run_model(images, sizes, files), self.model.classes, top_k)

    def prometheus_text(self) -> bytes:
        self.metrics.queue.set(self.batcher.queued_images)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # several workers: all of them, from their shared files
            from prometheus_client import multiprocess

            combined = CollectorRegistry()
            multiprocess.MultiProcessCollector(combined)
            return generate_latest(combined)
        return generate_latest(self.metrics.registry)


def _lifespan(core: Inference) -> Any:
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
                    token=core.token,
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


def _answer_errors_as_json(app: FastAPI) -> None:
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


class Schemas:
    """Request bodies' JSON schemas, their nested definitions collected as OpenAPI components."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def ref(self, model_class: type[InferRequest] | type[PredictRequest]) -> dict[str, Any]:
        schema = model_class.model_json_schema(ref_template="#/components/schemas/{model}")
        self.components.update(schema.pop("$defs", {}))
        self.components[model_class.__name__] = schema
        return {"$ref": f"#/components/schemas/{model_class.__name__}"}


def _oip_routes(app: FastAPI, core: Inference, schemas: Schemas) -> None:
    """Open Inference Protocol v2 (KServe, Triton, MLServer clients)."""

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
    app = FastAPI(
        title=config.title or f"{config.model_name} image classifier",
        version=model.version,
        description=(
            "Open Inference Protocol v2 (KServe/Triton/MLServer REST, incl. Triton's binary tensor "
            "extension) under /v2, and a simple image API under /v1."
        ),
        lifespan=_lifespan(core),
    )
    # One guard, two layers: HotPath applies it to the inference routes, this stack to every other request.
    guard = Guard(core.token, config.max_body_bytes, config.body_timeout_s)
    app.add_middleware(BodyLimit, guard=guard)
    app.add_middleware(Observe, metrics=core.metrics)  # sees every response, 413s included
    # outermost: every answer (401, 413, 503 included) carries the request id and gets its log line
    app.add_middleware(RequestContext, guard=guard, access_log=config.access_log)
    _answer_errors_as_json(app)
    schemas = Schemas()
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
