"""Typed, validated configuration: params.yaml -> pydantic models, checked once at the edge.

Every section is strict (no silent type coercion) and forbids unknown keys, so a typo in params.yaml
stops the run with a one-line message naming the key instead of being ignored.
Three layers make the params a stage sees: the field defaults here, under the recipe's values (`recipe`:
pipeline/recipes/<name>.yaml, or a YAML file of your own), under params.yaml's own keys. A key that params.yaml
leaves out or sets to null (`~`) takes the recipe's value, so one key picks a recipe and any key you set still wins.
The names a run carries (MLflow experiment and registered model, served model, image, container) follow `name`.
This module imports nothing else from the package.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.data.sources import DATA_SOURCES, DEFAULT_SOURCE, recipe_for

# Paths come from YAML as strings; accept those (and only those) for Path fields.
PathField = Annotated[Path, Field(strict=False)]


def _switch_word(value: object) -> object:
    # YAML 1.1 readers (PyYAML) take an unquoted off / on as false / true, and `dvc exp run -S key=off` writes
    # it unquoted (YAML 1.2): the word was meant.
    return ("on" if value else "off") if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch_word)]
AmpMode = Annotated[Literal["auto", "bf16", "off"], BeforeValidator(_switch_word)]

MONITOR_URL_ENV = "PIPELINE_MONITOR_URL"
RECIPES_DIR = Path(__file__).with_name("recipes")
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# Keys left empty take a name made from `name`.
NAMED_KEYS = {
    ("tracking", "experiment"): "{name}",
    ("tracking", "registered_model_name"): "{name}-classifier",
    ("serve", "model_name"): "{name}",
    ("serve", "title"): "{name} image classifier",
    ("containerize", "image"): "{name}-server",
    ("deploy", "container_name"): "{name}-server",
}
# Folder names that say nothing about the data: a name is taken from the folder above them.
_GENERIC_FOLDERS = {"train", "training", "data", "raw", "images", "imgs", "dataset", "datasets", "photos", "all", "."}


class Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class DataConfig(Section):
    """The prepare stage: where the images are, and how they become arrays."""

    source: str = DEFAULT_SOURCE
    """A name in pipeline/data/sources.py's table. `folder`: `root` holds one sub-folder of images per class (or
    `train/<class>/` and `test/<class>/`). `csv`: `root` is a CSV file with `path,label[,group][,box][,split]`
    columns (pipeline/data/listing.py). Classes come from the data."""
    root: PathField = Path("data/raw")
    """folder: your folder of class folders; csv: your CSV file; a downloading source: the folder that holds (or
    receives) its files."""
    download: bool = True
    """A source that can download its data fetches it into `root` when it is not there (needs internet)."""
    image_size: int = Field(32, ge=8, le=1024)
    """Side of the square images the model sees, in pixels (32 suits signs; photos for a backbone: 96-384); with
    `min_image_size`, the largest side tried."""
    min_image_size: int = Field(0, ge=0, le=1024)
    """> 0 with `train.max_minutes`: the side is chosen for this machine. Prepare times a few training steps of
    `model.name` at sides from `image_size` down to this one (steps of 16 px) and prepares the largest at which
    `train.epochs` epochs fit in `train.max_minutes`, else this one (the budget then trains fewer epochs): a slow CPU
    trains a smaller input for all its epochs rather than a large one for too few. For random weights only: a
    network that starts from pretrained weights keeps `image_size` (they learn in a few epochs, at the side they were
    made for). The log says what it timed; the prepared manifest, the model and its card carry the side. 0 =
    `image_size` as written."""
    resize: Literal["stretch", "center_crop", "pad"] = "stretch"
    """How an image (its served crop, or its box) becomes that square, the same in prepare, evaluate, predict and
    the server: `stretch` squashes it (objects about square, such as road signs); `center_crop` keeps the central square of
    the shorter side; `pad` keeps all of it and its aspect ratio, on black bands (photos of any shape)."""
    interpolation: Literal["auto", "bilinear", "bicubic"] = "auto"
    """The resize's filter, the same in prepare, evaluate, predict and the server. `auto`: what the architecture's
    pretrained weights were made with (torchvision's `weights.transforms()`, timm's `pretrained_cfg`: bicubic for
    efficientnet_b0 and timm's networks), bilinear for signnet / trafficsignnet."""
    reduced_jpeg_decode: bool = False
    """Decode a JPEG at least twice as large as `image_size` at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT
    scaling), never below it, in prepare and the server alike: a phone's 12-megapixel photo decodes many times
    faster. Off by default: the pixels differ a little from a full decode's (docs/serving.md measures both)."""
    roi_margin: float = Field(0.1, ge=0.0, le=1.0)
    """Margin around the sign, as a fraction of its box on each side: what `framing: roi` crops, and what
    `crop: auto` leaves around the sign of an average whole image."""
    framing: Literal["served", "roi"] = "served"
    """How train and val images are made. `served`: the whole image file less `crop`, exactly what the server
    does with a file it is sent (train on what is served). `roi`: the sign's annotated box + roi_margin (the
    paper protocol; the server then sees framings the model never learned)."""
    crop: Literal["auto", "none"] = "auto"
    """What the served input cuts off each side of a whole image. `auto`: the training split's average
    background at each side less roi_margin (objects framed off-centre: more pixels land on the object).
    `none`: the whole image. Recorded in the prepared manifest and the models' manifest; the server applies it."""
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    """Fraction of each class's groups held out for validation (a group: frames of one physical object, such as a
    CSV's `group` column; else single files)."""
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5)
    """Sources without a test split: the fraction of each class's groups held out for testing."""
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    """Fail the stage when more than this fraction of images cannot be read."""
    shard_mb: int = Field(64, ge=1, le=4096)
    """Size of each prepared image shard (data/prepared/SPLIT/images-NNNNN.npy): what prepare holds in memory per
    split while writing; readers take single rows from them, so it bounds nothing else."""
    seed: int = 42

    @field_validator("source")
    @classmethod
    def _source_name(cls, value: str) -> str:
        if value not in DATA_SOURCES:
            raise ValueError(f"unknown data source {value!r}; choose one of {', '.join(DATA_SOURCES)}")
        return value

    def resolved_root(self) -> Path:
        """`root`, unless the source's environment variable (its `root_env`) names another copy."""
        variable = DATA_SOURCES[self.source].root_env
        value = os.environ.get(variable) if variable else None
        return Path(value) if value else self.root


