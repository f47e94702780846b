"""Features first, for a pretrained backbone on a CPU (`train.from_pretrained: features`).

The frozen part of the network (the trunk) runs once over the training images, their mirror images and the
validation images; its activations are cached under `train.checkpoint_dir/features/`, keyed by the data's content
hash, the weights' sha256, the side and the cut, so a second run (another head, another budget) reuses them. A head
(the classifier) is then fitted on the pooled features in seconds (L-BFGS, a few weight decays and with or without
the mirror images, chosen over folds of training + validation), and in what is left of `train.max_minutes` the last
`train.tail_blocks` blocks are fine-tuned on the cached activations. The fine-tune is kept only when validation
tells it from chance (`Versus`: a best epoch a few images ahead of the head on a few hundred images is often luck);
the kept network's classifier is then refitted on training + validation with the settings the folds chose. The
result is the same one network (backbone + head), so optimize, benchmark, evaluate and the server need no other
path.

A network is cut by the first entry of `CUTS` that can cut it (a Protocol and a table: one class and one line for
another family); every network can be cut before its classifier (the head only).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import console
from pipeline.architectures.backbones import classifier_names
from pipeline.data.loader import Split, to_float
from pipeline.training.head import HEAD_FOLDS, HeadChoice, Versus, choose_head, fit_linear, top1

FEATURES_VERSION = 1  # bump when what is cached changes
BATCH = 32


@dataclass(frozen=True)
class Cut:
    """A network split where its weights stop changing: `trunk` (images in [0, 1] -> activations, frozen) and
    `tail` (activations -> logits, trained), sharing the network's own modules."""

    trunk: nn.Module
    tail: nn.Module
    pooled: Callable[[torch.Tensor], torch.Tensor]
    """The tail's input to the classifier (pooled features) for a batch of activations."""
    classifier: nn.Linear
    blocks: int
    """Blocks in the tail before the classifier (0: the classifier only)."""
    trained: tuple[nn.Module, ...] = ()
    """The modules a fine-tune of the tail trains (the classifier included)."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.trained or (self.classifier,) for p in module.parameters()]

    def state(self) -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in m.state_dict().items()} for m in self.trained or (self.classifier,)]

    def load(self, state: list[dict[str, torch.Tensor]]) -> None:
        for module, saved in zip(self.trained or (self.classifier,), state, strict=True):
            module.load_state_dict(saved)


class Cutter(Protocol):
    def __call__(self, model: nn.Module, blocks: int) -> Cut | None: ...


class _EfficientNetTrunk(nn.Module):
    net: Any  # timm's EfficientNet: its stem and blocks are read by name
    normalize: Any

    def __init__(self, model: nn.Module, blocks: int) -> None:
        super().__init__()
        self.normalize, self.net, self.blocks = model.normalize, model.net, blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        x = net.bn1(net.conv_stem(self.normalize(x)))
        for block in net.blocks[: len(net.blocks) - self.blocks]:
            x = block(x)
        return x


class _EfficientNetTail(nn.Module):
    net: Any

    def __init__(self, model: nn.Module, blocks: int) -> None:
        super().__init__()
        self.net, self.blocks = model.net, blocks

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        for block in net.blocks[len(net.blocks) - self.blocks :]:
            x = block(x)
        return net.forward_head(net.bn2(net.conv_head(x)), pre_logits=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.get_classifier()(self.pooled(x))


def cut_timm_efficientnet(model: nn.Module, blocks: int) -> Cut | None:
    """timm's EfficientNet family (efficientnet_*, efficientnet_lite*, mnasnet, mobilenetv2): its last `blocks`
    stages of `net.blocks` and `conv_head` train; None for another network or `blocks` 0."""
    net: Any = getattr(model, "net", None)
    if blocks < 1 or type(net).__name__ != "EfficientNet" or not hasattr(net, "conv_head"):
        return None
    blocks = min(blocks, len(net.blocks))
    tail = _EfficientNetTail(model, blocks)
    classifier = net.get_classifier()
    trained = (*net.blocks[len(net.blocks) - blocks :], net.conv_head, net.bn2, classifier)
    return Cut(_EfficientNetTrunk(model, blocks), tail, tail.pooled, classifier, blocks, trained)


def cut_before_classifier(model: nn.Module, blocks: int) -> Cut | None:
    """Any network whose classifier is one Linear: the trunk is a copy whose classifier passes its input on."""
    names = classifier_names(getattr(model, "net", model))
    net = getattr(model, "net", model)
    classifier = net.get_submodule(names[0]) if names else None
    if not isinstance(classifier, nn.Linear):
        return None
    trunk = copy.deepcopy(model)
    trunk.get_submodule("net" if hasattr(model, "net") else "").set_submodule(names[0], nn.Identity())
    return Cut(trunk, classifier, lambda x: x, classifier, 0)


CUTS: tuple[Cutter, ...] = (cut_timm_efficientnet, cut_before_classifier)


def cut(model: nn.Module, blocks: int) -> Cut:
    for cutter in CUTS:
        found = cutter(model, blocks)
        if found is not None:
            return found
    raise ValueError(
        f"{type(model).__name__}: no cut in training.features.CUTS fits it (its classifier is not one Linear)"
    )


# ------------------------------------------------------------------------------------------ activations


@dataclass(frozen=True)
class Activations:
    """The trunk's outputs (float16) for the images a features run learns from."""

    train: torch.Tensor
    train_mirrored: torch.Tensor
    val: torch.Tensor
    val_mirrored: torch.Tensor


