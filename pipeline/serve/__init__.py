"""The inference server stage: `pipeline serve` loads the chosen variant and serves it with uvicorn."""

from __future__ import annotations

from pipeline.config import MODELS_DIR, Params
from pipeline.console import log


def run(params: Params) -> None:
    import uvicorn

    from pipeline.serve.app import create_app
    from pipeline.serve.model import load_served_model

    config = params.serve
    model = load_served_model(MODELS_DIR, config)
    log(f"serve: {model.variant} on {model.backend}, version {model.version}, http://{config.host}:{config.port}")
    uvicorn.run(
        create_app(config, model),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=int(config.drain_timeout_s) or None,
        access_log=False,
        log_level="info",
    )