LIBRARY_NETWORK = re.compile(r"^(torchvision|timm)/[A-Za-z0-9_.\-]+$")


def _network_name(name: str) -> str:
    from pipeline import architectures  # light: the table, no torch

    if not (architectures.is_known(name) or LIBRARY_NETWORK.match(name)):
        raise ValueError(
            f"unknown network {name!r}: one of {', '.join(architectures.ARCHITECTURES)}, torchvision/<arch>, "
            "timm/<arch>, or path/to/file.py:function"
        )
    return name


class ModelConfig(Section):
    """The network, built by name from pipeline/architectures/nets.py."""

    name: str = Field("signnet", min_length=1)
    """`signnet`: the demo's compact CNN; `trafficsignnet`: Arm's learning-path reference network (ours: one file
    each in pipeline/architectures/); `torchvision/<arch>`: any classification builder of torchvision.models
    (resnet18, mobilenet_v3_small, efficientnet_b0, convnext_tiny, ...); `timm/<arch>`: any timm.create_model name;
    `path/to/file.py:function`: a network of your project (docs/extending.md). The classifier is sized from the
    data's classes."""

    @field_validator("name")
    @classmethod
    def _known_network(cls, name: str) -> str:
        return _network_name(name)

    weights: str = Field("none", min_length=1)
    """torchvision/timm networks: `none` (random initialisation), `package` (the weights an installed package ships:
    pipeline/architectures/weights.py's table, pinned in uv.lock), `auto` (the package's where the table has them,
    else the library's pretrained weights when they can be had, else random weights, which the log, the MLflow run
    and the model card then say), `default` (the library's pretrained weights,
    through its cache: TORCH_HOME / HF_HOME, so offline once the cache holds them) or a path to a `.safetensors`
    or `.pth` state dict (read with weights_only=True). Every tensor but the classifier's is loaded."""
    weights_sha256: str = Field("", pattern=r"^([0-9a-fA-F]{64})?$")
    """Optional: the weights file's SHA-256; another file is refused before any training step."""
    width: int = Field(32, ge=4, le=256)
    """signnet: channels of the first stage (the next two have 2x and 4x); ignored by trafficsignnet."""
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    """signnet: dropout before the classifier."""
    input_norm: Literal["dataset", "image"] = "image"
    """signnet: `image` standardises each image by its own mean/std (contrast normalisation, robust to
    dark photos); `dataset` uses the training split's per-channel mean/std. trafficsignnet: always dataset."""
    members: int = Field(2, ge=1, le=8)
    """Committee size: > 1 trains that many differently initialised copies side by side (same batches,
    each its own loss) and predicts with their mean probability. Costs members x the compute. Our own networks
    only: a torchvision/timm network trains as one (copies of one set of pretrained weights would not differ)."""


