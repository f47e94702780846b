"""The card stage on the real stages' artifacts (tiny model): every figure equals the report it comes from."""

import json
import shutil
from collections import Counter
from pathlib import Path

import httpx
import pytest

from pipeline.artifacts import model_card
from pipeline.config import load_params
from pipeline.errors import StageError
from pipeline.stages import card
from tests.helpers.server import start_server


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_wilson_interval() -> None:
    assert model_card.wilson_interval(0, 10) == (0.0, 0.2775)
    assert model_card.wilson_interval(10, 10) == (0.7225, 1.0)
    lo, hi = model_card.wilson_interval(636, 645)
    assert lo < 636 / 645 < hi and hi - lo < 0.02


def test_card_figures_equal_the_reports_they_come_from(benchmarked_project: Path) -> None:
    p = benchmarked_project
    facts = _json(p / "reports/model_card.json")
    text = (p / "reports/model_card.md").read_text()
    evaluation = _json(p / "reports/evaluate/metrics.json")
    predictions = _json(p / "reports/evaluate/predictions.json")
    manifest = _json(p / "models/manifest.json")
    serving = _json(p / "models/serving.json")
    report = _json(p / "reports/benchmark/report.json")
    prepared = _json(p / "data/prepared/manifest.json")

    # The tiny project trains with the default train.train_on_val: the card must not call validation held out.
    assert "this model then trained on it too" in facts["data"]["validation"]
    assert "held out from this model" not in text and "this model then trained on it too" in text

    # The card describes what the server answers: evaluate measured the shipped variant (deploy reproduces its
    # predictions through the API); the trained model's figures are beside them.
    e = facts["evaluation"]
    variant = next(v for v in manifest["variants"] if v["name"] == serving["variant"])
    assert predictions["variant"] == evaluation["variant"] == variant["name"]
    labels, served = predictions["labels"], predictions["served_predicted"]
    assert e["model"] == f"the shipped variant `{variant['name']}`"
    assert (e["accuracy"], e["roi_accuracy"]) == (evaluation["accuracy"], evaluation["roi_accuracy"])
    assert e["accuracy"] == variant["served_accuracy"]  # optimize's record of the same file on the same files
    assert e["errors"] == sum(a != q for a, q in zip(labels, served, strict=True)) == evaluation["errors"]
    assert e["images"] == evaluation["images"] and e["measured_on"] == evaluation["measured_on"]
    assert (e["trained_accuracy"], e["trained_roi_accuracy"], e["trained_errors"]) == (
        evaluation["trained_accuracy"], evaluation["trained_roi_accuracy"], evaluation["trained_errors"]
    )  # fmt: skip
    assert e["accuracy_ci95"][0] <= e["accuracy"] <= e["accuracy_ci95"][1]
    support = Counter(labels)
    hits = Counter(a for a, q in zip(labels, served, strict=True) if a == q)
    assert {c["class_id"]: (c["accuracy"], c["support"]) for c in e["per_class"]} == {
        k: (hits[k] / n, n) for k, n in support.items()
    }
    ranked = sorted(support, key=lambda k: (hits[k] / support[k], -support[k]))
    assert [c["accuracy"] for c in e["worst"]] == [hits[k] / support[k] for k in ranked[: len(e["worst"])]]
    # Confusions are counted from the same predictions, with the test files that were confused.
    pairs = Counter((a, q) for a, q in zip(labels, served, strict=True) if a != q)
    names = [Path(n).name for n in prepared["test_files"]]
    classes = predictions["classes"]
    for c in e["per_class"]:
        for x in c["confused_with"]:
            q = classes.index(x["predicted"])
            assert x["count"] == pairs[(c["class_id"], q)]
            for example in x["examples"]:
                i = names.index(example)
                assert (labels[i], served[i]) == (c["class_id"], q)

    s = facts["shipped"]
    assert (s["variant"], s["size_bytes"], s["sha256"], s["served_accuracy"]) == (
        variant["name"], variant["size_bytes"], variant["sha256"], variant["served_accuracy"]
    )  # fmt: skip
    assert s["throughput_b32"] == serving["metrics"]["throughput_b32"]
    default = next(
        r for r in report["results"]
        if r["status"] == "ok" and (r["setup"]["variant"], r["setup"]["backend"], r["setup"]["setting"],
                                    r["setup"]["threads"]) == ("fp32", "torch-eager", "onednn-on", 0)
    )  # fmt: skip
    rounds = report.get("headline")
    if rounds:  # the median of the interleaved rounds, with their range: the benchmark's own figure
        assert s["speedup_vs_default_eager"] == round(rounds["median"], 2)
        assert s["speedup_range"] == [round(rounds["low"], 2), round(rounds["high"], 2)]
        assert f"{s['speedup_vs_default_eager']:.2f}× PyTorch's default eager fp32, the median of" in text
    else:
        assert s["speedup_vs_default_eager"] == round(s["throughput_b32"] / default["metrics"]["throughput_b32"], 2)
    assert report["machine"]["cpu"] in s["machine"]

    d = facts["data"]
    assert d["content_sha256"] == prepared["content_sha256"]
    assert d["split_counts"] == {k: v["count"] for k, v in prepared["splits"].items()}
    assert facts["recipe"]["train"]["epochs"] == load_params(p / "params.yaml").train.epochs

    # The Markdown shows those same figures.
    assert f"**Served accuracy {100 * e['accuracy']:.2f} %** (95 % CI" in text and e["model"] in text
    assert f"The trained model before optimisation (same inputs): {100 * e['trained_accuracy']:.2f} %" in text
    assert f"{100 * e['accuracy_ci95'][0]:.2f} % to {100 * e['accuracy_ci95'][1]:.2f} %" in text
    assert f"`{s['variant']}`" in text and d["content_sha256"] in text
    assert s["made_from"] == "The trained model's own weights." and s["made_from"] in text  # no pruning here
    for c in e["worst"]:
        assert f"| {c['class_id']} {c['name']} | {100 * c['accuracy']:.2f} % |" in text
    for mode in facts["failure_modes"]:
        assert f"- {mode}" in text