def cache_key(data_sha256: str, weights_sha256: str, network: str, side: int, blocks: int) -> str:
    blob = f"{FEATURES_VERSION}|{data_sha256}|{weights_sha256}|{network}|{side}|{blocks}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_activations(
    folder: Path, key: str, trunk: nn.Module, train: Split, val: Split, keep: int = 2
) -> tuple[Activations, bool]:
    """The trunk's activations of `train` and `val` (each also mirrored), from `folder/<key>.pt` when there, else
    computed and saved there (atomically; older keys beyond `keep` removed). Returns them and whether cached."""
    path = folder / f"{key}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            return Activations(**saved), True
        except Exception as exc:  # a truncated or foreign file: computed again, said so
            console.log(f"features: {path} unreadable ({type(exc).__name__}); computing them again")
    run = trunk_runner(trunk, train.images[:1])
    acts = Activations(
        _run(run, train, False, "train"), _run(run, train, True, "train, mirrored"),
        _run(run, val, False, "val"), _run(run, val, True, "val, mirrored"),
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(vars(acts), tmp)
    tmp.replace(path)
    for old in sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)[keep:]:
        old.unlink(missing_ok=True)
    return acts, False


def _run(run: Callable[[torch.Tensor], torch.Tensor], split: Split, mirrored: bool, what: str) -> torch.Tensor:
    out = []
    for start in console.progress(range(0, len(split), BATCH), -(-len(split) // BATCH), f"features: {what}"):
        x = to_float(split.images[start : start + BATCH])
        out.append(run(x.flip(3) if mirrored else x).half())
    return torch.cat(out) if out else torch.empty(0)


def trunk_runner(trunk: nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The frozen trunk as a function: through ONNX Runtime where it exports (2-3x PyTorch's eager on a CPU for
    depthwise networks), else PyTorch's eager in inference mode."""
    trunk.eval()
    try:
        return _onnx_runner(trunk, to_float(example))
    except Exception as exc:  # an operator the exporter lacks: the same numbers, slower
        console.log(f"features: the trunk does not export to ONNX ({type(exc).__name__}); running it in PyTorch")

    def eager(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return trunk(x)

    return eager


def _onnx_runner(trunk: nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    import warnings

    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            trunk, (example.contiguous(),), dynamo=True, external_data=False, verbose=False,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        )  # fmt: skip
    assert program is not None  # dynamo=True returns the program
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.contiguous().numpy()})[0])


# ------------------------------------------------------------------------------------------------ fit


@dataclass(frozen=True)
class Outcome:
    """What a features run did, for train's report, the MLflow run and the model card."""

    kept: str
    """`head` (the classifier on frozen features) or `tail` (the last blocks fine-tuned too)."""
    head: HeadChoice
    tail_blocks: int
    tail_epochs: int
    tail_val_accuracy: float | None
    """The fine-tune's best validation accuracy (None: none ran)."""
    against_head: Versus | None
    """The fine-tune's best epoch against the head, image by image on validation (None: none ran)."""
    val_accuracy: float
    """The kept network's validation accuracy (before the head's refit on training + validation)."""
    refit_on_val: bool
    history: tuple[tuple[float, float], ...]
    """Each fine-tune epoch's (mean training loss, validation accuracy)."""
    cached: bool
    """The activations came from the cache."""
    feature_seconds: float
    fit_seconds: float

    def describe(self, side: int) -> str:
        """One sentence: what was trained, at which side, and why."""
        head = (
            f"a head fitted on the frozen backbone's features of {side} px images "
            f"({'with' if self.head.mirrored else 'without'} mirror images, weight decay {self.head.weight_decay:g}, "
            f"chosen over {HEAD_FOLDS} folds of training + validation: {self.head.folds_accuracy:.4f}; "
            f"validation {self.head.val_accuracy:.4f})"
        )
        refit = "; then its classifier refitted on training + validation" if self.refit_on_val else ""
        if self.kept == "tail":
            return (f"{head}, then its last {self.tail_blocks} block(s) fine-tuned for {self.tail_epochs} epoch(s), "
                    f"kept: validation {self.tail_val_accuracy:.4f} ({self.against_head and self.against_head.describe()})"
                    f"{refit}")  # fmt: skip
        why = (
            "no block was fine-tuned (train.tail_blocks 0, or no cut splits this network)" if self.tail_blocks == 0
            else "no time was left for a fine-tune" if self.tail_val_accuracy is None or self.against_head is None
            else f"a fine-tune of the last {self.tail_blocks} block(s) for {self.tail_epochs} epoch(s) reached "
            f"{self.tail_val_accuracy:.4f} on validation, not better beyond chance ({self.against_head.describe()})"
        )  # fmt: skip
        return f"{head}, kept: {why}{refit}"


def pooled_features(the_cut: Cut, acts: torch.Tensor, batch: int = 256) -> torch.Tensor:
    was = the_cut.tail.training
    the_cut.tail.eval()
    with torch.no_grad():
        out = [the_cut.pooled(acts[i : i + batch].float()) for i in range(0, len(acts), batch)]
    the_cut.tail.train(was)
    return torch.cat(out)


@dataclass(frozen=True)
class TailSettings:
    """How the tail is fine-tuned on the cached activations."""

    lr: float
    weight_decay: float
    label_smoothing: float
    max_epochs: int
    batch_size: int = 64
    seed: int = 0


@dataclass(frozen=True)
class TailResult:
    """A fine-tune of the tail: its best epoch on validation, and every epoch's figures."""

    val_accuracy: float
    history: list[tuple[float, float]]
    """Each epoch's (mean training loss, validation accuracy)."""
    state: list[dict[str, torch.Tensor]] | None
    """The best epoch's tail state (None: no epoch fitted)."""
    right: torch.Tensor
    """The best epoch's answers on validation, image by image: right or wrong."""


def fine_tune_tail(
    the_cut: Cut, acts: Activations, labels: tuple[torch.Tensor, torch.Tensor], seconds: float, s: TailSettings
) -> TailResult:
    """AdamW on the tail over the cached (and mirrored) training activations, epoch after epoch while the next
    fits in `seconds` (at the pace of the last), BatchNorm statistics re-estimated before each validation."""
    train_labels, val_labels = labels
    x = torch.cat([acts.train, acts.train_mirrored])
    y = torch.cat([train_labels, train_labels])
    optim = torch.optim.AdamW(the_cut.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    generator = torch.Generator().manual_seed(s.seed)
    deadline, epoch_seconds = time.perf_counter() + seconds, 0.0
    best = TailResult(-1.0, [], None, torch.zeros(len(val_labels), dtype=torch.bool))
    history: list[tuple[float, float]] = []
    while len(history) < s.max_epochs and time.perf_counter() + epoch_seconds < deadline:
        began, total = time.perf_counter(), 0.0
        the_cut.tail.train()
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), s.batch_size):
            rows = order[start : start + s.batch_size]
            loss = F.cross_entropy(the_cut.tail(x[rows].float()), y[rows], label_smoothing=s.label_smoothing)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            total += float(loss.detach()) * len(rows)
        precise_batchnorm(the_cut, acts.train)
        the_cut.tail.eval()
        with torch.no_grad():
            logits = torch.cat([the_cut.tail(v.float()) for v in acts.val.split(256)])
        score = top1(logits, val_labels)
        history.append((total / len(x), score))
        epoch_seconds = time.perf_counter() - began
        console.log(f"features: tail epoch {len(history)}: loss {total / len(x):.4f}, validation {score:.4f} "
                    f"({epoch_seconds:.0f} s)")  # fmt: skip
        if score > best.val_accuracy:
            best = TailResult(score, history, the_cut.state(), logits.argmax(1) == val_labels)
    return dataclasses.replace(best, history=history)