class TrainConfig(Section):
    """The train stage: recipe, processes and checkpoints. Resumes from the last complete checkpoint."""

    epochs: int = Field(12, ge=1, le=1000)
    max_minutes: float = Field(0.0, ge=0.0, le=10080.0)
    """A time budget for training (as Ultralytics' `time`): after each epoch, the run plans as many epochs as fit in
    it at the mean pace of its epochs so far (at most `epochs`) and the learning rate anneals over those, so a slower
    CPU trains fewer epochs rather than for longer; the log and reports/train/metrics.json (`epochs`) say how many.
    0 = none."""
    batch_size: int = Field(128, ge=1, le=65536)
    """Global batch size: the sum over all processes (the per-process batch is this / nproc)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(0.003, gt=0.0, le=10.0)
    """Peak learning rate of the one-cycle schedule (linear warm-up, then cosine decay to zero)."""
    warmup_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Fraction of the steps spent warming the learning rate up."""
    logit_adjustment: float = Field(0.0, ge=0.0, le=5.0)
    """tau of logit-adjusted training: the model then predicts as if every class were equally common
    (for class-balanced test sets; rare signs are not out-voted by frequent look-alikes). 0 = off."""
    train_on_val: bool = True
    """Train the shipped model on the validation split's images too (all the labelled training images). Choose
    recipes with it off (`dvc exp run -S train.train_on_val=false`: validation is then held out and its accuracy
    reported per epoch); with it on there is no held-out validation figure (`val_accuracy` is null). Why on: one
    60 km/h sign's digit glyph is only in a validation track, and every network trained without it misreads
    that sign in the official test images (docs/results.md, the recipe section)."""
    seed: int = 0
    nproc: int = Field(1, ge=1, le=64)
    """Processes to train with (one per GPU on CUDA). Under torchrun, torchrun's world size wins."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """With several processes: DistributedDataParallel, or FSDP2 (`fully_shard`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: cuda when available, else cpu."""
    compile: bool = False
    """Run the training step through torch.compile."""
    amp: AmpMode = "auto"
    """bf16 autocast. `auto`: on for CUDA devices that support bf16 and x86 CPUs with AMX or AVX512-BF16 (faster
    steps there: docs/stages.md), off elsewhere (AVX2 only emulates bf16: slower than fp32)."""
    threads: int = Field(0, ge=0, le=1024)
    """CPU threads per process; 0 = the CPUs this process may use (a container's quota, OMP_NUM_THREADS) divided by
    the number of processes."""
    checkpoint_every: int = Field(100, ge=0)
    """Save a checkpoint every this many steps (0: only at the end); one is always saved at the end."""
    keep_checkpoints: int = Field(2, ge=1, le=100)
    """Complete checkpoints kept on disk (the newest ones)."""
    checkpoint_dir: str = Field("models/checkpoints", min_length=1)
    """Where checkpoints live (one folder per params + data fingerprint). Scratch state for resuming, not a DVC
    output, so a `dvc pull`ed clone is up to date without them. A run on several machines (torchrun --nnodes)
    needs a folder every node sees (a shared filesystem): the train stage checks that it is."""
    eval_batch_size: int = Field(512, ge=1, le=65536)
    backbone_lr_factor: float = Field(0.1, ge=0.0, le=1.0)
    """torchvision/timm networks with pretrained weights: the backbone's learning rate is `lr` times this; the
    classifier's is `lr` (fine-tuning pretrained features more gently than the fresh head). Random weights, and our
    own networks, train as one."""
    early_stopping_patience: int = Field(0, ge=0, le=1000)
    """With validation held out (`train_on_val: false`): stop after this many epochs without a better validation
    accuracy and keep the best epoch's weights; 0 = off (the shipped recipe trains on validation)."""
    from_pretrained: Literal["full", "features"] = "full"
    """torchvision/timm networks that start from pretrained weights: `full` trains the whole network for the epochs;
    `features` computes the frozen backbone's features once (cached), fits the classifier on them in seconds, then
    fine-tunes the last `tail_blocks` blocks on the cached activations in what is left of `max_minutes` and keeps
    whichever validation prefers; with `train_on_val` the kept network's classifier is then refitted on training +
    validation with the settings validation chose (pipeline/training/features.py). The right first step on a CPU.
    Random weights always train `full`."""
    tail_blocks: int = Field(1, ge=0, le=16)
    """`from_pretrained: features`: the last blocks fine-tuned after the head (0: the head only). A network the
    features module cannot cut there trains its head only."""
    freeze_backbone_epochs: int = Field(0, ge=0)
    """torchvision/timm networks with pretrained weights: the backbone's learning rate is 0 for this many first
    epochs (the fresh head settles before the pretrained features move); nothing is frozen from random weights."""
    data_from: Literal["workspace", "dvc-remote"] = "workspace"
    """Where training reads data/prepared: `workspace` (this folder, as `dvc repro` leaves it), or `dvc-remote`:
    the version this repository's dvc.lock records, read straight from the DVC remote by ranged reads (no
    `dvc pull`, no shared disk: torchrun on several machines, each with a clone and the remote's credentials)."""


class AugmentParams(Section):
    """Training-time augmentation, per image: shared by train and optimize's fine-tune."""

    enabled: bool = True
    """Random affine (rotation, shift, scale, shear) and colour jitter, per image (flips: `hflip`)."""
    rotation: float = Field(10.0, ge=0.0, le=180.0)
    """Maximum rotation, degrees."""
    translate: float = Field(0.1, ge=0.0, le=0.5)
    """Maximum shift, as a fraction of the image side."""
    scale: float = Field(0.1, ge=0.0, lt=1.0)
    """Scale factor drawn from [1 - scale, 1 + scale]."""
    shear: float = Field(5.0, ge=0.0, le=45.0)
    """Maximum shear, degrees."""
    color_jitter: float = Field(0.3, ge=0.0, lt=1.0)
    """Brightness, contrast and saturation factors drawn from [1 - x, 1 + x]."""
    hflip: bool = False
    """Mirror half the images left-right (photos of objects; never for signs, whose meaning it can change)."""
    random_resized_crop: float = Field(0.0, ge=0.0, lt=1.0)
    """> 0: each image shows a random part of itself of at least this fraction of its area (aspect 3/4..4/3),
    resized back to the full side: RandomResizedCrop's idea for photos; 0 = off."""


class RegularizeParams(Section):
    """Regularisation of every optimisation of the network: train and optimize's fine-tune."""

    weight_decay: float = Field(0.0005, ge=0.0, le=1.0)
    """Decoupled weight decay of the weights (not of biases and BatchNorm parameters)."""
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)


class EvaluateConfig(Section):
    """The evaluate stage: metrics on the test split and the quality gate."""

    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)
    """An absolute floor on the served test accuracy (original files, whole, through the server's preprocessing),
    for a recipe that knows its data; 0 = none. The comparative gate always applies: the shipped
    variant within `max_drop` of the trained model, and no worse than the registered champion on the same files."""
    max_drop: float = Field(0.01, ge=0.0, le=1.0)
    """The shipped variant may be at most this below the trained model, and below the current champion, on the
    same test files (0.01 = one point)."""
    champion: bool = True
    """Compare with the registered model's `champion` (its MLflow pyfunc model, on the same test files) when one
    exists."""
    promote: Literal["auto", "always", "never"] = "auto"
    """Whether a passed gate points `champion` at this run's variant. `auto`: yes, except on a pull request or
    another branch than the default one in GitHub Actions, and in queued or temporary DVC experiments (sweeps
    compare, they do not promote); `never`: only `pipeline promote` moves it. What is released is what `champion`
    names (docs/ci.md)."""
    worst_classes: int = Field(5, ge=0, le=256)
    """How many of the least accurate classes to report."""
    batch_size: int = Field(512, ge=1, le=65536)


