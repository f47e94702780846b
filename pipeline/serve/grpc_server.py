"""Open Inference Protocol v2 over gRPC (`serve.grpc_port`), the service Triton's and KServe's gRPC clients call:
`inference.GRPCInferenceService` with ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and
ModelInfer. It runs in the HTTP server's process and event loop and calls the same inference path as REST
(`Inference.infer_outputs` in inference.py: the same parsing, decoding, batcher and model), so the two protocols cannot drift.

- Inputs: FP32 / UINT8 pixels or BYTES image files, in `raw_input_contents` (what tritonclient sends) or typed
  `contents`; outputs always as `raw_output_contents` (little-endian, as clients expect).
- Errors are gRPC status codes with the REST path's message: 400/422 -> INVALID_ARGUMENT, 413 -> RESOURCE_EXHAUSTED, 401 ->
  UNAUTHENTICATED, 404 -> NOT_FOUND, 503 -> UNAVAILABLE, 504 -> DEADLINE_EXCEEDED; nothing becomes UNKNOWN.
- Auth: the HTTP server's scheme (auth.BearerAuth): with a token set, ModelInfer and the metadata RPCs need
  `authorization: Bearer <token>` metadata; the health RPCs stay open, as on REST.
- Request id: the request's `id`, else the `x-request-id` metadata when sane, else a new one; answered in the
  response's `id` and as `x-request-id` initial metadata; one access-log line per call (path `grpc:<RPC>`).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from starlette.exceptions import HTTPException

from pipeline.config import ServeConfig
from pipeline.serve.access import log_request, request_id
from pipeline.serve.auth import BearerAuth
from pipeline.serve.metrics import Metrics
from pipeline.serve.oip import predict_v2_pb2 as pb
from pipeline.serve.protocol import InferRequest, RequestedOutput, TensorInput
from pipeline.serve.refusal import internal_error

SERVICE = "inference.GRPCInferenceService"
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
_DATATYPES = {np.dtype("<f4"): "FP32", np.dtype("<i8"): "INT64"}


@dataclass
class OipCore:
    """What the gRPC service shares with the REST app (built in app.create_app)."""

    config: ServeConfig
    version: str
    ready: Callable[[], bool]
    live: Callable[[], bool]
    check_model: Callable[..., None]  # (name, version=None); raises HTTPException(404)
    metadata: Callable[[], dict[str, Any]]
    infer: Callable[[InferRequest, bytes], Awaitable[dict[str, np.ndarray]]]
    auth: BearerAuth
    metrics: Metrics


def _parameter(value: pb.InferParameter) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else None


def to_infer_request(request: pb.ModelInferRequest) -> tuple[InferRequest, bytes]:
    """The gRPC message as the REST path's parsed request: raw contents become binary tensor data (with their
    binary_data_size), typed contents become `data` (BYTES elements length-prefixed, as raw ones are)."""
    inputs: list[TensorInput] = []
    chunks: list[bytes] = []
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise HTTPException(400, f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    for index, tensor in enumerate(request.inputs):
        parameters = {key: _parameter(value) for key, value in tensor.parameters.items()}
        data: list[Any] | None = None
        if raw:
            chunk = raw[index]
        elif tensor.datatype == "BYTES" and tensor.contents.bytes_contents:
            chunk = b"".join(struct.pack("<I", len(item)) + item for item in tensor.contents.bytes_contents)
        else:
            chunk = b""
            contents = tensor.contents
            data = list(contents.fp32_contents) or list(contents.uint_contents) or None
        if data is None:
            parameters["binary_data_size"] = len(chunk)
            chunks.append(chunk)
        inputs.append(
            TensorInput(
                name=tensor.name, shape=list(tensor.shape), datatype=tensor.datatype, parameters=parameters, data=data
            )
        )
    if not inputs:
        raise HTTPException(400, "invalid inference request: inputs: at least one input is required")
    outputs = [
        RequestedOutput(name=o.name, parameters={k: _parameter(v) for k, v in o.parameters.items()})
        for o in request.outputs
    ]
    parsed = InferRequest(
        id=request.id or None,
        parameters={k: _parameter(v) for k, v in request.parameters.items()} or None,
        inputs=inputs,
        outputs=outputs or None,
    )
    return parsed, b"".join(chunks)


class Service:
    def __init__(self, core: OipCore) -> None:
        self.core = core

    def handler(self) -> grpc.GenericRpcHandler:
        rpcs: dict[str, tuple[Callable[[Any, Any], Awaitable[Any]], type[Any]]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    self._wrap(name, method),
                    request_deserializer=message.FromString,
                    response_serializer=lambda response: response.SerializeToString(),
                )
                for name, (method, message) in rpcs.items()
            },
        )

    def _wrap(
        self, name: str, method: Callable[[Any, Any], Awaitable[Any]]
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        metrics = self.core.metrics
        route = f"grpc:{name}"

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
            rid = request_id(getattr(request, "id", "") or metadata.get("x-request-id", ""))
            await context.send_initial_metadata((("x-request-id", rid),))
            status = 200
            started = metrics.begin()
            try:
                self.core.auth.check_rpc(name, metadata)
                return await method(request, rid)
            except Exception as exc:  # a refusal as its status code; never a bare UNKNOWN with a traceback
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                refusal = exc if isinstance(exc, HTTPException) else internal_error(exc)
                status = refusal.status_code
                code = _STATUS_CODES.get(status, grpc.StatusCode.INVALID_ARGUMENT)
                await context.abort(code, str(refusal.detail))
            finally:
                seconds = metrics.end(route, status, started)
                if self.core.config.access_log:
                    log_request(rid, "GRPC", route, status, seconds, context.peer())

        return call

    async def server_live(self, _: pb.ServerLiveRequest, __: str) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.core.live())

    async def server_ready(self, _: pb.ServerReadyRequest, __: str) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def model_ready(self, request: pb.ModelReadyRequest, _: str) -> pb.ModelReadyResponse:
        self.core.check_model(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=self.core.ready())

    async def server_metadata(self, _: pb.ServerMetadataRequest, __: str) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=f"{self.core.config.model_name}-server", version=self.core.version, extensions=[]
        )

    async def model_metadata(self, request: pb.ModelMetadataRequest, _: str) -> pb.ModelMetadataResponse:
        self.core.check_model(request.name, request.version or None)
        meta = self.core.metadata()

        def tensors(items: list[dict[str, Any]]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [
                pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in items
            ]

        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=tensors(meta["inputs"]),
            outputs=tensors(meta["outputs"]),
        )

    async def model_infer(self, request: pb.ModelInferRequest, request_id: str) -> pb.ModelInferResponse:
        self.core.check_model(request.model_name, request.model_version or None)
        parsed, binary = to_infer_request(request)
        values = await self.core.infer(parsed, binary)
        response = pb.ModelInferResponse(
            model_name=self.core.config.model_name, model_version=self.core.version, id=request.id or request_id
        )
        for name, array in values.items():
            little = array.astype(array.dtype.newbyteorder("<"), copy=False)
            response.outputs.add(name=name, datatype=_DATATYPES[little.dtype], shape=list(array.shape))
            response.raw_output_contents.append(little.tobytes())
        return response


async def start_grpc(core: OipCore) -> grpc.aio.Server:
    """Start the gRPC server on serve.host:serve.grpc_port in the running event loop."""
    config = core.config
    limit = config.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),  # beyond: RESOURCE_EXHAUSTED before any parsing
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            # Several workers share the port (the kernel spreads connections); one server alone must own it.
            ("grpc.so_reuseport", 1 if config.workers > 1 else 0),
        ],
        maximum_concurrent_rpcs=config.max_connections,
    )
    server.add_generic_rpc_handlers((Service(core).handler(),))
    address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"
    server.add_insecure_port(address)
    await server.start()
    return server
