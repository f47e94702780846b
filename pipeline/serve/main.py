"""The inference server: `pipeline serve` loads the chosen variant and serves it with uvicorn (a command, not a
DVC stage; the container image runs it).

`serve.workers: N > 1` runs N server processes behind one listening socket, which this process binds and hands
down (as gunicorn does): the kernel gives each new connection to whichever worker accepts it first. Each worker
has its own model session, batcher and event loop, and `serve.threads` (else the CPU quota divided among the
workers) runtime threads. Prometheus runs in multiprocess mode (files in PROMETHEUS_MULTIPROC_DIR), so whichever
worker answers `/metrics` reports the sum of all. SIGTERM / SIGINT reach every worker, each drains as a single
server does; the supervisor exits when they have. A worker that dies unexpectedly stops the whole server (exit 1):
its orchestrator (Kubernetes, Docker's restart policy) restarts it whole rather than running below capacity.
gRPC (`serve.grpc_port`) is served by every worker on the same port with SO_REUSEPORT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import MODELS_DIR
from pipeline.config import Params, parse_params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.machine.ports import ensure_free
from pipeline.serve.model import RegistryVersion

# Set by the supervisor for its workers: the inherited listening socket and the params they serve.
WORKER_FD_ENV = "PIPELINE_SERVE_SOCKET_FD"
WORKER_PARAMS_ENV = "PIPELINE_SERVE_PARAMS"
WORKER_INDEX_ENV = "PIPELINE_SERVE_WORKER"
WORKER_SOURCE_ENV = "PIPELINE_SERVE_SOURCE"  # the models folder and its registry version, as JSON


def run(params: Params) -> None:
    config = params.serve
    ensure_free(config.host, config.port, "serve.port (or --port)")  # before minutes of model loading
    if config.grpc_port:
        if config.grpc_port == config.port:
            raise StageError(f"serve.grpc_port {config.grpc_port} is serve.port as well: give gRPC a port of its own")
        ensure_free(config.host, config.grpc_port, "serve.grpc_port (or --grpc-port)")
    params, source = model_source(params)
    if config.workers > 1:
        supervise(params, source)
    else:
        serve_one(params, None, source=source)


@dataclass(frozen=True)
class ModelSource:
    """Where the served files are, and which registered version they are (when the registry says)."""

    models_dir: Path = MODELS_DIR
    registry: RegistryVersion | None = None


def model_source(params: Params) -> tuple[Params, ModelSource]:
    """models/, once evaluate's gate passed its variant; or with serve.champion (--champion) the registry's
    champion, downloaded and checked by its sha256 (its gate passed when it was promoted)."""
    from pipeline.serve import champion

    if params.serve.champion:
        folder, variant, registry = champion.download_champion(params)
        log(f"serve: {registry.describe()}: {variant}, downloaded and checked by its sha256")
        chosen = params.serve.model_copy(update={"variant": variant, "backend": "auto"})
        return params.model_copy(update={"serve": chosen}), ModelSource(folder, registry)
    sha256 = check_gate(params)
    return params, ModelSource(MODELS_DIR, champion.registered_as(params, sha256) if sha256 else None)


def check_gate(params: Params) -> str:
    """Serve only a variant evaluate's gate passed (serve.require_gate); otherwise a StageError naming why. The
    served file's sha256 ("" without models/)."""
    from pipeline.artifacts import gate as gate_file
    from pipeline.runtimes import read_manifest
    from pipeline.serve.model import MANIFEST_NAME, choose_variant

    if not (MODELS_DIR / MANIFEST_NAME).is_file():
        return ""  # load_served_model says what is missing
    variant, _ = choose_variant(MODELS_DIR, params.serve)
    sha256 = read_manifest(MODELS_DIR).variant(variant).sha256
    if params.serve.require_gate:
        try:
            gate_file.require_passed(variant, sha256)
        except StageError as exc:
            raise StageError(f"{exc}. `pipeline serve --champion` serves the registry's champion instead") from None
    else:
        log(f"WARNING serve: {variant} is served without checking evaluate's gate (serve.require_gate: false)")
    return sha256