class TrackingConfig(Section):
    """MLflow. $MLFLOW_TRACKING_URI, when set, wins over `uri`."""

    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: str = ""
    """Empty: `name`."""
    registered_model_name: str = Field("", max_length=200)
    """MLflow registered model: optimize registers every accepted variant as a version of it; evaluate points its
    `champion` alias at the served one when its gate passes (evaluate.promote)."""


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
    rounds that time the two alternately, each in a fresh process; the report gives the median and the range (a
    shared machine moves a single measurement by half). 0 = the one measurement of the sweep."""
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


class OptimizeConfig(Section):
    """The optimize stage: which variants of the trained model to make and the gates they must pass."""

    max_accuracy_drop: float = Field(0.005, ge=0.0, le=1.0)
    """Accept a variant only when its top-1 on the gate's images (the served test files, plus validation framed
    as served when the trained model held it out) is at most this below the fp32 model's (0.005 = 0.5 points)."""
    prune_amount: float = Field(0.125, ge=0.0, lt=1.0)
    """Fraction of the filters removed from every convolution (whole filters, smallest norm with the following
    BatchNorm's scale folded in; then `prune_multiple`); 0 = no pruning. The default, with `prune_members: 1`,
    keeps the committee's first network at 24-56-112 channels (35 % of the committee's multiply-adds): the
    largest network of multiples of 8 under 40 %; distilled from the committee for `finetune_epochs` it serves
    about twice as fast at the committee's accuracy on the official test images (docs/results.md, "optimize")."""
    prune_norm: Literal["l1", "l2"] = "l1"
    """Norm that ranks the filters of a convolution for pruning."""
    prune_members: int = Field(1, ge=0, le=64)
    """A committee keeps only its first this-many members before pruning (0 = all of them): one network runs
    faster per multiply-add than a committee of small ones (int8 ONNX Runtime: a half-pruned committee of two,
    26 % of the multiply-adds, served 1.8x the committee's throughput; one pruned network at 35 %, 2.2x)."""
    prune_multiple: int = Field(8, ge=1, le=128)
    """Filters kept per convolution rounded down to a multiple of this (never below it): int8 and bf16 kernels
    work in blocks of 8-16 channels, so 20 channels cost about what 32 do."""
    finetune_epochs: int = Field(6, ge=0, le=100)
    """Epochs of fine-tuning after pruning, distilled from the whole trained model (`finetune_distill`), on the
    images the train stage learnt from, with the `augment` and `regularize` sections."""
    finetune_lr: float = Field(0.003, gt=0.0, le=10.0)
    """Peak AdamW learning rate of the fine-tune (cosine decay to zero)."""
    finetune_batch_size: int = Field(128, ge=1, le=65536)
    calibration_images: int = Field(512, ge=1, le=100000)
    """Training images used to calibrate int8 activation ranges (a seeded random subset)."""
    finetune_distill: float = Field(0.5, ge=0.0, le=1.0)
    """Weight of distillation from the unpruned model during the fine-tune (KL to its softened outputs,
    temperature 2); the rest is the usual label loss. 0 = labels only."""
    student: str = ""
    """A student of another, smaller architecture (e.g. `torchvision/mobilenet_v3_small` from a resnet50 teacher),
    randomly initialised and distilled like the width student; empty = `model.name` (with `student_width`)."""

    @field_validator("student")
    @classmethod
    def _known_student(cls, name: str) -> str:
        return name and _network_name(name)

    student_width: int = Field(0, ge=0, le=1024)
    """A student network distilled from the trained model: `model.name` with this first-stage width and one
    member, trained from scratch; 0 = no student. Off by default: the width-28 student (38 % of the
    multiply-adds, 7 minutes of optimize) lost 1.55 points on the test files and 0.47 on the official test
    images, where the pruned first member (`prune_*`, the default) lost none on the official images."""
    student_epochs: int = Field(12, ge=1, le=1000)
    """Epochs the student trains, on the images the train stage learnt from (with `train.train_on_val` the
    validation split too) with the `augment` and `regularize` sections and train.amp."""
    student_lr: float = Field(0.003, gt=0.0, le=10.0)
    """Peak AdamW learning rate of the student (warm-up 20 %, cosine decay to zero, as train)."""
    student_distill: float = Field(0.7, ge=0.0, le=1.0)
    """Weight of the KL term to the trained model's softened outputs (temperature 2); the rest is the label loss."""
    parity_max_abs_diff: float = Field(1e-3, gt=0.0)
    """An exported ONNX model may differ from torch by at most this in any logit on the test images ..."""
    parity_max_rel_diff: float = Field(1e-4, ge=0.0, le=0.1)
    """... or by this fraction of the image's largest |logit| where that is more: fp32 rounding grows with the
    logits' scale (measured: 1.3e-5 of it for efficientnet_b0, whose logits reach 334 after one epoch)."""
    parity_min_top1_agreement: float = Field(0.999, ge=0.0, le=1.0)
    """... and must predict the same class as torch on at least this fraction of them."""
    int8_torch: bool = True
    """Make the PyTorch int8 variant (torchao pt2e static quantization, x86 or Arm quantizer)."""
    int8_onnx: bool = True
    """Make the ONNX Runtime int8 variants (QDQ, per-channel weights)."""
    bf16: OnOffAuto = "auto"
    """bf16 variant: `auto` only when the CPU has native bf16 (AVX512-BF16/AMX or Arm BF16), `on` always."""
    batch_size: int = Field(256, ge=1, le=65536)
    """Batch size for evaluating the variants."""
    threads: int = Field(0, ge=0, le=1024)
    """CPU threads for evaluation and fine-tuning; 0 = all cores."""
    seed: int = 0


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


