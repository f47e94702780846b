"""What a training run starts from: the prepared data (here or on the DVC remote), and the network with its initial
weights, checked before any process takes a step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from pipeline import console
from pipeline.architectures import backbones, nets
from pipeline.architectures.backbones import WeightsInfo
from pipeline.artifacts import initial_weights as weights_record
from pipeline.artifacts.prepared import (
    PREPARED_DIR,
    DvcRemoteFiles,
    Files,
    PreparedManifest,
    SplitReader,
    read_manifest,
)
from pipeline.config import Params
from pipeline.errors import StageError


def prepared_files(data_from: str) -> Path | Files:
    """data/prepared here, or as dvc.lock records it on the DVC remote (`train.data_from`)."""
    if data_from == "dvc-remote":
        try:
            return DvcRemoteFiles(".")
        except Exception as exc:  # not a DVC repository, no remote configured: DVC's own message, in one line
            raise StageError(f"train.data_from: dvc-remote: {type(exc).__name__}: {exc}") from None
    return PREPARED_DIR


def check_inputs(params: Params) -> PreparedManifest:
    """The prepared manifest, after checking that the training and validation shards are all there, whole (one
    line naming a missing or truncated one before any process starts)."""
    prepared = prepared_files(params.train.data_from)
    manifest = read_manifest(prepared)
    for split in ("train", "val"):
        SplitReader(split, prepared).close()
    return manifest


def initial_weights(params: Params) -> tuple[WeightsInfo | None, dict[str, torch.Tensor] | None]:
    """A torchvision/timm network's initial weights (`model.weights`), checked before any training step: an
    unknown network, a missing file, another hash or a pickle that would run code is one line (StageError)."""
    m = params.model
    if not nets.is_backbone(m.name):
        if m.weights not in ("none", "auto"):
            raise StageError(f"model.weights is {m.weights!r}, but {m.name} has no pretrained weights: use none")
        return None, None
    try:
        return backbones.resolve(m.name, m.weights, m.weights_sha256)
    except (backbones.WeightsError, ValueError) as exc:
        raise StageError(str(exc)) from None


def starting_weights(
    params: Params, manifest: PreparedManifest, main: bool
) -> tuple[WeightsInfo | None, dict[str, torch.Tensor] | None]:
    """initial_weights, checked to fit the network and to be what the weights stage recorded, and said (the main
    process: where they came from; a loud warning for random weights): every path of the stage starts here."""
    weights, state = initial_weights(params)  # a bad name or weights file: one line, before any process starts
    if state is not None:
        build_model(params, manifest, weights, state)  # tensors that do not fit: the same, before any step
    if main and weights is not None and weights.source == "random":
        console.log(
            f"WARNING {params.model.name}: no pretrained weights could be had, training from RANDOM weights "
            f"(model.weights auto: {weights.note}); the model card says so"
        )
    elif main and weights is not None:
        console.log(
            f"{params.model.name}: weights {weights.source}"
            + (f" ({weights.file}, sha256 {weights.sha256[:12]})" if weights.file else "")
        )
    check_recorded(weights)
    return weights, state


def check_recorded(weights: WeightsInfo | None) -> None:
    """The weights stage's record (models/weights.json), when there, names the file train resolved: else the
    file changed between the two, and DVC would not know what train started from."""
    if weights is None or not weights_record.WEIGHTS_PATH.is_file():
        return
    recorded = weights_record.read()
    if recorded.sha256 != weights.sha256:
        raise StageError(
            f"{weights_record.WEIGHTS_PATH} records {recorded.source} weights (sha256 {recorded.sha256[:12] or '-'}), "
            f"but train resolved {weights.source} (sha256 {weights.sha256[:12] or '-'}): run `dvc repro` (or "
            "`pipeline weights`) so the record names what train starts from"
        )


def model_arch(params: Params, manifest: PreparedManifest, weights: WeightsInfo | None = None) -> dict[str, object]:
    """The network's description, saved with the weights: the one record both building and loading use (a
    torchvision/timm network's also says where its initial weights came from and the input they expect)."""
    m = params.model
    members = nets.trained_members(m.name, m.members)
    arch = nets.arch_kwargs(
        m.name, manifest.image_size, m.width, m.dropout, len(manifest.classes), m.input_norm, members
    )
    if weights is not None:
        arch["weights"] = weights.record()
    return arch


def input_stats(manifest: PreparedManifest, weights: WeightsInfo | None) -> tuple[list[float], list[float]]:
    """The mean/std the network normalises with: pretrained weights' own (what they learned on), else the
    training split's."""
    if weights is None or weights.source == "none":
        return list(manifest.mean), list(manifest.std)
    return list(weights.mean), list(weights.std)


def build_model(
    params: Params,
    manifest: PreparedManifest,
    weights: WeightsInfo | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The network to train, with its initial weights loaded into every member (the classifier stays fresh)."""
    mean, std = input_stats(manifest, weights)
    model = nets.build_from_arch(model_arch(params, manifest, weights), mean, std)
    if state is not None and weights is not None:
        members = list(model.members) if isinstance(model, nets.Committee) else [model]
        for member in members:
            try:
                backbones.load_into(member.net, state, weights.file)  # type: ignore[arg-type]
            except backbones.WeightsError as exc:
                raise StageError(str(exc)) from None
    return model
