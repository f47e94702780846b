"""copier's task (copier.yml `_tasks`): the demo's names -> the generated project's own.

The repository is the template and, unchanged, its own demo (the GTSRB traffic-sign classifier): its files stay
valid as they are, no `.jinja` sources. A generated copy runs this script in its folder right after copier wrote
it; it rewrites an explicit table of (file, demo text -> the answer) substitutions and, for a `folder` or `csv`
data source, the data section. `copier update` renders the old and the new template version with the same
answers, and this task runs in both renders (and in the project's), so the 3-way merge compares like with like.

Every substitution must find its text (a template change that drops one fails generation loudly rather than
leaving a demo name behind); a file the project no longer has is skipped. The demo's own answers change nothing:
`copier copy --defaults` reproduces the repository.

    python .copier/template_names.py --project-name acme --model-name acme ... [--dir DEST]
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

DEMO = {
    "project_name": "gtsrb-pipeline",
    "description": "PyTorch MLOps pipeline template: GTSRB traffic signs from raw images to a served, containerized model",
    "model_name": "gtsrb",
    "image_name": "gtsrb-server",
    "registry": "",
    "registered_model_name": "gtsrb-classifier",
    "experiment": "gtsrb",
    "api_title": "GTSRB traffic-sign classifier",
    "data_source": "gtsrb",
    "data_root": "data/raw",
}

# What each answer may hold: names that Kubernetes, OCI labels and URLs all accept; texts that go between double
# quotes in Python, TOML and a Dockerfile; a data path and a registry that YAML and Python take as they are.
DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
CHECKS = {
    "project_name": DNS_LABEL,
    "image_name": DNS_LABEL,
    "registered_model_name": DNS_LABEL,
    "model_name": r"[a-z0-9][a-z0-9_.-]{0,62}",
    "experiment": r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}",
    "description": r"[^\"\\$`\n]{1,300}",
    "api_title": r"[^\"\\$`\n]{1,100}",
    "data_source": r"gtsrb|folder|csv",
    "data_root": r"[A-Za-z0-9_./~-]{1,500}",
    "registry": r"([a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*)?",
}

# (file, demo text, new text): {name} is the answer `name`. Applied in this order, each to every occurrence of the
# text where it is not part of a longer word (pattern()).
NAMES: list[tuple[str, str, str]] = [
    # the configuration: params.yaml and its typed defaults (tests/test_config.py: one set)
    ("params.yaml", '  model_name: ""', "  model_name: {model_name}"),
    ("params.yaml", '  title: ""', '  title: "{api_title}"'),
    ("params.yaml", '  image: ""', "  image: {image_name}"),
    ("params.yaml", '  container_name: ""', "  container_name: {image_name}"),
    ("params.yaml", '  experiment: ""', "  experiment: {experiment}"),
    ("params.yaml", '  registered_model_name: ""', "  registered_model_name: {registered_model_name}"),
    ("pyproject.toml", 'description = "{demo_description}"', 'description = "{description}"'),
    ("mkdocs.yml", "site_name: GTSRB MLOps pipeline template", "site_name: {project_name}"),
    # the server, the image, the CLI
    ("pipeline/artifacts/image.py", "gtsrb-server", "{image_name}"),
    ("pipeline/tracking/mlflow_model.py", "gtsrb-classifier", "{registered_model_name}"),
    ("pipeline/cli.py", '"gtsrb-platform:latest"', '"{project_name}-platform:latest"'),
    ("pipeline/tracking/team_stack.py", '"gtsrb-platform:latest"', '"{project_name}-platform:latest"'),
    ("benchmarks/serve.py", "gtsrb", "{model_name}"),  # the served model's name in the peers' comparison
    ("docker/platform.Dockerfile", '"gtsrb-platform"', '"{project_name}-platform"'),
    ("docker/README.md", "gtsrb-pipeline", "{project_name}"),
    ("docker/README.md", "gtsrb-server", "{image_name}"),
    ("docker/README.md", "on the real GTSRB test split", "on the template's demo test split"),
    # deployment manifests and the release workflow
    *[
        (f"deploy/k8s/{name}", "gtsrb-server", "{image_name}")
        for name in ("deployment.yaml", "hpa.yaml", "kustomization.yaml", "pdb.yaml", "service.yaml")
    ],
    ("deploy/kserve/inferenceservice.yaml", "gtsrb-classifier", "{registered_model_name}"),
    ("deploy/kserve/inferenceservice.yaml", "gtsrb-server", "{image_name}"),
    ("deploy/kserve/servingruntime.yaml", "gtsrb-classifier", "{registered_model_name}"),
    ("deploy/kserve/servingruntime.yaml", "gtsrb-server", "{image_name}"),
    ("deploy/kubeflow/trainjob.yaml", "gtsrb.example/", "{project_name}.example/"),
    ("deploy/kubeflow/trainjob.yaml", "gtsrb-", "{project_name}-"),
    *[
        (f"deploy/monitoring/{name}", "gtsrb-server", "{image_name}")
        for name in ("alerts.yml", "alerts.test.yml", "prometheus.yml", "servicemonitor.yaml")
    ],
    ("deploy/platform/compose.yaml", "gtsrb-platform", "{project_name}-platform"),
    (".github/workflows/release.yml", "gtsrb-server", "{image_name}"),
    # the manual's pages where they name the project's objects (docs/results*.md: the demo's measurements, kept)
    ("docs/index.md", "# GTSRB MLOps pipeline template\n", "# {project_name}\n"),
    ("docs/ci.md", "gtsrb-server", "{image_name}"),
    ("docs/serving.md", "gtsrb-server", "{image_name}"),
    ("docs/serving.md", "c.infer('gtsrb',", "c.infer('{model_name}',"),
    ("docs/stages.md", "gtsrb-classifier", "{registered_model_name}"),
    ("docs/scaling.md", "gtsrb-classifier", "{registered_model_name}"),
    ("docs/scaling.md", "gtsrb-server", "{image_name}"),
    ("docs/scaling.md", "gtsrb-platform", "{project_name}-platform"),
    ("docs/scaling.md", "gtsrb-train", "{project_name}-train"),
    # the tests that name what the project serves (the server answers under serve.model_name)
    ("tests/ship/conftest.py", '"gtsrb-server-test"', '"{image_name}-test"'),
    ("tests/ship/test_k8s.py", "gtsrb-server", "{image_name}"),
    ("tests/ship/test_platform_compose.py", '"gtsrb-platform-test:latest"', '"{project_name}-platform-test:latest"'),
    ("tests/monitoring/test_prometheus.py", '"gtsrb-server"', '"{image_name}"'),
    ("tests/artifacts/test_artifacts.py", "gtsrb-server", "{image_name}"),
]

# A registry for the deploy stage's `registry` target and the manifests' examples (empty: the local one).
REGISTRY: list[tuple[str, str, str]] = [
    ("params.yaml", "  registry: 127.0.0.1:5000  ", "  registry: {registry}  "),
    ("pipeline/params/serving.py", 'registry: str = "127.0.0.1:5000"', 'registry: str = "{registry}"'),
    ("deploy/k8s/deployment.yaml", "ghcr.io/OWNER/", "{registry}/"),
    ("deploy/kserve/servingruntime.yaml", "ghcr.io/OWNER/", "{registry}/"),
]

# A folder or CSV data source: the data section says so, with its own defaults (config.py keeps the demo source
# as a choice), and the texts that described the demo's data in general places describe the project's.
DATA: list[tuple[str, str, str]] = [
    (
        "params.yaml",
        "  source: gtsrb           # gtsrb (the demo) | folder",
        "  source: {data_source}          # folder",
    ),
    (
        "params.yaml",
        "  root: data/raw          # gtsrb: holds torchvision's gtsrb/ layout (GTSRB_ROOT overrides it); folder / csv: your data",
        "  root: {data_root}          # folder: your folder of class folders; csv: your CSV file",
    ),
    (
        "params.yaml",
        "  download: true          # gtsrb: let torchvision fetch GTSRB into root when missing (needs internet)",
        "  download: false         # a source that can download its data fetches it into root (neither of these)",
    ),
    ("params.yaml", "(GTSRB tracks, a CSV's group, else files)", "(a CSV's group, else files)"),
    ("pipeline/data/sources.py", 'DEFAULT_SOURCE = "gtsrb"', 'DEFAULT_SOURCE = "{data_source}"'),
    ("pipeline/params/training.py", 'root: PathField = Path("data/raw")', 'root: PathField = Path("{data_root}")'),
    ("pipeline/params/training.py", "download: bool = True", "download: bool = False"),
    (
        "Makefile",
        "run the DVC pipeline (set GTSRB_ROOT to use an existing GTSRB copy)",
        "run the DVC pipeline (dvc repro)",
    ),
]

# A project without the demo (a folder or CSV data source): the demo's own files go, and the lines that bring it
# in or speak of it are rewritten. The manual (docs/) stays without the demo's measured-results pages and without
# its demo blocks (DEMO_BLOCK).
DEMO_FILES = [
    "docs/results.md",
    "docs/results-history.md",
    "docs/serve-flamegraph.svg",  # linked from docs/results.md only
    "pipeline/data/gtsrb.py",
    "pipeline/recipes/gtsrb.yaml",
    "scripts/raw-data.sh",
    "scripts/gpu-check.sh",
    "tests/demo",
    "tests/helpers/demo.py",
    "tests/benchmarks/test_gpu.py",
]
WITHOUT_DEMO: list[tuple[str, str, str]] = [
    (
        "pipeline/data/sources.py",
        '    "gtsrb": DataSource("pipeline.data.gtsrb:listing", "gtsrb", root_env="GTSRB_ROOT", name="gtsrb"),  # the demo\n',
        "",
    ),
    (
        "params.yaml",
        "auto (gtsrb for the demo's data, photos for a folder or CSV) | gtsrb | photos |",
        "auto (photos for a folder or CSV) | photos |",
    ),
    ("params.yaml", "never for signs)", "not for images whose meaning a mirror changes)"),
    (
        "dvc.yaml",
        "      # $GTSRB_ROOT is linked here by scripts/raw-data.sh (`make pipeline` runs it); `dvc add` it to version it\n",
        "      # `dvc add` it to version it; a CSV: keep the images it lists in its folder and `dvc add` that folder\n",
    ),
    (
        "pyproject.toml",
        '"integration: needs real GTSRB data (GTSRB_ROOT)",',
        '"integration: needs a real sample of the data",',
    ),
    ("Makefile", "\tscripts/raw-data.sh\n", ""),
    (
        "mkdocs.yml",
        "  - Measured results:\n      - Measured results: results.md\n      - Earlier figures: results-history.md\n",
        "",
    ),
    # the manual's commands (a code span or block cannot hold a demo marker: the rest is marked, DEMO_OPEN)
    ("docs/ci.md", "GTSRB_ROOT=/path/to/gtsrb scripts/act.sh pipeline", "scripts/act.sh pipeline"),
    ("docs/experiments.md", "`GTSRB_ROOT=<sample> PIPELINE_SCREENSHOTS=", "`PIPELINE_SCREENSHOTS="),
    (
        "docs/getting-started.md",
        " classes from the data), gtsrb.py (the demo dataset through torchvision + official CSVs), loader.py\n",
        " classes from the data), loader.py\n",
    ),
    ("docs/getting-started.md", "`recipe: auto | gtsrb | photos | your.yaml`", "`recipe: auto | photos | your.yaml`"),
    (
        "docs/own-data.md",
        'uv run python -m benchmarks scale-folder --gtsrb "$GTSRB_ROOT" --out /data/scale --images 100000 --size 224\n',
        "",
    ),
    (
        "docs/notebooks/tour.ipynb",
        ' [Experiments and tracking](../experiments.md)\\n",\n    "- the figures of full runs, each with its command: [Measured results](../results.md)"',
        ' [Experiments and tracking](../experiments.md)"',
    ),
    (
        "scripts/act.sh",
        "#   GTSRB_ROOT=/path/to/gtsrb scripts/act.sh pipeline --input quick=true --input epochs=2\n",
        "#   scripts/act.sh pipeline --input quick=true --input epochs=2\n",
    ),
    ("scripts/act.sh", " GTSRB_ROOT, when set, is passed as\n# the repository variable of that name.\n", "\n"),
    ("scripts/act.sh", '[ -n "${GTSRB_ROOT:-}" ] && extra+=(--var "GTSRB_ROOT=$GTSRB_ROOT")\n', ""),
    (
        "data/README.md",
        "| `raw/` | `scripts/raw-data.sh` (`make pipeline`), then `pipeline prepare` (torchvision download, when `data.download: true`) | GTSRB in torchvision's layout under `raw/gtsrb/`: `GTSRB/Training`, `GTSRB/Final_Test`, `GT-final_test.csv`. With `GTSRB_ROOT` set, `raw` is a link to that copy. prepare's DVC dependency (`${data.root}`): a changed image re-runs it. |",
        "| `raw/` | you (or `dvc pull`) | your images, where `data.root` says (`params.yaml`): prepare's DVC dependency, so a changed image re-runs it; `dvc add` it to version it |",
    ),
    (
        ".github/workflows/pipeline.yml",
        "# Locally: `GTSRB_ROOT=/path/to/gtsrb scripts/act.sh pipeline --input quick=true` (act, see docs/ci.md).\n",
        "# Locally: `scripts/act.sh pipeline --input quick=true` (act, see docs/ci.md).\n",
    ),
    (
        ".github/workflows/pipeline.yml",
        "env:\n  # Bump to drop the cached GTSRB download (actions/cache keys are immutable).\n  GTSRB_CACHE_KEY: gtsrb-torchvision-v1\n  # A runner with its own copy of GTSRB (self-hosted, or act: scripts/act.sh passes it) sets this variable.\n  GTSRB_ROOT: ${{ vars.GTSRB_ROOT }}\n\n",
        "",
    ),
    (
        ".github/workflows/pipeline.yml",
        "      - name: Restore GTSRB\n        id: gtsrb\n        if: env.GTSRB_ROOT == ''\n        uses: actions/cache/restore@5a3ec84eff668545956fd18022155c47e93e2684 # v4.2.3\n        with:\n          path: data/raw\n          key: ${{ env.GTSRB_CACHE_KEY }}\n      - name: Raw data where dvc.yaml tracks it (data/raw; GTSRB_ROOT is linked there)\n        run: scripts/raw-data.sh\n",
        "",
    ),
    (
        ".github/workflows/pipeline.yml",
        "      - name: prepare, with this run's settings (downloads GTSRB when it is neither cached nor given)\n",
        "      - name: prepare, with this run's settings\n",
    ),
    (
        ".github/workflows/pipeline.yml",
        '          if [ -n "$GTSRB_ROOT" ]; then settings+=(-S data.download=false); fi\n',
        "",
    ),
    (
        ".github/workflows/pipeline.yml",
        "      - name: Save GTSRB\n        if: env.GTSRB_ROOT == '' && steps.gtsrb.outputs.cache-hit != 'true'\n        uses: actions/cache/save@5a3ec84eff668545956fd18022155c47e93e2684 # v4.2.3\n        with:\n          path: data/raw\n          key: ${{ env.GTSRB_CACHE_KEY }}\n",
        "",
    ),
]
# The manual's passages about the demo (its data, its measurements, its recipe's rows), invisible on the site:
# a block between the lines `<!-- demo -->` and `<!-- /demo -->`; a line that ends with ` <!-- demo -->` (a table
# row, a list item's line: a block there would break the table or the list); a span `<!-- demo -->...<!-- /demo -->`
# inside one line (not at its start: Markdown takes such a line for an HTML block). A project without the demo
# drops them, markers included (drop_demo_blocks()).
DEMO_OPEN, DEMO_CLOSE, DEMO_LINE = "<!-- demo -->", "<!-- /demo -->", " <!-- demo -->"
DEMO_SPAN = re.compile(re.escape(DEMO_OPEN) + ".*?" + re.escape(DEMO_CLOSE))
# The recipes' values in params.yaml's comments: the demo's recipe goes with the demo.
DEMO_RECIPE_VALUE = re.compile(r"recipe's \(gtsrb (\[[^\]]*\]|[^,()\[]+), photos ")


README = """# {project_name}