class SearchRange(Section):
    """One key of `tune.space`: a range (`low`, `high`, `log`) or a list of `choices`."""

    low: float | None = Field(None, strict=False)
    high: float | None = Field(None, strict=False)
    log: bool = False
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SearchRange:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either choices (a non-empty list) or low and high, not both")
        elif self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"a range needs low < high, got low={self.low} high={self.high}")
        elif self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self


class TuneConfig(Section):
    """`pipeline tune`: an Optuna study over `space`, each trial the train stage with validation held out."""

    space: dict[str, SearchRange] = Field(
        default_factory=lambda: {
            "train.lr": SearchRange(low=0.001, high=0.01, log=True),
            "regularize.weight_decay": SearchRange(low=0.00005, high=0.005, log=True),
            "regularize.label_smoothing": SearchRange(choices=[0.0, 0.1]),
        }
    )
    """`section.key` of params.yaml -> a range or choices (checked against params' own bounds before any trial)."""
    trials: int = Field(8, ge=1, le=10000)
    """Trials of the study in all (complete or pruned), over every process and restart that shares its storage."""
    timeout_s: float = Field(0.0, ge=0.0)
    """Stop starting trials after this long (0 = no limit)."""
    epochs: int = Field(0, ge=0, le=1000)
    """Epochs per trial (0 = train.epochs)."""
    baseline: bool = True
    """A new study's first trial is params.yaml's own values of the space's keys (today's recipe, where they lie in the
    space): the study reports it beside the winner, and what it returns is never behind it on validation."""
    sampler: Literal["tpe", "random"] = "tpe"
    pruner: Literal["median", "hyperband", "none"] = "median"
    """Stops a trial whose validation accuracy at an epoch is below the median of the others' there (median), or by
    successive halving (hyperband)."""
    storage: str = ""
    """Optuna RDB storage URL (`postgresql+psycopg2://...` for the team stack's database); empty = sqlite tune.db in the
    project. $PIPELINE_TUNE_STORAGE wins. Several `pipeline tune` processes on one storage share the study."""
    study: str = ""
    """Study name; empty = `tracking.experiment` + `-tune`."""
    seed: int = 0


