"""The real `dvc repro` on a copy of the project: caching, and re-running when a param changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.artifacts.prepared import read_split
from tests.helpers import DATA_ROOT_ENVS, REPO
from tests.helpers.project import GIT_IDENTITY, make_project, run, run_dvc_queue, tiny_pipeline_params

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    return make_project(tmp_path)


def test_repro_prepare_caches_and_reruns_on_param_change(project: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    work, env = project
    dvc = [sys.executable, "-m", "dvc"]
    first = run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" in first
    assert (work / "data/prepared/train/images-00000.npy").is_file()

    second = run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" not in second
    assert "didn't change" in second

    params = yaml.safe_load((work / "params.yaml").read_text())
    params["data"]["image_size"] = 24
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    status = run([*dvc, "status", "prepare"], work, env)
    assert "modified" in status and "data" in status  # dvc.yaml tracks the whole data section
    third = run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" in third

    assert read_split("test", work / "data/prepared").images.shape[1:] == (24, 24, 3)
    metrics = run([*dvc, "metrics", "show"], work, env)
    assert "test_images" in metrics


def test_the_raw_data_is_a_dependency_one_added_image_reruns_prepare(
    project: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A user's folder (a real data set, not the demo's): after `dvc repro prepare`, adding one image, then
    changing one, makes `dvc status` report prepare changed, and `dvc repro` re-runs it on the new data."""
    from PIL import Image

    from tests.helpers.digits import write_digits_folder

    work, env = project
    env = {k: v for k, v in env.items() if k not in DATA_ROOT_ENVS}
    digits = write_digits_folder(tmp_path / "digits")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["data"].update({"source": "folder", "root": str(digits), "download": False, "image_size": 8})
    params["tracking"]["enabled"] = False
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    dvc = [sys.executable, "-m", "dvc"]
    run([*dvc, "repro", "prepare"], work, env)
    assert "Data and pipelines are up to date" in run([*dvc, "status", "prepare"], work, env)

    def images() -> int:
        manifest = yaml.safe_load((work / "data/prepared/manifest.json").read_text())
        return sum(int(split["count"]) for split in manifest["splits"].values())

    before = images()
    added = Image.open(digits / "3" / sorted(os.listdir(digits / "3"))[0]).copy()
    added.putpixel((0, 0), 128)  # a new image, not a byte-equal copy (prepare leaves those out)
    added.save(digits / "3" / "added.png")
    status = run([*dvc, "status", "prepare"], work, env)
    assert "changed deps" in status and str(digits) in status, status
    assert "Running stage 'prepare'" in run([*dvc, "repro", "prepare"], work, env)
    assert images() == before + 1
    assert "Data and pipelines are up to date" in run([*dvc, "status", "prepare"], work, env)

    one = digits / "7" / sorted(os.listdir(digits / "7"))[0]  # a changed image (relabelled pixels): stale again
    Image.new("L", (8, 8), 255).save(one)
    assert "changed deps" in run([*dvc, "status", "prepare"], work, env)
    assert "Running stage 'prepare'" in run([*dvc, "repro", "prepare"], work, env)


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the project's git checkout")
def test_every_dvc_output_is_git_ignored_and_the_folders_exist() -> None:
    """Data, weights and reports never reach git: every path dvc.yaml writes is ignored, except the stages'
    small metrics files (DVC experiments carry them, so `dvc exp show` compares runs), while data/ and models/
    themselves (with their READMEs) are part of the checkout."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outputs: set[str] = set()
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                outputs.add(next(iter(entry)) if isinstance(entry, dict) else entry)
    assert {"data/prepared", "models/model.pt", "models/variants"} <= outputs
    probe = subprocess.run(
        ["git", "check-ignore", "--no-index", *sorted(outputs)], cwd=REPO, capture_output=True, text=True
    )
    metrics = {path for path in outputs if path.startswith("reports/") and path.endswith("/metrics.json")}
    assert len(metrics) == 7
    assert set(probe.stdout.split()) == outputs - metrics
    tracked = subprocess.run(["git", "ls-files", "data", "models"], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout.split() == ["data/README.md", "models/README.md"]


PIPELINE_TO_CARD = ("prepare", "train", "optimize", "benchmark", "evaluate", "card")


def _what_the_server_would_serve(work: Path) -> str:
    """The server's own loading code in `work`: the variant it serves, or its one-line refusal. It must never
    serve a file other than the one the benchmark measured."""
    from pipeline.artifacts import serving as serving_file
    from pipeline.config import ServeConfig
    from pipeline.errors import StageError
    from pipeline.serve.model import load_served_model

    try:
        model = load_served_model(work / "models", ServeConfig())
    except StageError as exc:
        return f"refused: {exc}"
    choice = serving_file.read(work / "models")
    assert choice is not None and model.variant == choice.variant and choice.sha256.startswith(model.version)
    return f"serves {model.variant} {model.version}"


@pytest.mark.slow
def test_the_tuned_winner_in_one_command_then_kill_9_in_every_stage_then_repro_completes(
    project: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A user's first complete run is the tuned winner: `pipeline tune`, then the documented
    `dvc exp run $(cat reports/tune/best.args) card`, whose best values land in the experiment's params and every
    stage to the card runs with them. Then a param change (so a previous choice and model exist, as in real use) and
    kill -9 of the whole `dvc repro` process group at a random moment of each stage in turn; after every kill the
    server either refuses with one line or serves exactly the file the benchmark measured (a kill during DVC's own
    write of dvc.lock leaves that file cut short: restored from git, as docs/getting-started.md says); then `dvc
    repro` completes, nothing is left behind, and DVC sees everything up to date."""
    import queue
    import random
    import signal
    import threading
    import time

    work, env = project
    env = dict(env, **GIT_IDENTITY)
    tiny_pipeline_params(work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["tune"].update({"trials": 2, "epochs": 2, "space": {"train.lr": {"choices": [0.01, 0.003]}}})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run(["git", "add", "-A"], work, env)
    run(["git", "commit", "-qm", "baseline"], work, env)
    dvc = [sys.executable, "-m", "dvc"]
    run([*dvc, "repro", "prepare"], work, env)
    run([sys.executable, "-m", "pipeline.cli", "tune"], work, env)
    best = yaml.safe_load((work / "reports/tune/best.yaml").read_text())
    args = (work / "reports/tune/best.args").read_text().split()
    assert args == ["-S", f"train.lr={best['train.lr']}"]
    run([*dvc, "exp", "run", *args, "card"], work, env)  # the complete run: the tuned winner, in one command
    assert yaml.safe_load((work / "params.yaml").read_text())["train"]["lr"] == best["train.lr"]
    assert (work / "reports/model_card.md").is_file() and (work / "models/serving.json").is_file()
    assert f'"lr": {best["train.lr"]}' in run([*dvc, "exp", "show", "--json"], work, env)
    before = _what_the_server_would_serve(work)
    assert before.startswith("serves "), before
    run(["git", "add", "dvc.yaml", "dvc.lock", "params.yaml", ".gitignore"], work, env)  # as users commit a run
    run(["git", "commit", "-qm", "a run"], work, env)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["train"]["seed"] = 1  # another model: every stage from train on reruns
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    rng = random.Random(7)
    killed_in: list[str] = []
    lock_cut_short: list[str] = []
    served_after_kill: list[str] = []
    for target in PIPELINE_TO_CARD[1:]:
        proc = subprocess.Popen([*dvc, "repro", "card"], cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()

        def pump(stream: object = proc.stdout, sink: queue.Queue[str | None] = lines) -> None:
            for line in stream:  # type: ignore[attr-defined]
                sink.put(line)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        running = None
        while running is None:
            line = lines.get(timeout=600)
            if line is None:
                break
            for stage in PIPELINE_TO_CARD[PIPELINE_TO_CARD.index(target) :]:
                if f"Running stage '{stage}'" in line:
                    running = stage
        if running is None:  # the chain finished before reaching the target: nothing left to kill
            proc.wait(timeout=60)
            break
        time.sleep(rng.uniform(0.2, 3.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        killed_in.append(running)
        status = subprocess.run([*dvc, "status", "card"], cwd=work, env=env, capture_output=True, text=True)
        if "dvc.lock' validation failed" in status.stdout + status.stderr:
            # DVC rewrites dvc.lock in place: a kill during that write leaves it cut short; the documented fix
            lock_cut_short.append(running)
            run(["git", "checkout", "--", "dvc.lock"], work, env)
        served_after_kill.append(_what_the_server_would_serve(work))
    assert len(killed_in) >= 3, killed_in

    final = run([*dvc, "repro", "card"], work, env)
    assert "Running stage 'card'" in final or "didn't change" in final
    assert "Data and pipelines are up to date" in run([*dvc, "status", "card"], work, env)
    after = _what_the_server_would_serve(work)
    assert after.startswith("serves ") and after != before  # the new model, measured
    for refusal in (s for s in served_after_kill if s.startswith("refused")):
        assert "\n" not in refusal and ("run " in refusal.lower() or "rerun" in refusal.lower()), refusal
    leftovers = [p for d in ("data", "models", "reports") for p in (work / d).rglob("*")
                 if ".tmp" in p.name or p.name.startswith(".prepared-") or p.name == "variants.staging"]  # fmt: skip
    assert not leftovers, leftovers
    print(f"killed in {killed_in} (dvc.lock cut short in {lock_cut_short});",
          f"the server after each kill: {[s[:90] for s in served_after_kill]}")  # fmt: skip


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "through"),
    [("torchvision/mobilenet_v3_small", "card"), ("timm/mobilenetv3_small_050", "optimize")],
)
def test_your_own_model_on_your_own_photos_through_the_pipeline(
    project: tuple[Path, dict[str, str]], tmp_path: Path, real_photo_folder: Path, name: str, through: str
) -> None:
    """Only params changed: a 6-class folder of real photos (JPEG and PNG, several sizes, some greyscale), padded
    to squares, a library network with weights from a local .safetensors file: `dvc repro` runs through optimize
    (each library's network: the weights load, it trains, Torch-Pruning prunes it and it exports to ONNX) and, for
    one of them, on through the card (what follows optimize reads ONNX files, whatever network made them):
    `pipeline serve` answers with the folder's class names, evaluate measured those answers, and the card names the
    network and the weights' sha256."""
    import json

    import httpx
    from safetensors.torch import save_file

    from pipeline.architectures.backbones import library_network, sha256_of
    from pipeline.serve.client import predict_files
    from tests.helpers.server import start_server

    work, env = project
    photos = real_photo_folder
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in library_network(name, 1000).state_dict().items()}, str(weights))
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["data"].update({"source": "folder", "root": str(photos), "download": False, "image_size": 48,
                           "resize": "pad"})  # fmt: skip
    params["model"].update({"name": name, "weights": str(weights), "members": 1})
    params["train"].update({"epochs": 2, "batch_size": 32, "checkpoint_every": 0, "nproc": 1})
    params["augment"].update({"hflip": True, "random_resized_crop": 0.6})
    params["evaluate"].update({"min_accuracy": 0.0, "max_drop": 1.0})  # plumbing: two epochs, one fine-tune epoch
    params["optimize"].update({"prune_amount": 0.25, "finetune_epochs": 1, "int8_torch": False,
                               "calibration_images": 64, "max_accuracy_drop": 1.0})  # fmt: skip
    params["benchmark"].update({"threads": [0], "batch_sizes": [32], "min_seconds": 0.05, "latency_calls": 5,
                                "warmup": 1, "backends": ["onnxruntime"], "max_accuracy_drop": 1.0,
                                "profile": False})  # fmt: skip
    params["tracking"]["enabled"] = False
    params["serve"]["model_name"] = "signs"
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run([sys.executable, "-m", "dvc", "repro", through], work, env, timeout=1500)

    classes = sorted(folder.name for folder in photos.iterdir())
    manifest = json.loads((work / "models/manifest.json").read_text())
    assert manifest["architecture"] == name and manifest["classes"] == classes
    assert manifest["preprocess"]["resize_mode"] == "pad"
    assert manifest["initial_weights"]["sha256"] == sha256_of(weights)
    pruned = next(v for v in manifest["variants"] if v["name"] == "pruned")
    assert (
        pruned["accepted"]
        and pruned["details"]["macs"]
        < 0.9 * next(v for v in manifest["variants"] if v["name"] == "fp32")["details"]["macs"]
    )
    if through == "optimize":
        return
    card = (work / "reports/model_card.md").read_text()  # (a network's container and deploy: the digits folder's test)
    assert f"`{name}`" in card and sha256_of(weights) in card
    server = start_server(
        work / "models", tmp_path, {"model_name": "signs", "variant": "auto", "max_body_bytes": 1 << 23}
    )
    try:
        assert httpx.get(f"{server.url}/v2/models/signs").json()["parameters"]["classes"] == classes
        prepared = json.loads((work / "data/prepared/manifest.json").read_text())
        files = [(work / "data/prepared" / file).read_bytes() for file in prepared["test_files"]]
        answers = predict_files(server.url, files, "png")
        evaluated = json.loads((work / "reports/evaluate/predictions.json").read_text())
        assert evaluated["served_predicted"] == answers  # evaluate measured what the server answers, file for file
        one = next((photos / classes[0]).glob("*.jpg"))
        named = httpx.post(f"{server.url}/v1/predict", files={"files": (one.name, one.read_bytes())}).json()
        assert {entry["name"] for entry in named["predictions"][0]["top_k"]} <= set(classes)
    finally:
        server.stop()
    print(
        f"{name}: served accuracy {json.loads((work / 'reports/evaluate/metrics.json').read_text())['accuracy']:.4f}"
        f" on {len(files)} held-out files (2 epochs from random weights: the plumbing, not a recipe)"
    )


