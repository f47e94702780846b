"""The server's app in this process: `create_app(...)` through `httpx.ASGITransport`, its lifespan (batcher start,
warm-up, drain, the access log's flush) run as uvicorn runs it. No process, socket or port: what only a process shows
(signals, sockets, workers, the connection limits) stays in the tests that start one (conftest.py's `server`).

`fake_model()` stands in for a trained variant where the answer's numbers do not matter (the request rules, refusals,
metrics): 43 classes, 24-pixel images, logits that rank class 0 first, and an optional delay per batch."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image

from pipeline.config import ServeConfig
from pipeline.images.preprocess import Framing
from pipeline.serve.app import create_app
from pipeline.serve.model import ServedModel

T = TypeVar("T")
TOKEN_ENV = "PIPELINE_TEST_INPROCESS_TOKEN"  # the tests' own variable: a token in the developer's shell cannot leak in
CLASSES = 43
SIZE = 24
MAX_BODY = 256 * 1024  # as tests/helpers/server.py's processes


def fake_model(batch_delay_s: float = 0.0) -> ServedModel:
    def predict_logits(images: np.ndarray) -> np.ndarray:
        if batch_delay_s:
            time.sleep(batch_delay_s)  # runs in the batcher's worker thread, as a real model does
        return np.tile(np.arange(CLASSES, 0, -1, dtype=np.float32), (len(images), 1))

    return ServedModel(
        classes=[f"class {i}" for i in range(CLASSES)],
        framing=Framing(SIZE),
        variant="fp32-onnx",
        backend="fake",
        version="0123456789ab",
        predict_logits=predict_logits,
    )


def serve_config(**overrides: Any) -> ServeConfig:
    """The tests' server settings (as tests/helpers/server.py writes them) with `overrides`."""
    settings: dict[str, Any] = {
        "model_name": "signs",
        "title": "signs image classifier",
        "max_body_bytes": MAX_BODY,
        "variant": "fp32-onnx",
        "require_gate": False,
        "auth_token_env": TOKEN_ENV,
    }
    return ServeConfig(**(settings | overrides))


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """The ASGI lifespan protocol, as uvicorn speaks it: startup before the first request, shutdown after the last."""
    to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, to_app.get, from_app.put)
    )
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        stopped = await from_app.get()
        await task
        assert stopped["type"] == "lifespan.shutdown.complete", stopped


@asynccontextmanager
async def serving(config: ServeConfig, model: ServedModel) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `create_app(config, model)`, started and, on leaving, drained and stopped."""
    app = create_app(config, model)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=("127.0.0.1", 50000))
    async with lifespan(app), httpx.AsyncClient(transport=transport, base_url="http://inprocess", timeout=30) as client:
        yield client


def served(
    scenario: Callable[[httpx.AsyncClient], Awaitable[T]], model: ServedModel | None = None, **settings: Any
) -> T:
    """`scenario` run against a fresh app (the fake model unless `model`, serve settings `settings`)."""

    async def main() -> T:
        async with serving(serve_config(**settings), model or fake_model()) as client:
            return await scenario(client)

    return asyncio.run(main())


def png(pixels: np.ndarray | None = None, side: int = SIZE) -> bytes:
    """A PNG file of `pixels` (uint8 [H, W, 3]), by default a mid-grey square."""
    if pixels is None:
        pixels = np.full((side, side, 3), 128, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` in /metrics' `text` that carry `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(2) or "") for k, v in labels.items()):
            total += float(match.group(3))
    return total


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access-log lines written while `caplog` listened (flushed by the lifespan's shutdown)."""
    return [
        orjson.loads(line)
        for record in caplog.records
        if record.name == "pipeline.access"
        for line in record.getMessage().splitlines()
    ]


def listen_to_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.access")
