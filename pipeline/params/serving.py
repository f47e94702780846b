"""The sections of params.yaml that measure, serve and ship the model: `benchmark`, `serve`, `containerize`,
`deploy` and `monitor`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.params.base import Section

MONITOR_URL_ENV = "PIPELINE_MONITOR_URL"


class BenchmarkConfig(Section):
    """The benchmark stage: what to time and how long, and how the serving default is chosen."""

    warmup: int = Field(10, ge=0)
    """Untimed calls before timing latency."""
    latency_calls: int = Field(200, ge=1)
    """At least this many single-image calls for the latency percentiles."""
    min_seconds: float = Field(1.0, gt=0.0)
    """Each timing repeats for at least this long."""
    batch_sizes: list[int] = Field(default_factory=lambda: [32, 256], min_length=1)
    """Throughput batch sizes; the first one ranks the setups and picks the serving default."""
    threads: list[int] = Field(default_factory=lambda: [0, 1], min_length=1)
    """Thread counts to measure at (0 = all cores)."""
    backends: list[str] = Field(default_factory=list)
    """Only these backends (empty = every backend a variant can run on)."""
    serving_backends: list[str] = Field(default_factory=lambda: ["onnxruntime"], min_length=1)
    """Backends the server image can run: the serving default is chosen among them."""
    max_accuracy_drop: float = Field(0.005, ge=0.0, le=1.0)
    """A setup may serve only if its answers agree with its variant's reference run (the variant on its first
    runtime, default settings) on at least 1 - this of the test images (0.005: 199 of 200). Label-free."""
    timeout_s: float = Field(600.0, gt=0.0)
    """A setup taking longer is reported as failed."""
    headline_rounds: int = Field(3, ge=0, le=50)
    """The headline ratio (the served setup against PyTorch's default eager, at the first batch size): this many
    rounds that time the two alternately, each in a fresh process; the report gives the median and the range (on a
    shared machine one measurement alone says little). 0 = the one measurement of the sweep."""
    profile: bool = True
    """Save an operator profile of the chosen setup."""


class SampleLogConfig(Section):
    """`serve.sample_log`: keep some received image files and the answers, for labelling (pipeline/serve/sample_log.py)."""

    dir: str = ""
    """Folder to write to (created); empty = off."""
    rate: float = Field(0.01, ge=0.0, le=1.0)
    """Fraction of the other answered images kept, at random."""
    below_confidence: float = Field(0.5, ge=0.0, le=1.0)
    """Every image whose top-1 probability is at most this is kept."""
    max_mb: float = Field(512.0, gt=0.0)
    """The folder never grows past this (shared evenly among serve.workers); then nothing more is kept."""


class ServeConfig(Section):
    """The inference server (`pipeline serve`): model choice, dynamic batching and request limits."""

    host: str = "127.0.0.1"
    """Interface to listen on (the container image passes 0.0.0.0)."""
    port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(0, ge=0, le=65535)
    """Open Inference Protocol v2 over gRPC (Triton's / KServe's clients) on this port, same host; 0 = off. The
    image serves it on 8001 (Triton's convention)."""
    model_name: str = Field("", pattern=r"^([A-Za-z0-9_.-]+)?$")
    """Name under which the Open Inference Protocol API serves the model (/v2/models/{name}); empty: `name`."""
    title: str = Field("", max_length=200)
    """The API's title (OpenAPI, the model card); empty: `<name> image classifier`."""
    variant: str = "auto"
    """Model variant from models/manifest.json; `auto` = the benchmark stage's choice, else fp32-onnx."""
    require_gate: bool = True
    """Serve only a variant that evaluate's quality gate passed (reports/evaluate/gate.json names its file);
    false: serve any variant, with a warning (development)."""
    champion: bool = False
    """Serve the model registry's `champion` (`pipeline serve --champion`) instead of models/: its file is downloaded
    and checked by the sha256 its version is tagged with; the log and `/v2/models/<name>` name the version."""
    backend: str = "auto"
    """Runtime for the variant (e.g. onnxruntime, torch-eager, torch-compile); `auto` picks per format."""
    workers: int = Field(1, ge=1, le=64)
    """Server processes sharing the port, each with its own model session and batcher (pipeline/serve/main.py)."""
    threads: int = Field(0, ge=0, le=1024)
    """Intra-op threads of the runtime per worker; 0 = the CPUs this process may use (a container's CPU quota,
    rounded up) divided among the workers."""
    max_batch_size: int = Field(64, ge=1, le=4096)
    """Largest batch the dynamic batcher forms; 1 turns batching off."""
    max_delay_ms: float = Field(0.0, ge=0.0, le=1000.0)
    """How long the first image of a batch may wait for others. 0: no waiting, a batch is whatever queued
    while the previous one ran (under load that fills batches without adding latency)."""
    max_queue_images: int = Field(2048, ge=1)
    """Images waiting for inference before new requests get 503 + Retry-After."""
    request_timeout_s: float = Field(10.0, gt=0.0)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Larger request bodies get 413."""
    max_images_per_request: int = Field(256, ge=1)
    max_image_pixels: int = Field(4096 * 4096, ge=64)
    """Larger images (by their header) get 400 without being decoded."""
    max_request_pixels: int = Field(64 * 1024 * 1024, ge=64)
    """All images of one request together (by their headers): more gets 413 without decoding any. Bounds a
    request's decoding time; memory is bounded by one image (each is freed before the next is decoded)."""
    top_k: int = Field(5, ge=1, le=256)
    drain_timeout_s: float = Field(10.0, ge=0.0)
    """On SIGTERM/SIGINT: how long in-flight requests may take to finish (at least 1 s)."""
    max_connections: int = Field(1024, ge=8, le=1_000_000)
    """Open connections plus requests in flight; beyond it new requests get 503 at once."""
    header_timeout_s: float = Field(10.0, gt=0.0, le=300.0)
    """A request's headers must arrive within this (from the connection or its first byte): else 408, closed."""
    max_header_bytes: int = Field(65536, ge=4096, le=16 * 1024 * 1024)
    """Request line plus headers; beyond it 431 and the connection is closed."""
    body_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """A request's body must arrive within this of its headers: else 408."""
    access_log: bool = True
    """One JSON line per request (id, route, status, ms) on the `pipeline.access` logger."""
    sample_log: SampleLogConfig = SampleLogConfig()
    """Off by default: a sampled, size-capped log of received files and answers, for labelling."""
    auth_token_env: str = Field("PIPELINE_SERVE_TOKEN", pattern=r"^[A-Z_][A-Z0-9_]*$")
    """Environment variable holding a bearer token: when set and non-empty, inference and model routes need
    `Authorization: Bearer <token>` (health and /metrics stay open). Off when the variable is unset."""

    @model_validator(mode="after")
    def _limits_fit_together(self) -> ServeConfig:
        if self.max_images_per_request > self.max_queue_images:
            raise ValueError(
                f"max_images_per_request ({self.max_images_per_request}) exceeds max_queue_images "
                f"({self.max_queue_images}): such a request could never be queued"
            )
        if self.max_image_pixels > self.max_request_pixels:
            raise ValueError(
                f"max_image_pixels ({self.max_image_pixels}) exceeds max_request_pixels ({self.max_request_pixels})"
            )
        return self


class ContainerizeConfig(Section):
    """The containerize stage: the inference server image (ONNX Runtime, no training stack)."""

    image: str = Field("", pattern=r"^([a-z0-9][a-z0-9._:/-]*[a-z0-9])?$")
    """Image repository, e.g. `pets-server` or `ghcr.io/OWNER/pets-server`; empty: `<name>-server`. Tags: git
    commit, model version."""
    variant: str = "auto"
    """An accepted ONNX variant of models/manifest.json (`fp32-onnx`, `int8-onnx`, `student-int8-onnx`, ...), or
    `auto`: the benchmark stage's choice."""
    base_image: str = "local/python:3.11-slim-bookworm"
    """Base of both Dockerfile stages. A `local/...` name that is missing is built with docker/base-image.sh
    (debootstrap); `python:3.11-slim-bookworm` where Docker Hub is reachable."""
    platforms: list[str] = Field(default_factory=lambda: ["linux/amd64"], min_length=1)
    """linux/amd64 and/or linux/arm64; a platform other than the engine's is built under emulation (qemu)."""
    buildkit: bool = False
    """Build with BuildKit instead of the legacy builder."""
    source_url: str = ""
    """OCI label org.opencontainers.image.source; empty: derived from the git remote `origin`."""
    skip_without_engine: bool | Literal["auto"] = "auto"
    """With no Docker engine reachable: record a skipped build (one line) instead of failing the stage. `auto`:
    skip on a developer's machine, fail where the `CI` environment variable is `true` (CI and release runs, where
    a missing engine is a broken runner)."""


class DeployConfig(Section):
    """The deploy stage: run the image, smoke-test it through its API on the test images."""

    target: Literal["local", "registry"] = "local"
    """`local`: run the built image; `registry`: push it, pull it back by digest, run that."""
    registry: str = "127.0.0.1:5000"
    """Registry for the `registry` target, e.g. ghcr.io/OWNER (log in with `docker login` first)."""
    host_port: int = Field(0, ge=0, le=65535)
    """Port on 127.0.0.1 the container's port 8000 is published on; 0 = any free port."""
    container_name: str = Field("", pattern=r"^([a-zA-Z0-9][a-zA-Z0-9_.-]*)?$")
    """Empty: `<name>-server`."""
    keep_running: bool = False
    """Leave the container running after the smoke test (it is replaced on the next deploy)."""
    ready_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    smoke_images: int = Field(0, ge=0)
    """Test images to send (the first N); 0 = all of data/prepared/test/."""
    accuracy_tolerance: float = Field(0.0, ge=0.0, le=1.0)
    """Largest allowed |accuracy through the API - evaluate stage's accuracy| (0: must be equal)."""
    skip_without_engine: bool | Literal["auto"] = "auto"
    """With no Docker engine reachable (or no image built): record a skipped deploy instead of failing the stage;
    `auto` as containerize.skip_without_engine."""


class DriftConfig(Section):
    """`pipeline monitor --drift`: live traffic against the drift reference (pipeline/monitoring/drift.py)."""

    window_s: float = Field(0.0, ge=0.0, le=86400.0)
    """Compare what the server counted over this many seconds (two scrapes of /metrics, or Prometheus'
    `increase(...[window])` with --prometheus); 0 = everything since the server started."""
    min_images: int = Field(100, ge=1)
    """Fewer answered images than this: too little traffic to judge (reported, not a breach)."""
    max_psi: float = Field(0.2, gt=0.0)
    """A signal drifts when its population stability index exceeds this ..."""
    max_p_value: float = Field(0.01, gt=0.0, le=1.0)
    """... and a chi-square test says the shift is not sampling noise (p-value below this)."""


class MonitorConfig(Section):
    """`pipeline monitor`: probe a deployed server with labelled test images and check its health thresholds."""

    url: str = ""
    """Base URL of the server, e.g. https://signs.example.com; empty: give --url or $PIPELINE_MONITOR_URL."""
    source: Literal["files", "prepared", "raw"] = "files"
    """Labelled images, sent as whole PNG files as users send them: `files` = the prepared test split's original
    files (data/prepared/test_files); `raw` = the test split that data.source lists under data.root (a source with one);
    `prepared` = the prepared crops (ROI + margin, resized) of data/prepared/test/."""
    images: int = Field(200, ge=0)
    """Images to send: the first N of the source; 0 = all of them."""
    batch_size: int = Field(8, ge=1, le=256)
    """Images per `POST /v1/predict` request (each sent as a PNG file)."""
    concurrency: int = Field(4, ge=1, le=256)
    """Requests in flight at once."""
    timeout_s: float = Field(10.0, gt=0.0, le=600.0)
    """Per request; a request that takes longer counts as an error."""
    min_accuracy: float = Field(0.9, ge=0.0, le=1.0)
    """Breach when top-1 accuracy over the answered images is below this."""
    max_p99_latency_ms: float = Field(1000.0, gt=0.0)
    """Breach when the 99th percentile of request latency (client side, one request = one batch) is above this."""
    max_error_rate: float = Field(0.01, ge=0.0, le=1.0)
    """Breach when more than this fraction of requests fail (non-200 answer, timeout, dropped connection)."""
    drift: DriftConfig = DriftConfig()