def test_queued_experiments_on_the_demo_and_on_a_folder_run_with_their_data_copied_in(
    project: tuple[Path, dict[str, str]],
) -> None:
    """`dvc exp run --queue` runs each experiment in a fresh copy of the commit, where the raw data (a git-ignored
    link, or a folder of yours) is not: `-C <data>` copies it in (docs/experiments.md), no absolute path needed."""

    from tests.helpers.digits import write_digits_folder

    work, env = project
    write_digits_folder(work / "my-digits")
    with (work / ".gitignore").open("a") as ignore:
        ignore.write("/my-digits/\n")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run(["git", "add", "-A"], work, env)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project"], work, env)
    env = dict(env, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    dvc = [sys.executable, "-m", "dvc"]
    run([*dvc, "exp", "run", "--queue", "prepare", "-n", "demo-16", "-S", "data.image_size=16", "-C", "data/raw"],
        work, env)  # fmt: skip
    run([*dvc, "exp", "run", "--queue", "prepare", "-n", "digits", "-S", "data.source=folder",
         "-S", "data.root=my-digits", "-S", "data.image_size=8", "-C", "my-digits"], work, env)  # fmt: skip
    status = run_dvc_queue(work, env, "-j", "1")
    assert status.count("Success") == 2, status + run([*dvc, "queue", "logs", "digits"], work, env)
    shown = run([*dvc, "exp", "show", "--csv", "--keep", "Experiment|test_images|data.root"], work, env)
    assert "demo-16" in shown and "digits" in shown and "my-digits" in shown, shown