class Params(Section):
    recipe: str = Field(recipe_for(DEFAULT_SOURCE), min_length=1)
    """The defaults under your keys: `auto` (the data source's recipe: `photos` for a folder or CSV), a built-in
    recipe by name (pipeline/recipes/: `photos`, a network and input size for ordinary photos), or a YAML file of
    your own (params.yaml's sections) over the built-in recipe `auto` would pick. It sets the keys
    params.yaml leaves at ~. Parsed params hold the recipe that was applied."""
    name: str = Field(DATA_SOURCES[DEFAULT_SOURCE].name or "images", pattern=NAME_PATTERN)
    """Your project's name: the MLflow experiment, registered model, served model, image and container take it
    (each can still be set on its own). Empty: the data source's name for its data, else the data folder's."""
    memory_gb: float = Field(4.0, ge=0.0, le=65536.0)
    """The resident memory a stage may use on the CPU, in GB: evaluation batches larger than fit at the data's image
    size are lowered, and a training batch is stepped as micro-batches whose gradients add up (the same update).
    Logged when it happens; 0 = no limit (pipeline/machine/memory_budget.py)."""
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    augment: AugmentParams = AugmentParams()
    regularize: RegularizeParams = RegularizeParams()
    evaluate: EvaluateConfig = EvaluateConfig()
    optimize: OptimizeConfig = OptimizeConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    serve: ServeConfig = ServeConfig()
    containerize: ContainerizeConfig = ContainerizeConfig()
    deploy: DeployConfig = DeployConfig()
    monitor: MonitorConfig = MonitorConfig()
    tracking: TrackingConfig = TrackingConfig()
    tune: TuneConfig = TuneConfig()

    @model_validator(mode="before")
    @classmethod
    def _names(cls, raw: Any) -> Any:
        return with_names(raw) if isinstance(raw, dict) else raw