def _access_log_to_stdout() -> None:
    """One JSON line per request on stdout, beside uvicorn's own log."""
    import logging

    access = logging.getLogger("pipeline.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def serve_one(
    params: Params, sock: socket.socket | None, worker: int | None = None, source: ModelSource | None = None
) -> None:
    import gc

    import uvicorn

    from pipeline.serve.app import create_app
    from pipeline.serve.connection import GuardedHttpProtocol
    from pipeline.serve.model import load_served_model

    config, source = params.serve, source or ModelSource()
    model = dataclasses.replace(load_served_model(source.models_dir, config), registry=source.registry)
    grpc_note = f", gRPC {config.host}:{config.grpc_port}" if config.grpc_port else ""
    who = f"serve (worker {worker}, pid {os.getpid()})" if worker is not None else "serve"
    registered = source.registry.describe() if source.registry else "not found in a registry here"
    log(
        f"{who}: {model.variant} on {model.backend} ({model.threads} threads), version {model.version} "
        f"({registered}), http://{config.host}:{config.port}{grpc_note}"
    )
    if config.access_log:
        _access_log_to_stdout()
    app = create_app(config, model)
    # Every request allocates a few thousand short-lived objects: with the long-lived heap (modules,
    # the model session, the app) frozen out of the collector and a larger first generation, garbage
    # collection stops showing in the per-request profile (it was ~9 % of the event loop's time).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            # uvicorn takes whole seconds, and reads 0 as "wait forever": round a sub-second drain up.
            timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
            # Connections and requests in flight beyond this get 503 at once instead of piling up in memory.
            limit_concurrency=config.max_connections,
            # Header deadline and size, and a drain that closes idle keep-alive connections only when quiet: a
            # client starved of CPU between two requests must not meet the close just as it sends the next one.
            http=GuardedHttpProtocol.configured(
                config.header_timeout_s, config.max_header_bytes, drain_idle_s=min(2.0, config.drain_timeout_s / 2)
            ),
            access_log=False,
            # No X-Forwarded-* rewriting (it trusts only 127.0.0.1, so in a cluster it never applied; the access log
            # records the peer address) and no Server header (names our stack to scanners); Date stays (RFC 9110).
            proxy_headers=False,
            server_header=False,
            log_level="info",
        )
    )
    # uvicorn re-raises the SIGINT it drained on; SIGINT is how the image is stopped (STOPSIGNAL): a clean exit,
    # as uvicorn.run() makes it.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock] if sock is not None else None)


def worker_main() -> None:
    """A worker process of `supervise`: the inherited socket, the supervisor's params."""
    params = parse_params(json.loads(os.environ[WORKER_PARAMS_ENV]))
    sock = socket.socket(fileno=int(os.environ[WORKER_FD_ENV]))
    given = json.loads(os.environ[WORKER_SOURCE_ENV])
    registry = RegistryVersion(**given["registry"]) if given["registry"] else None
    serve_one(params, sock, int(os.environ[WORKER_INDEX_ENV]), ModelSource(Path(given["models_dir"]), registry))


def supervise(params: Params, source: ModelSource) -> None:
    config = params.serve
    sock = socket.create_server((config.host, config.port), backlog=2048)
    sock.set_inheritable(True)
    given_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    metrics_dir = given_dir or tempfile.mkdtemp(prefix="pipeline-metrics-")
    for stale in os.listdir(metrics_dir):  # values of an earlier run would be summed in
        if stale.endswith(".db"):
            os.unlink(os.path.join(metrics_dir, stale))
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        WORKER_FD_ENV: str(sock.fileno()),
        WORKER_PARAMS_ENV: json.dumps(params.model_dump(mode="json")),
        WORKER_SOURCE_ENV: json.dumps(
            {"models_dir": str(source.models_dir), "registry": source.registry and source.registry.as_dict()}
        ),
    }
    log(f"serve: {config.workers} workers on http://{config.host}:{config.port} (metrics in {metrics_dir})")
    code = [sys.executable, "-c", "from pipeline.serve.main import worker_main; worker_main()"]
    workers = [
        subprocess.Popen(code, env={**env, WORKER_INDEX_ENV: str(i)}, pass_fds=(sock.fileno(),))
        for i in range(config.workers)
    ]
    stopping = {"signal": 0}

    def forward(signum: int, _: object) -> None:
        if not stopping["signal"]:
            # Stop listening in every worker at once, before any drains: otherwise a client whose keep-alive
            # connection one worker closes in its drain reconnects into the socket another worker still holds,
            # and is reset if that one closes it before accepting (seen: 1 request lost in 3 runs).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        stopping["signal"] = signum
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    from prometheus_client import multiprocess

    failed = 0
    while any(w.poll() is None for w in workers):
        for worker in workers:
            if worker.returncode is not None and worker.returncode != 0 and not stopping["signal"] and not failed:
                failed = worker.returncode
                log(f"serve: worker pid {worker.pid} exited with {worker.returncode}; stopping the others")
                forward(signal.SIGTERM, None)
        time.sleep(0.2)
    sock.close()
    for worker in workers:
        multiprocess.mark_process_dead(worker.pid, metrics_dir)
    if not given_dir:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failed:
        raise StageError(f"a server worker failed (exit {failed}); see its log above")