{description}

Generated from the PyTorch MLOps pipeline template with [copier](https://copier.readthedocs.io/): the stages
prepare → train → optimize → benchmark → evaluate → card → containerize → deploy, chained by `dvc.yaml`, with
MLflow tracking and a served container image. The data: `{data_source}` at `{data_root}` (`params.yaml`, section
`data`); the served model `{model_name}` (image `{image_name}`, MLflow registered model `{registered_model_name}`).

```bash
make pipeline   # create the environment if needed, then `dvc repro`
make test       # lint, type-check and run every test
```

The manual is [`docs/`](docs/index.md) (the template's own; its measured results are the template's demo):
[Getting started](docs/getting-started.md), [Your own data](docs/own-data.md), [CI/CD and tests](docs/ci.md).

Later template versions: `copier update --trust` in a clean working tree merges them into this project
(answers in `.copier-answers.yml`; see [Getting started](docs/getting-started.md#your-own-project-from-the-template)).
"""


def pattern(old: str) -> re.Pattern[str]:
    """`old` where it is not part of a longer word (`model_name: gtsrb` is not the start of `model_name: gtsrbx`;
    `gtsrb-server` in `gtsrb-server-auth` is a name, and renamed)."""
    before = r"(?<!\w)" if re.match(r"\w", old) else ""
    after = r"(?!\w)" if re.search(r"\w\Z", old) else ""  # \Z: not before a final newline, as $ would
    return re.compile(before + re.escape(old) + after)


def substitute(root: Path, rules: list[tuple[str, str, str]], values: dict[str, str]) -> list[str]:
    """Apply `rules` under `root`; the files changed."""
    changed = []
    for name, old, new in rules:
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text()
        old, new = old.format(**values), new.format(**values)
        text, count = pattern(old).subn(lambda _, new=new: new, text)
        if not count:
            raise SystemExit(f"template_names: {name}: {old!r} not found (the template changed: update the table)")
        path.write_text(text)
        changed.append(name)
    return changed


def drop_demo_blocks(text: str, name: str = "") -> str:
    """`text` without its demo blocks, lines and spans (DEMO_OPEN .. DEMO_CLOSE, markers included); where a block
    stood between blank lines, one blank line stays. A marker out of place (unpaired, nested, a span that opens a
    line) stops generation."""
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    opened = 0  # the line number of the open block's DEMO_OPEN
    for number, line in enumerate(lines, 1):
        tag = line.strip()
        if tag in (DEMO_OPEN, DEMO_CLOSE):
            if (tag == DEMO_OPEN) == bool(opened):
                raise SystemExit(f"template_names: {name}:{number}: {tag} without its pair")
            if opened and kept[-1:] == ["\n"] and lines[number : number + 1] in (["\n"], []):
                kept.pop()
            opened = 0 if opened else number
            continue
        if opened:
            continue
        if tag.startswith(DEMO_OPEN):
            raise SystemExit(
                f"template_names: {name}:{number}: a demo span opens the line (a block needs lines of its own)"
            )
        line = DEMO_SPAN.sub("", line)
        if line.rstrip("\n").endswith(DEMO_LINE):
            continue
        if DEMO_OPEN in line or DEMO_CLOSE in line:
            raise SystemExit(f"template_names: {name}:{number}: a demo marker out of place (unpaired in the line)")
        kept.append(line)
    if opened:
        raise SystemExit(f"template_names: {name}:{opened}: {DEMO_OPEN} never closed ({DEMO_CLOSE})")
    return "".join(kept)


def without_demo(root: Path, values: dict[str, str]) -> list[str]:
    """The demo's files removed, the lines that bring it in rewritten, the manual's demo blocks dropped; the files
    changed."""
    for name in DEMO_FILES:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    literal = [(name, *(text.replace("{", "{{").replace("}", "}}") for text in pair)) for name, *pair in WITHOUT_DEMO]
    changed = substitute(root, literal, values)  # type: ignore[arg-type]
    params = root / "params.yaml"
    text, count = DEMO_RECIPE_VALUE.subn("recipe's (photos ", params.read_text())
    if not count:
        raise SystemExit("template_names: params.yaml: no recipe values to rewrite (the template changed)")
    params.write_text(text)
    changed.append("params.yaml")
    for page in sorted((root / "docs").rglob("*.md")):
        name = str(page.relative_to(root))
        text = page.read_text()
        if (kept := drop_demo_blocks(text, name)) != text:
            page.write_text(kept)
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key in DEMO:
        parser.add_argument(f"--{key.replace('_', '-')}", default=DEMO[key])
    parser.add_argument("--dir", type=Path, default=Path("."))
    parser.add_argument("--lab", choices=["true", "false"], default="true", help="keep benchmarks/ and its tests")
    args = parser.parse_args(argv)
    if args.lab == "false":  # the measurement lab is the template's; a project asks for it
        for folder in ("benchmarks", "tests/benchmarks"):
            shutil.rmtree(args.dir / folder, ignore_errors=True)
    answers = {key: str(getattr(args, key)) for key in DEMO}
    for key, allowed in CHECKS.items():
        if not re.fullmatch(allowed, answers[key]):
            raise SystemExit(f"template_names: {key} {answers[key]!r} does not match {allowed}")
    if answers == DEMO:  # the demo itself: the repository as it is
        print("template_names: the demo's answers, nothing to rename")
        return
    values = {**answers, "demo_description": DEMO["description"]}
    root: Path = args.dir
    changed = substitute(root, NAMES, values)
    if answers["registry"]:
        changed += substitute(root, REGISTRY, values)
    if answers["data_source"] != "gtsrb":
        changed += substitute(root, DATA, values)
        changed += without_demo(root, values)
    if answers["project_name"] != DEMO["project_name"]:
        (root / "README.md").write_text(README.format(**values))
        changed.append("README.md")
    print(f"template_names: {len(set(changed))} files hold the project's names")


if __name__ == "__main__":
    main()
