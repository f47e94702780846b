"""The server's Prometheus metrics: requests by route and status, latency, batches, the queue, requests in flight,
images and errors (HTTP and gRPC alike: `Metrics.begin` / `Metrics.end` around each request), the drift signals, and
`Observe`, the middleware that counts every request the inference routes' HotPath does not answer itself."""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.monitoring import drift
from pipeline.serve.batcher import BatchStats
from pipeline.serve.model import ServedModel


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

    def begin(self) -> float:
        """A request begins: counted in flight; its start time (for `end`)."""
        self.in_flight.inc()
        return time.perf_counter()

    def end(self, route: str, status: int, started: float) -> float:
        """The request begun at `started` is answered: out of flight, then `record`ed; the seconds it took."""
        self.in_flight.dec()
        seconds = time.perf_counter() - started
        self.record(route, status, seconds)
        return seconds

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

    def exposition(self, queued_images: int) -> bytes:
        """The text /metrics answers, with the queue gauge as it is now."""
        self.queue.set(queued_images)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # several workers: all of them, from their shared files
            from prometheus_client import multiprocess

            combined = CollectorRegistry()
            multiprocess.MultiProcessCollector(combined)
            return generate_latest(combined)
        return generate_latest(self.registry)


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
        status = 500  # an exception before any response reaches uvicorn as a 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = self.metrics.begin()
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.end(getattr(route, "path", "unmatched"), status, started)
