"""The sections of params.yaml that make the model: prepare (`data`), the network (`model`), `train`, `augment`,
`regularize`, `evaluate`, `optimize`, `tracking` and `tune`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.data.sources import DATA_SOURCES, DEFAULT_SOURCE
from pipeline.params.base import AmpMode, OnOffAuto, PathField, Section, network_name


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


class ModelConfig(Section):
    """The network, built by name: ours from pipeline/architectures/ (one module each), torchvision's and timm's
    through pipeline/architectures/backbones.py, or a function in a file of your project."""

    name: str = Field("signnet", min_length=1)
    """`signnet`: the demo's compact CNN; `trafficsignnet`: Arm's learning-path reference network (ours: one file
    each in pipeline/architectures/); `torchvision/<arch>`: any classification builder of torchvision.models
    (resnet18, mobilenet_v3_small, efficientnet_b0, convnext_tiny, ...); `timm/<arch>`: any timm.create_model name;
    `path/to/file.py:function`: a network of your project (docs/extending.md). The classifier is sized from the
    data's classes."""

    @field_validator("name")
    @classmethod
    def _known_network(cls, name: str) -> str:
        return network_name(name)

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
    reported per epoch); with it on there is no held-out validation figure (`val_accuracy` is null). Why on: a
    look that only a validation group holds is otherwise never learnt, however often the test images show it
    (docs/results.md, the recipe section, has the case)."""
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
    fine-tunes the last `tail_blocks` blocks on the cached activations in what is left of `max_minutes`, kept only
    when validation tells it from chance (pipeline/training/head.py); with `train_on_val` the kept network's
    classifier is then refitted on training + validation (pipeline/training/features.py). The right first step on a CPU.
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


class OptimizeConfig(Section):
    """The optimize stage: which variants of the trained model to make and the gates they must pass."""

    max_accuracy_drop: float = Field(0.005, ge=0.0, le=1.0)
    """Accept a variant only when its top-1 on the gate's images (the served test files, plus validation framed
    as served when the trained model held it out) is at most this below the fp32 model's (0.005 = 0.5 points)."""
    prune_amount: float = Field(0.125, ge=0.0, lt=1.0)
    """Fraction of the filters removed from every convolution (whole filters, smallest norm with the following
    BatchNorm's scale folded in; then `prune_multiple`); 0 = no pruning. The default, with `prune_members: 1`,
    keeps the largest network of multiples of 8 under 40 % of the committee's multiply-adds: distilled from the
    committee (`finetune_epochs`), it serves faster at the committee's accuracy (docs/results.md, "The smaller
    served model", has the figures)."""
    prune_norm: Literal["l1", "l2"] = "l1"
    """Norm that ranks the filters of a convolution for pruning."""
    prune_members: int = Field(1, ge=0, le=64)
    """A committee keeps only its first this-many members before pruning (0 = all of them): one network runs
    faster per multiply-add than a committee of small ones: a committee's networks run one after the other, and
    narrow layers use the int8 kernels poorly (docs/results.md, "The smaller served model")."""
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
        return name and network_name(name)

    student_width: int = Field(0, ge=0, le=1024)
    """A student network distilled from the trained model: `model.name` with this first-stage width and one
    member, trained from scratch; 0 = no student. Off by default: a student starts from random weights and loses
    accuracy that the pruned first member (`prune_*`, the default), which starts from trained ones, keeps
    (docs/results.md, "The smaller served model")."""
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
    logits' scale, so a network with large logits needs a bound relative to them."""
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
