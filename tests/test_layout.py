"""The package's structure, as a maintainer relies on it: stages never import each other, every stage's
dvc.yaml code deps cover what it imports, only pipeline/artifacts/ opens the files stages hand each other, and
functions and modules stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from pipeline.stages import STAGES
from tests.helpers import REPO

PACKAGE = REPO / "pipeline"
# Modules whose changes cannot change a stage's outputs: logging, error types, tracking, a free port, the typed params
# (their defaults equal params.yaml's, which dvc.yaml tracks: tests/test_config.py), package markers.
NO_OUTPUT_EFFECT = {
    "pipeline/console.py",
    "pipeline/errors.py",
    "pipeline/tracking/__init__.py",
    "pipeline/config.py",
    "pipeline/params/base.py",  # config's sections
    "pipeline/params/training.py",
    "pipeline/params/serving.py",
    "pipeline/params/names.py",
    "pipeline/data/sources.py",  # read by config's validation, like config itself
    "pipeline/machine/ports.py",
}
# Of those, modules whose imports have no output effect through them either: tracking reads the backend table
# (pipeline/runtimes) only for the pip requirements of the MLflow models it logs. What they import is not followed.
IMPORTS_NO_OUTPUT_EFFECT = {"pipeline/tracking/__init__.py"}


def module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def imported_modules(path: Path) -> set[str]:
    """Every `pipeline...` module a file imports, at the top or inside functions (not those only for type checkers:
    `if TYPE_CHECKING:` blocks never run)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "pipeline" and module_file(name)}


def closure(module: str, opaque: frozenset[str] = frozenset()) -> set[str]:
    """The package files `module` needs, transitively (its parent packages' __init__ included); the imports of the
    files in `opaque` are not followed."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = module_file(name)
        if path is None or str(path.relative_to(REPO)) in seen:
            continue
        seen.add(str(path.relative_to(REPO)))
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        if str(path.relative_to(REPO)) not in opaque:
            todo += sorted(imported_modules(path))
    return seen


def test_closure_follows_imports_inside_functions() -> None:
    # evaluate imports the drift signals inside a function: the walk must still see them.
    assert "pipeline/monitoring/drift.py" in closure("pipeline.stages.evaluate")


@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_imports_another(stage: str) -> None:
    others = {f"pipeline/stages/{s}.py" for s in STAGES if s != stage}
    assert closure(f"pipeline.stages.{stage}") & others == set()


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_code_deps_cover_what_the_stage_imports(stage: str) -> None:
    deps = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["deps"]
    code = [d for d in deps if d.startswith("pipeline")]

    def covered(path: str) -> bool:
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in code)

    needed = {
        p
        for p in closure(f"pipeline.stages.{stage}", frozenset(IMPORTS_NO_OUTPUT_EFFECT))
        if not p.endswith("__init__.py") and p not in NO_OUTPUT_EFFECT
    }
    missing = sorted(p for p in needed if not covered(p))
    assert missing == [], f"dvc.yaml stage {stage!r} lacks code deps: {missing}"
    stale = sorted(d for d in code if not (REPO / d).exists())
    assert stale == [], f"dvc.yaml stage {stage!r} names code that does not exist: {stale}"


def test_only_artifacts_load_inter_stage_files() -> None:
    """np.load / torch.load of stage outputs happen in pipeline/artifacts/ only (torch_models reads the tensors
    inside a .pt2 archive, from memory, weights only; backbones reads the pretrained weights a user brings, which
    no stage writes; training.features reads its own cache of frozen activations, which no other stage reads)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith("pipeline/artifacts/"):
            continue
        text = path.read_text()
        for call in ("np.load(", "torch.load(", "numpy.load("):
            readers = (
                "pipeline/runtimes/torch_models.py",
                "pipeline/architectures/backbones.py",
                "pipeline/training/features.py",
            )
            if call in text and not (rel in readers and call == "torch.load("):
                offenders.append(f"{rel}: {call}")
    assert offenders == []


def test_scripts_live_in_the_package_or_the_lab() -> None:
    """The measurement tools are `python -m benchmarks ...` commands: no Python file edits sys.path to import them."""
    needle = "sys.path." + "insert"
    files = [
        p
        for p in REPO.glob("**/*.py")
        if p.relative_to(REPO).parts[0] in ("pipeline", "benchmarks", "tests", "scripts")
    ]
    assert [str(p.relative_to(REPO)) for p in files if needle in p.read_text()] == []
    assert not list((REPO / "scripts").glob("*.py"))


def test_no_product_module_imports_the_lab() -> None:
    """benchmarks/ (peers, formats, front ends) sits beside the product: nothing in pipeline/ imports it, by a
    statement or by name, so the wheel, the server image and a generated project are whole without it."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [node.value]
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else []
            )
            if any(name == "benchmarks" or name.startswith("benchmarks.") for name in names):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 500


def test_functions_read_at_once_and_modules_keep_to_one_seam() -> None:
    """No function in pipeline/ longer than a screen, no module longer than one job needs."""
    long_functions, long_modules = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(REPO))
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert (long_functions, long_modules) == ([], [])
