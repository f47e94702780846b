"""The one inference path every route and the gRPC server share (`Inference`): the model behind the dynamic batcher,
the decode limits, the Prometheus metrics and drift signals, the optional sample log, and each answer's format (OIP v2
JSON or Triton's binary extension, /v1/predict's JSON). A client mistake raises an HTTPException (a refusal,
refusal.py); a full queue 503 + Retry-After, a request past serve.request_timeout_s 504.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from starlette.exceptions import HTTPException

from pipeline.config import ServeConfig
from pipeline.images.preprocess import Box
from pipeline.serve.batcher import Draining, DynamicBatcher, QueueFull
from pipeline.serve.metrics import Metrics, drift_signals
from pipeline.serve.model import ServedModel
from pipeline.serve.protocol import (
    BadRequest,
    InferRequest,
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
from pipeline.serve.refusal import JSON_TYPE

OUTPUT_NAMES = ("probabilities", "class_id")
# Requests with at most this many image pixels in all are decoded on the event loop (about 0.2 ms);
# larger ones in a worker thread.
INLINE_DECODE_PIXELS = 256 * 256

Answer = tuple[bytes, bytes, list[tuple[bytes, bytes]]]
"""A success: its body, content type and any further headers."""


def flag(value: Any, where: str) -> bool:
    """An OIP boolean parameter: JSON true/false (absent = false); anything else, such as the string "false",
    is a client error rather than a truthy value."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPException(400, f"{where} must be true or false, got {value!r}")
    return value


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
        return self.metrics.exposition(self.batcher.queued_images)
