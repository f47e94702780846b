"""`python -m benchmarks frozen-probe FOLDER [--test FOLDER]`: what a linear head on a packaged backbone's frozen
features reaches on a labelled folder (`FOLDER/<class>/<files>`), per input side and framing, with and without the
mirror images, for the weight decays train tries: each file scored once over `--folds` folds of FOLDER, or the head
trained on all of FOLDER and scored on `--test`'s files.

The bound of the photos recipe's head, beside what the pipeline serves: choose sides and framings on the folds of the
training folder (the default), and only report a held-back test folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

NETWORK = "timm/efficientnet_lite0"


def labelled_files(folder: Path) -> tuple[list[Path], list[str]]:
    """Every file of FOLDER/<class>/, in a stable order, and the class names (sorted)."""
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files = [f for c in classes for f in sorted((folder / c).iterdir()) if f.is_file()]
    return files, classes


def features(
    network: str, folders: list[list[Path]], side: int, resize: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per list of files: the frozen backbone's pooled features of each file framed as the server frames it (the
    served `Framing`), and of its mirror image. The network is built and exported once for all of them."""
    import numpy as np

    from pipeline.architectures import backbones, nets
    from pipeline.images.preprocess import Framing, peek_image
    from pipeline.training.features import cut, trunk_runner

    info, state = backbones.resolve(network, "package")
    model = nets.build(network, info.mean, info.std, side, num_classes=2)
    assert state is not None  # a package's weights are a state, never a library's own loader
    backbones.load_into(model.get_submodule("net"), state, info.file)
    framing = Framing(size=side, resize=resize, interpolation=info.interpolation)  # type: ignore[arg-type]
    run = trunk_runner(cut(model, 0).trunk, torch.zeros(1, 3, side, side, dtype=torch.uint8))
    found = []
    for files in folders:
        images = torch.from_numpy(np.stack([framing.decode(peek_image(str(f))) for f in files])).permute(0, 3, 1, 2)
        plain, mirrored = [], []
        for batch in images.split(64):
            x = batch.float() / 255
            plain.append(run(x.contiguous()))
            mirrored.append(run(x.flip(3).contiguous()))
        found.append((torch.cat(plain), torch.cat(mirrored)))
    return found


def scores(
    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], classes: int
) -> dict[str, float]:
    """Accuracy on `test` (features, labels) of a head fitted on `train` (features, mirrored, labels), per setting."""
    from pipeline.training.head import HEAD_WEIGHT_DECAYS, fit_linear, top1

    f, fm, y = train
    out = {}
    for mirrored in (False, True):
        x, labels = (torch.cat([f, fm]), torch.cat([y, y])) if mirrored else (f, y)
        for decay in HEAD_WEIGHT_DECAYS:
            head = fit_linear(x, labels, classes, decay)
            with torch.no_grad():
                out[f"{'mirrored' if mirrored else 'plain'}, decay {decay:g}"] = top1(head(test[0]), test[1])
    return out


def folds(files: list[Path], k: int) -> torch.Tensor:
    """Each file's fold, from its name's hash (the same files, the same folds)."""
    return torch.tensor([int(hashlib.sha256(f"{f.parent.name}/{f.name}".encode()).hexdigest(), 16) % k for f in files])


def probe(args: argparse.Namespace, side: int, resize: str) -> dict[str, object]:
    files, classes = labelled_files(args.folder)
    labels = torch.tensor([classes.index(f.parent.name) for f in files])
    test_files = labelled_files(args.test)[0] if args.test is not None else []
    (f, fm), *test = features(args.network, [files, test_files] if test_files else [files], side, resize)
    if test:
        test_labels = torch.tensor([classes.index(t.parent.name) for t in test_files])
        test_f = test[0][0]
        found = scores((f, fm, labels), (test_f, test_labels), len(classes))
        return {"side": side, "resize": resize, "scored": len(test_files), "trained": len(files), "accuracy": found}
    fold = folds(files, args.folds)
    right: dict[str, float] = {}
    for k in range(args.folds):
        held, kept = fold == k, fold != k
        part = scores((f[kept], fm[kept], labels[kept]), (f[held], labels[held]), len(classes))
        for setting, accuracy in part.items():
            right[setting] = right.get(setting, 0.0) + accuracy * int(held.sum())
    found = {setting: n / len(files) for setting, n in right.items()}
    return {"side": side, "resize": resize, "scored": len(files), "folds": args.folds, "accuracy": found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks frozen-probe", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="<class>/<files>: what the head learns from")
    parser.add_argument("--test", type=Path, help="a held-back <class>/<files> folder to score instead of folds")
    parser.add_argument("--network", default=NETWORK, help="a network with packaged weights")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 288])
    parser.add_argument("--resize", nargs="+", default=["center_crop"], choices=["center_crop", "stretch", "pad"])
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = [probe(args, side, resize) for side in args.sizes for resize in args.resize]
    for row in rows:
        best = max(row["accuracy"].items(), key=lambda kv: kv[1])  # type: ignore[attr-defined]
        print(f"{row['side']} px, {row['resize']}: best {best[1]:.4f} ({best[0]}) of {row['scored']} files")
    text = json.dumps(rows, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
