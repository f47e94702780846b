"""The inference server: `pipeline serve` loads the chosen variant and serves it with uvicorn (a command, not a
DVC stage; the container image runs it)."""

from __future__ import annotations

import math

from pipeline.artifacts import MODELS_DIR
from pipeline.config import Params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.ports import ensure_free


def run(params: Params) -> None:
    import gc
    import logging
    import sys

    import uvicorn

    from pipeline.serve.app import create_app
    from pipeline.serve.connection import GuardedHttpProtocol
    from pipeline.serve.model import load_served_model

    config = params.serve
    ensure_free(config.host, config.port, "serve.port (or --port)")  # before minutes of model loading
    if config.grpc_port:
        if config.grpc_port == config.port:
            raise StageError(f"serve.grpc_port {config.grpc_port} is serve.port as well: give gRPC a port of its own")
        ensure_free(config.host, config.grpc_port, "serve.grpc_port (or --grpc-port)")
    model = load_served_model(MODELS_DIR, config)
    grpc_note = f", gRPC {config.host}:{config.grpc_port}" if config.grpc_port else ""
    log(
        f"serve: {model.variant} on {model.backend} ({model.threads} threads), version {model.version}, "
        f"http://{config.host}:{config.port}{grpc_note}"
    )
    if config.access_log:  # one JSON line per request on stdout, beside uvicorn's own log
        access = logging.getLogger("pipeline.access")
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    app = create_app(config, model)
    # Every request allocates a few thousand short-lived objects: with the long-lived heap (modules,
    # the model session, the app) frozen out of the collector and a larger first generation, garbage
    # collection stops showing in the per-request profile (it was ~9 % of the event loop's time).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        # uvicorn takes whole seconds, and reads 0 as "wait forever": round a sub-second drain up.
        timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
        # Connections and requests in flight beyond this get 503 at once instead of piling up in memory.
        limit_concurrency=config.max_connections,
        # Header deadline and size, and a drain that closes idle keep-alive connections only when quiet.
        http=GuardedHttpProtocol.configured(config.header_timeout_s, config.max_header_bytes, drain_idle_s=0.5),
        access_log=False,
        log_level="info",
    )