@torch.no_grad()
def precise_batchnorm(the_cut: Cut, acts: torch.Tensor, batch: int = 256) -> None:
    """The tail's BatchNorm statistics as the plain average over `acts`: what validation and serving will use."""
    norms = [m for t in the_cut.trained for m in t.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    the_cut.tail.train()
    for start in range(0, len(acts), batch):
        the_cut.tail(acts[start : start + batch].float())
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum


@dataclass(frozen=True)
class FeaturesRun:
    """One features run's inputs besides the network."""

    cache: Path
    key: str
    classes: int
    seconds: float
    """What the run may spend (train.max_minutes), features included; 0: no fine-tune."""
    tail: TailSettings
    refit_on_val: bool


def fit(model: nn.Module, blocks: int, train: Split, val: Split, run: FeaturesRun) -> Outcome:
    """`model`'s head (and, where validation prefers it, its last `blocks` blocks) trained in place."""
    began = time.perf_counter()
    the_cut = cut(model, blocks)
    acts, cached = cached_activations(run.cache, run.key, the_cut.trunk, train, val)
    feature_seconds = time.perf_counter() - began
    console.log(f"features: {'reused from the cache' if cached else 'computed'} in {feature_seconds:.0f} s ({run.key})")
    feats = {name: pooled_features(the_cut, a) for name, a in vars(acts).items()}
    choice, head = choose_head(feats, train.labels, val.labels, run.classes)
    the_cut.classifier.load_state_dict(head.state_dict())
    console.log(f"features: head fitted, {HEAD_FOLDS} folds {choice.folds_accuracy:.4f}, validation "
                f"{choice.val_accuracy:.4f} (weight decay {choice.weight_decay:g}, mirror images "
                f"{'in' if choice.mirrored else 'out'})")  # fmt: skip
    before = the_cut.state()
    left = run.seconds - (time.perf_counter() - began)
    tuned = fine_tune_tail(the_cut, acts, (train.labels, val.labels), left, run.tail) if the_cut.blocks else None
    versus, kept = None, before
    if tuned is not None and tuned.state is not None:
        with torch.no_grad():
            versus = Versus.of(head(feats["val"]).argmax(1) == val.labels, tuned.right, len(tuned.history))
        kept = tuned.state if versus.tail_wins else before
    kept_tail = kept is not before
    the_cut.load(kept)
    if run.refit_on_val:  # the kept network's classifier learns from validation too, with the settings it chose
        if kept_tail:
            feats = {name: pooled_features(the_cut, a) for name, a in vars(acts).items()}
        _refit(the_cut, feats, train.labels, val.labels, run.classes, choice)
    return Outcome(
        kept="tail" if kept_tail else "head", head=choice, tail_blocks=the_cut.blocks,
        tail_epochs=len(tuned.history) if tuned else 0,
        tail_val_accuracy=tuned.val_accuracy if tuned and tuned.history else None, against_head=versus,
        val_accuracy=tuned.val_accuracy if kept_tail and tuned else choice.val_accuracy,
        refit_on_val=run.refit_on_val, history=tuple(tuned.history) if tuned else (), cached=cached,
        feature_seconds=feature_seconds, fit_seconds=time.perf_counter() - began - feature_seconds,
    )  # fmt: skip


def _refit(
    the_cut: Cut, feats: dict[str, torch.Tensor], train_labels: torch.Tensor, val_labels: torch.Tensor,
    classes: int, choice: HeadChoice,
) -> None:  # fmt: skip
    """The head fitted again on training + validation with the settings validation chose."""
    names = ("train", "val", "train_mirrored", "val_mirrored") if choice.mirrored else ("train", "val")
    labels = [train_labels, val_labels] * (2 if choice.mirrored else 1)
    head = fit_linear(torch.cat([feats[n] for n in names]), torch.cat(labels), classes, choice.weight_decay)
    the_cut.classifier.load_state_dict(head.state_dict())
