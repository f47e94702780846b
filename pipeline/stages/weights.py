"""The weights stage: which file train will start from, and its sha256.

    model.name + model.weights (+ uv.lock) --architectures.backbones--> models/weights.json (artifacts.initial_weights)

Its record is train's dependency. The stage re-runs when `model.*` or uv.lock change (a package upgrade); train
re-runs only when the record changes, so another file re-trains and the same file does not. A file of yours is
pinned by `model.weights_sha256`. A missing file, another hash or a pickle that would run code is one line here.
"""

from __future__ import annotations

from pipeline import console
from pipeline.artifacts import initial_weights
from pipeline.config import Params
from pipeline.errors import StageError


def resolved(params: Params) -> initial_weights.InitialWeights:
    """The record of `model.weights` for `model.name` (networks of ours: `none`)."""
    from pipeline.architectures import backbones, nets

    m = params.model
    if not nets.is_backbone(m.name):
        return initial_weights.InitialWeights(network=m.name, source="none")
    try:
        info, _ = backbones.resolve(m.name, m.weights, m.weights_sha256)
    except (backbones.WeightsError, ValueError) as exc:
        raise StageError(str(exc)) from None
    return initial_weights.InitialWeights(
        network=m.name, source=info.source, file=info.file, sha256=info.sha256, license=info.license,
        mean=list(info.mean), std=list(info.std), note=info.note,
    )  # fmt: skip


def run(params: Params) -> None:
    record = resolved(params)
    initial_weights.write(record)
    where = f" {record.file} (sha256 {record.sha256[:12]})" if record.file else ""
    console.log(
        f"weights: {record.network} starts from {record.source}{where}{f'; {record.note}' if record.note else ''}"
    )