@pytest.fixture
def project_copy(benchmarked_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "project"
    shutil.copytree(benchmarked_project, work, symlinks=True)
    monkeypatch.chdir(work)
    return work


def test_a_stale_evaluation_is_refused(project_copy: Path) -> None:
    path = project_copy / "reports/evaluate/metrics.json"
    metrics = _json(path)
    metrics["accuracy"] = 1.0 - metrics["accuracy"] / 2  # no longer what predictions.json says
    path.write_text(json.dumps(metrics))
    with pytest.raises(StageError, match=r"disagree .*rerun `pipeline evaluate`"):
        card.run(load_params(project_copy / "params.yaml"))


def test_without_the_benchmarks_choice_there_is_no_card(project_copy: Path) -> None:
    (project_copy / "models/serving.json").unlink()
    with pytest.raises(StageError, match=r"serving\.json is missing"):
        card.run(load_params(project_copy / "params.yaml"))


def test_the_server_shows_the_card_of_its_variant_only(benchmarked_project: Path, tmp_path: Path) -> None:
    shipped = _json(benchmarked_project / "models/serving.json")["variant"]
    other = next(
        v["name"]
        for v in _json(benchmarked_project / "models/manifest.json")["variants"]
        if v["accepted"] and v["name"] != shipped and "onnx" in v["name"]
    )
    reports = benchmarked_project / "reports"
    server = start_server(benchmarked_project / "models", tmp_path, {"variant": shipped}, reports)
    try:
        answer = httpx.get(f"{server.url}/v1/model-card")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/markdown")
        assert answer.text == (reports / "model_card.md").read_text()
    finally:
        server.stop()
    server = start_server(benchmarked_project / "models", tmp_path, {"variant": other}, reports)
    try:
        answer = httpx.get(f"{server.url}/v1/model-card")
        assert answer.status_code == 404 and "pipeline card" in answer.json()["error"]
    finally:
        server.stop()


def test_the_card_says_how_a_pruned_network_was_made() -> None:
    """The served pruned-int8-onnx: its source chain (int8 <- ONNX <- torch) leads to the pruned network, whose
    details name which network, its channels, its share of the trained model's multiply-adds and its fine-tune."""
    from pipeline.artifacts.variants import Variant

    def variant(name: str, source: str, **details: object) -> Variant:
        return Variant(name=name, file=f"{name}.x", format="onnx", runtimes=["onnxruntime"], precision="int8",
                       accuracy=0.99, accuracy_drop=0.0016, size_bytes=1, sha256="x", parameters=1, accepted=True,
                       source=source, details=details)  # fmt: skip

    variants = [
        variant("fp32", "", macs=77_277_952),
        variant("int8-onnx", "fp32-onnx", macs=77_277_952),
        variant("fp32-onnx", "fp32", macs=77_277_952),
        variant(
            "pruned",
            "",
            prune_amount=0.125,
            prune_members=1,
            channels_after="[24, 24, 56, 56, 112, 112]",
            finetune_epochs=6,
            macs=27_136_720,
        ),
        variant("pruned-onnx", "pruned", macs=27_136_720),
        variant("pruned-int8-onnx", "pruned-onnx", macs=27_136_720),
    ]
    assert card.made_from(variants[-1], variants, 77_277_952) == (
        "Made from the trained model: its first network, pruned to [24, 24, 56, 56, 112, 112] channels (35 % of its "
        "multiply-adds), fine-tuned 6 epochs distilled from the whole model."
    )
    assert card.made_from(variants[1], variants, 77_277_952) == "The trained model's own weights."


def test_an_evaluation_of_another_file_is_refused(project_copy: Path) -> None:
    """evaluate measured an older file of the variant (optimize ran again since): the card is not made from it."""
    for name in ("metrics.json", "predictions.json"):
        path = project_copy / "reports/evaluate" / name
        record = _json(path)
        record["model_version"] = "0" * 12
        path.write_text(json.dumps(record))
    with pytest.raises(StageError, match=r"evaluate measured another .* file .*rerun `pipeline evaluate`"):
        card.run(load_params(project_copy / "params.yaml"))


def test_a_record_of_another_variant_is_refused(project_copy: Path) -> None:
    path = project_copy / "reports/evaluate/predictions.json"
    record = _json(path)
    record["variant"] = "fp32"
    path.write_text(json.dumps(record))
    with pytest.raises(StageError, match=r"disagree .*rerun `pipeline evaluate`"):
        card.run(load_params(project_copy / "params.yaml"))


def test_the_card_says_what_the_images_show_when_the_data_source_does(benchmarked_project: Path) -> None:
    """A source may describe its images (what one shows, what it was not tested on: DataSubject); a folder of yours
    is described by its classes: the card's words come from the data, not from the data set's name."""
    from pipeline.artifacts import model_card
    from pipeline.artifacts.prepared import DataSubject

    card = model_card.read(benchmarked_project / "reports" / model_card.FACTS_PATH.name)
    assert card.data.subject is None  # a CSV says nothing of what its images show
    subject = DataSubject(one="bird, centred", groups="sightings", group_is="birds", untested="night photos")
    described = card.model_copy(update={"data": card.data.model_copy(update={"subject": subject})})
    demo = model_card.render(described)
    assert "Classify a photo of one bird, centred" in demo and "not been tested on night photos" in demo
    plain = model_card.render(card)
    assert "Classify a photo of one" not in plain and "other countries" not in plain
    assert f"into one of the {card.num_classes} classes of `{card.data.dataset}`" in plain


def test_a_card_of_data_without_boxes_has_no_roi_figures(benchmarked_project: Path) -> None:
    """Photos come without object boxes: the ROI protocol is the served input itself, so the card names neither
    a ROI figure nor a framing; data with boxes keeps both."""
    facts = model_card.read(benchmarked_project / "reports" / model_card.FACTS_PATH.name)
    with_boxes = model_card.render(facts.model_copy(update={"data": facts.data.model_copy(update={"boxes": True})}))
    assert "ROI protocol" in with_boxes and "framed as" in with_boxes and ", ROI " in with_boxes
    photos = model_card.render(facts.model_copy(update={"data": facts.data.model_copy(update={"boxes": False})}))
    assert "ROI" not in photos and "framed as" not in photos and "annotated box" not in photos
    whole = {"boxes": False, "resize": "center_crop", "crop": (0.0, 0.0, 0.0, 0.0)}  # a photo folder's
    cropped = facts.model_copy(update={"data": facts.data.model_copy(update=whole)})
    assert "Without a box the server takes the central square of the image" in model_card.render(cropped)
    assert "**Served accuracy" in photos


def test_the_card_lists_only_the_settings_of_the_network_in_use(benchmarked_project: Path) -> None:
    """signnet reads width, dropout, input_norm and members; a timm network reads its weights and nothing of
    signnet's; the data is named by `name` (a photo folder's parent), not by the folder prepare read."""
    params = load_params(benchmarked_project / "params.yaml")
    ours = card._recipe(params)["model"]
    assert {"width", "dropout", "input_norm", "members"} <= set(ours)
    timm = params.model_copy(update={"model": params.model.model_copy(update={"name": "timm/efficientnet_lite0"})})
    assert set(card._recipe(timm)["model"]) == {"name", "weights", "weights_sha256"}
    arm = params.model_copy(update={"model": params.model.model_copy(update={"name": "trafficsignnet"})})
    assert set(card._recipe(arm)["model"]) == {"name", "members"}
    facts = model_card.read(benchmarked_project / "reports" / model_card.FACTS_PATH.name)
    assert facts.data.dataset == params.name