class ConfigError(Exception):
    """A user mistake in params.yaml: the message is meant to be shown as is, without a traceback."""


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; see params.yaml for the valid keys)"
    given = error.get("input")
    return f"{where}: {error['msg'].lower()}, got {given!r}"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def read_recipe(recipe: str, source: str = "params.yaml") -> dict[str, Any]:
    """A recipe's sections: a built-in name (pipeline/recipes/<name>.yaml) or a path to a YAML file of yours."""
    path = RECIPES_DIR / f"{recipe}.yaml" if re.fullmatch(r"[a-z0-9_-]+", recipe) else Path(recipe)
    if not path.is_file():
        raise ConfigError(
            f"{source}: recipe: {recipe!r} is neither a built-in recipe ({', '.join(recipe_names())}, auto) "
            "nor a YAML file"
        )
    try:
        layer = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path}: not valid YAML") from None
    if not isinstance(layer, dict) or {"recipe", "name"} & set(layer):
        raise ConfigError(f"{path}: a recipe is a mapping of params.yaml's sections (not recipe or name)")
    return layer


def _without_nulls(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_nulls(v) if isinstance(v, dict) else v for k, v in raw.items() if v is not None}


def _merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(under)
    for key, value in over.items():
        below = merged.get(key)
        merged[key] = _merge(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def name_of_data(source: str, root: Any) -> str:
    """A project name from the data: the source's own (DataSource.name), else the data folder's (or CSV's) name,
    skipping folder names that say nothing (train, data, images, ...)."""
    known = DATA_SOURCES.get(source)
    if known and known.name:
        return known.name
    path = Path(str(root or "")).expanduser().absolute()
    parts = [path.stem if known and known.root_is_file else path.name, *(p.name for p in path.parents)]
    for part in parts:
        slug = re.sub(r"[^a-z0-9]+", "-", part.lower()).strip("-")[:63].strip("-")
        if slug and slug not in _GENERIC_FOLDERS:
            return slug
    return "images"


def recipe_layer(recipe: str, data_source: str, source: str = "params.yaml") -> dict[str, Any]:
    """A built-in recipe's keys; a file of yours over the built-in recipe your data would get."""
    layer = _without_nulls(read_recipe(recipe, source))
    if recipe not in recipe_names():
        layer = _merge(_without_nulls(read_recipe(recipe_for(data_source), source)), layer)
    return layer


def resolve(raw: dict[str, Any], source: str = "params.yaml") -> dict[str, Any]:
    """params.yaml's keys (nulls left out) over the recipe's: what Params validates (its names: with_names)."""
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    data_source = str(data.get("source") or DEFAULT_SOURCE)
    recipe = raw.get("recipe") or "auto"
    if not isinstance(recipe, str):
        raise ConfigError(f"{source}: recipe: expected a recipe name or a YAML file, got {recipe!r}")
    if recipe == "auto":
        recipe = recipe_for(data_source)
    merged = _merge(recipe_layer(recipe, data_source, source), _without_nulls(raw))
    merged["recipe"] = recipe
    return merged


def with_names(raw: dict[str, Any]) -> dict[str, Any]:
    """`name` (else the data's name) and every empty key of NAMED_KEYS made from it."""
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    name = raw.get("name") or name_of_data(str(data.get("source") or DEFAULT_SOURCE), data.get("root"))
    named: dict[str, Any] = {**raw, "name": name}
    for (section, key), template in NAMED_KEYS.items():
        values = named.get(section)
        if values is None or isinstance(values, dict):
            values = dict(values or {})
            if not values.get(key) and isinstance(name, str):
                values[key] = template.format(name=name)
            named[section] = values
    return named


def explain(raw: Any, source: str = "params.yaml") -> list[tuple[str, Any, str]]:
    """(key, value, origin) of every key a run uses: `params.yaml`, `recipe <name>`, `name` or `default`."""
    params = parse_params(raw, source)
    given = _without_nulls(raw) if isinstance(raw, dict) else {}
    layer = recipe_layer(params.recipe, params.data.source, source)
    chosen = source if raw.get("recipe") not in (None, "auto") else f"auto, for data.source {params.data.source}"
    rows: list[tuple[str, Any, str]] = [("recipe", params.recipe, chosen)]
    rows.append(("name", params.name, source if given.get("name") else "the data"))
    for section, values in params.model_dump(mode="json", exclude={"recipe", "name"}).items():
        if not isinstance(values, dict):  # a top-level key (memory_gb)
            origin = source if section in given else f"recipe {params.recipe}" if section in layer else "default"
            rows.append((section, values, origin))
            continue
        for key, value in values.items():
            if (section, key) in NAMED_KEYS and not (given.get(section) or {}).get(key):
                origin = "name"
            elif key in (given.get(section) or {}):
                origin = source
            elif key in (layer.get(section) or {}):
                origin = f"recipe {params.recipe}"
            else:
                origin = "default"
            rows.append((f"{section}.{key}", value, origin))
    return rows


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    raw = resolve(raw, source)
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(err)}" for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_params(path: Path = Path("params.yaml")) -> Params:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (run from the project root or pass --params)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}") from None
    return parse_params(raw, str(path))
