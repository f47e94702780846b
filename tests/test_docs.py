"""The documentation as a reader meets it: the README's relative links lead to files that exist; the site builds with
`mkdocs build --strict` and its pages open in headless Chromium with the whole navigation; the tour notebook runs
from top to bottom on a tiny finished run (MLflow runs, the benchmark table, the model card, a real `pipeline serve`).

The site and notebook tests skip, with the reason, where mkdocs, Chromium or the notebook's kernel is missing; in CI
(`CI` set, as `.ci/run` does) a missing tool is a failure."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import unicodedata
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.project import make_project, run, tiny_pipeline_params

NOTEBOOK = REPO / "docs" / "notebooks" / "tour.ipynb"
# The demo's measured results: a project generated without the demo has no such pages (.copier/template_names.py).
MEASURED = (REPO / "docs" / "results.md").is_file()
NAV = ("Getting started", "Your own data", "Your own model", "The stages", "Serving", "Scaling out",
       "CI/CD and tests", *["Measured results"] * MEASURED, "API reference")  # fmt: skip


def require(what: str, found: object, hint: str) -> None:
    """Skip where a tool is missing here; in CI it is a failure (`.ci/run` installs everything)."""
    if not found:
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing in CI ({hint})")
        pytest.skip(f"no {what}: {hint}")


def test_the_readmes_relative_links_lead_to_files() -> None:
    text = (REPO / "README.md").read_text()
    links = [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]
    assert any(link.startswith("docs/") for link in links)
    broken = [link for link in links if not (REPO / link.split("#")[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


# A figure as the README's headline table writes one: a number, or a range of two, with its unit ("532 MiB"), a
# percentage ("99.62 %"), a ratio ("2.02x", also with the multiplication sign), or a time ("25 min 47 s", "150 s").
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,]){NUMBER}(?:\s?[–-]\s?{NUMBER})?"
    r"(?:\s?(?:%|×|x\b)|\s(?:h \d+ min|min \d+ s|h|min|s|ms|µs|MiB|GiB|KiB|MB|GB|KB|img/s|req/s|px)(?![\w/]))"
)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) gives a heading: "The served model's speed" -> the-served-models-speed."""
    text = unicodedata.normalize("NFKD", re.sub(r"`([^`]*)`", r"\1", heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _sections(text: str) -> dict[str, str]:
    """Each heading's anchor -> the heading's section, up to the next heading of its level or above (code blocks are
    not headings)."""
    lines = text.splitlines()
    heads: list[tuple[int, int, str]] = []
    fenced = False
    for number, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"(#{1,6}) (.+)", line)):
            heads.append((number, len(match[1]), _slug(match[2])))
    sections = {}
    for i, (start, level, slug) in enumerate(heads):
        end = next((n for n, lv, _ in heads[i + 1 :] if lv <= level), len(lines))
        sections[slug] = "\n".join(lines[start:end])
    return sections


def _headline_rows() -> list[tuple[str, str, str]]:
    """(anchor in docs/results.md, figure, CPU) of each row of the README's headline table."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if match := re.fullmatch(r"\| \[[^\]]+\]\(docs/results\.md#([\w-]+)\) \| (.+) \| (.+) \|", line.strip()):
            rows.append((match[1], match[2], match[3]))
    return rows


def _figures(cell: str) -> list[str]:
    prose = re.sub(r"`[^`]*`", "", cell).replace("**", "")  # a command's numbers are no figures
    return [m.group(0) for m in FIGURE.finditer(prose)]


@pytest.mark.skipif(not MEASURED, reason="a project without the demo has no measured results")
def test_each_readme_figure_is_written_as_its_results_section_writes_it() -> None:
    """Each figure of the README's headline table (a number with its unit, a percentage, a ratio, a time) stands
    verbatim in the section of docs/results.md that its row links to, whole (the README's "18 min" is no match for
    "18 min 9 s", nor "1.8 GB" for "1,789 MiB"); the row's CPU kinds are named there, with a date and a command."""
    sections = _sections((REPO / "docs" / "results.md").read_text())
    rows = _headline_rows()
    assert len(rows) >= 6, rows
    problems = []
    for anchor, cell, cpu in rows:
        if anchor not in sections:
            problems.append(f"#{anchor}: no such section in docs/results.md")
            continue
        section = " ".join(sections[anchor].replace("**", "").split())  # a line break is a space
        figures = _figures(cell)
        if not figures:
            problems.append(f"#{anchor}: no figure in the README's row")
        for figure in figures:
            whole = rf"(?<![\w.,])(?<!min )(?<!h ){re.escape(figure)}(?!\w|[.,]\d|\s?[–-]?\s?\d)"  # not a part
            if not re.search(whole, section):
                problems.append(f"#{anchor}: the README's {figure!r} is not written so in docs/results.md")
        if not re.search(r"\b20\d\d-\d\d-\d\d\b", section) or "```" not in sections[anchor]:
            problems.append(f"#{anchor}: the section gives no date or no command block")
        for kind in filter(None, (k.strip() for k in cpu.split(";"))):
            if kind not in section:
                problems.append(f"#{anchor}: the README's CPU {kind!r} is not named in the section")
    assert problems == []


def test_a_figure_is_a_number_with_its_unit() -> None:
    cell = (
        "exit 0 in 18 min 9 s, **99.62 %** of 11,985 images (two seeds: 91.7 %, 91.0 %), `make pipeline STAGE=card`, "
        "**6.19×** (range 6.05–6.22×), 2.02x, 532 MiB, 21 min 37 s to 30 min 36 s, 100,000 images at 224 px, x86-64"
    )
    assert _figures(cell) == ["18 min 9 s", "99.62 %", "91.7 %", "91.0 %", "6.19×", "6.05–6.22×", "2.02x",
                              "532 MiB", "21 min 37 s", "30 min 36 s", "224 px"]  # fmt: skip
    assert _slug("The served model's speed") == "the-served-models-speed"
    assert _slug("Decode and the `HTTP` front end") == "decode-and-the-http-front-end"


# The manual's pages stay readable: their reader wants the current state, not how it came about.
WORD_LIMITS = {"docs/ci.md": 2500, "docs/own-data.md": 3000, "docs/results.md": 4000}


@pytest.mark.parametrize("page", sorted(WORD_LIMITS))
def test_the_page_stays_within_its_word_limit(page: str) -> None:
    path = REPO / page
    if not path.is_file():
        pytest.skip(f"{page}: not in this project")
    words = len(path.read_text().split())  # as `wc -w` counts
    assert words <= WORD_LIMITS[page], f"{page}: {words} words, the limit is {WORD_LIMITS[page]}"


MANUAL = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
ISSUE = re.compile(r"(?<![\w&#])#\d+\b|\bissues? #?\d+\b", re.IGNORECASE)
HISTORY = re.compile(r"\b(?:this|last|previous) round\b|\bearlier rounds?\b", re.IGNORECASE)


def _history_marks(text: str) -> list[str]:
    """The commit hashes, issue numbers and phrases of a diary ("this round") in a page of the manual."""
    hashes = [h for h in COMMIT.findall(text) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    prose = re.sub(r"https?://\S+|\]\([^)]*\)|\bid=\"[^\"]*\"", "", text)  # URLs, link targets and anchors
    issues = [m.group(0) for m in ISSUE.finditer(prose)]
    return [f"commit `{h}`" for h in hashes] + [f"issue {i!r}" for i in issues] + HISTORY.findall(text)


def test_a_history_mark_is_found() -> None:
    text = (
        "at `f79bdaf`, `1234567` and `deadbeef` are no commits; #40's target, issue 23, [a](x.md#40-b) "
        "https://github.com/o/r/issues/7#12 &#8212; this round, the previous round's, earlier rounds, 3 rounds"
    )
    assert _history_marks(text) == ["commit `f79bdaf`", "issue '#40'", "issue 'issue 23'", "this round",
                                    "previous round", "earlier rounds"]  # fmt: skip


@pytest.mark.parametrize("page", MANUAL)
def test_the_manual_names_no_commit_issue_or_round(page: str) -> None:
    """README.md and docs/*.md describe the project as it is: no commit hashes, issue numbers or "this round" (the
    history is in git and CHANGELOG.md)."""
    marks = _history_marks((REPO / page).read_text())
    assert marks == [], f"{page}: {marks[:20]}{' ...' if len(marks) > 20 else ''} ({len(marks)} in all)"


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no access log on the test's output
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built with `mkdocs build --strict` into a temporary folder, served by Python's http.server on a
    free loopback port; yields its base URL."""
    require("mkdocs", importlib.util.find_spec("mkdocs"), "the docs dependency group: uv sync")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    handler = functools.partial(QuietHandler, directory=str(out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_the_site_builds_strict_and_its_pages_open_in_chromium(site: str) -> None:
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    require("chromium", chromium, "apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            response = page.goto(f"{site}/getting-started/")
            assert response is not None and response.status == 200
            assert page.title().startswith("Getting started")
            assert page.locator("article h1").first.inner_text().rstrip("¶").strip() == "Getting started"
            assert "make pipeline" in page.locator("article").inner_text()
            nav = page.locator("nav.md-nav--primary").first.inner_text()
            missing = [label for label in NAV if label not in nav]
            assert not missing, f"the navigation lacks {missing}: {nav}"
            if os.environ.get("PIPELINE_SCREENSHOTS"):
                folder = Path(os.environ["PIPELINE_SCREENSHOTS"])
                folder.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(folder / "docs-getting-started.png"), full_page=False)

            # The navigation leads to the pages: the results page keeps its figures and the flame graph's link.
            if MEASURED:
                page.locator("nav.md-nav--primary a", has_text="Measured results").first.click()
                page.wait_for_url(f"{site}/results/")
                results = page.locator("article").inner_text()
                assert "99.62 %" in results and "python -m benchmarks accuracy" in results
                flamegraph = page.request.get(f"{site}/serve-flamegraph.svg")
                assert flamegraph.status == 200 and b"<svg" in flamegraph.body()[:2000]

            # The API reference is rendered from the docstrings (griffe, nothing imported).
            page.goto(f"{site}/api/config/")
            api = page.locator("article").inner_text()
            assert "pipeline.config" in api and "DataConfig" in api and "The prepare stage" in api
            image = page.request.get(f"{site}/mlflow-compare.png")
            assert image.status == 200 and image.body()[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            browser.close()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project copy after the real stages through the card on the tests' synthetic images and tiny params, MLflow
    tracking on (sqlite in the project): MLflow runs, reports/benchmark/table.md, models/serving.json,
    reports/model_card.md. The stages' own run() in one process, in dvc.yaml's order (`dvc repro card` runs the same
    entries, one process each: twice the time here)."""
    base = tmp_path_factory.mktemp("tour")
    work, env = make_project(base)
    tiny_pipeline_params(work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["tracking"]["enabled"] = True
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    stages = ("prepare", "train", "optimize", "benchmark", "evaluate", "card")
    script = (
        "import importlib\nfrom pipeline.config import load_params\nparams = load_params()\n"
        f"for stage in {stages!r}:\n    importlib.import_module(f'pipeline.stages.{{stage}}').run(params)\n"
    )
    run([sys.executable, "-c", script], work, env, timeout=900)
    return work


@pytest.mark.slow
def test_the_tour_notebook_runs_on_a_finished_run(finished_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("nbclient and ipykernel", importlib.util.find_spec("nbclient") and importlib.util.find_spec("ipykernel"),
            "the docs dependency group: uv sync")  # fmt: skip
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TOUR_PROJECT", str(finished_run))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TOUR_SERVER_URL", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    assert time.monotonic() - started < 300
    outputs = "\n".join(  # a cell's stream comes in chunks that may split a line: joined as printed
        "".join(str(output.get("text", "")) + str(output.get("data", {}).get("text/plain", ""))
                + str(output.get("data", {}).get("text/markdown", "")) for output in cell.get("outputs", []))
        for cell in notebook.cells if cell.cell_type == "code"
    )  # fmt: skip

    assert f"project: {finished_run.resolve()}" in outputs
    assert re.search(r"1 pipeline execution\(s\), [1-9]\d* stage run\(s\)", outputs), outputs[:3000]
    for stage in ("prepare", "train", "optimize", "benchmark", "evaluate", "card"):
        assert re.search(rf"\b{stage}\b\s+FINISHED", outputs), f"stage run {stage} not shown finished"
    served = yaml.safe_load((finished_run / "models" / "serving.json").read_text())["variant"]
    assert served in outputs
    assert (finished_run / "reports/benchmark/table.md").read_text().splitlines()[0] in outputs
    assert (finished_run / "reports/model_card.md").read_text().splitlines()[0] in outputs
    assert "8 of 8 files: the server's class = evaluate's recorded class" in outputs
    assert "GET /v1/model-card: 200" in outputs
    pid = int(re.search(r"stopped pipeline serve \(pid (\d+), exit code 0\)", outputs)[1])  # type: ignore[index]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _commands(app: object) -> dict[str, object]:
    """Every command of a typer app by its words ("serve", "platform up"), with its click command."""
    import typer

    found: dict[str, object] = {}

    def walk(command: object, words: str) -> None:
        found[words] = command
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{words} {name}".strip())

    walk(typer.main.get_command(app), "")  # type: ignore[arg-type]
    return found


def _param_exists(key: str) -> bool:
    from pipeline.config import Params

    model: object = Params
    for part in key.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        model = fields[part].annotation
    return True


def _spans(text: str) -> Iterator[str]:
    """Each line of a fenced block and each inline code span: where the docs show commands and keys."""
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        yield from block.splitlines()
    yield from re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


FILE_SUFFIXES = {
    "py",
    "yaml",
    "yml",
    "json",
    "md",
    "csv",
    "txt",
    "png",
    "onnx",
    "pt",
    "lock",
    "toml",
    "npy",
    "npz",
    "db",
}


def test_every_command_and_key_the_docs_show_exists() -> None:
    """README and docs/ (not the dated history): each `pipeline ...` command and its --options are the CLI's, each
    `python -m benchmarks TOOL` a tool of the lab, each `make TARGET` the Makefile's, each `STAGE=` and `dvc repro`
    stage dvc.yaml's, each `-S key=value` and `section.key` a key of params.yaml's schema."""
    from benchmarks.__main__ import app as lab_app
    from pipeline.cli import app
    from pipeline.config import Params

    cli, lab = _commands(app), _commands(lab_app)
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    stages = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    sections = set(Params.model_fields)
    problems = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if doc.name == "results-history.md":
            continue
        for span in _spans(doc.read_text()):
            command_part = re.sub(r"(^|\s)#.*", "", span)  # a shell comment is prose
            for segment in re.split(r"\s*(?:\||;|&&|&)\s*", command_part):
                words = segment.split()
                for i, word in enumerate(words):
                    after = words[i + 1] if i + 1 < len(words) else ""
                    where = f"{doc.name}: `{segment.strip()}`"
                    at_start = i == 0 or words[i - 1] in ("run", "exec", "--", "$")
                    if word == "pipeline" and at_start and re.fullmatch(r"[a-z][a-z-]*", after):
                        name = " ".join(words[i + 1 : i + 3]) if " ".join(words[i + 1 : i + 3]) in cli else after
                        command = cli.get(name)
                        if command is None:
                            problems.append(f"{where}: no command `pipeline {name}`")
                            continue
                        options = {o for p in command.params for o in getattr(p, "opts", [])} | {"--help"}  # type: ignore[attr-defined]
                        if not command.context_settings.get("ignore_unknown_options"):  # type: ignore[attr-defined]
                            flags = re.findall(r"(?<!\S)(--[a-z][a-z-]*)", " ".join(words[i + 2 :]))
                            problems += [f"{where}: `pipeline {name}` has no {f}" for f in flags if f not in options]
                    if word == "make" and re.fullmatch(r"[a-z][\w-]*", after) and after not in targets:
                        problems.append(f"{where}: no make target {after}")
                    if word == "-m" and after == "benchmarks" and i + 2 < len(words):
                        tool = words[i + 2]
                        if re.fullmatch(r"[a-z][a-z-]*", tool) and tool not in lab:
                            problems.append(f"{where}: no lab tool {tool}")
                    if word == "-S" and after and "<" not in after and after != "key=value":
                        key = after.strip("'\"").split("=")[0]
                        if not _param_exists(key):
                            problems.append(f"{where}: no param {key}")
                    if word.startswith("STAGE=") and word[6:] not in stages:
                        problems.append(f"{where}: no stage {word[6:]}")
                    if word == "repro" and re.fullmatch(r"[a-z]+", after) and after not in stages:
                        problems.append(f"{where}: no stage {after}")
                dotted = re.fullmatch(r"([a-z_]+(?:\.[a-z_0-9]+)+)(?:\s*[:=].*)?", segment.strip())
                if dotted:  # `section.key`, unless it names a module (serve.protocol...) or a file (train.npz)
                    key, parts = dotted.group(1), dotted.group(1).split(".")
                    module = (REPO / "pipeline" / parts[0] / f"{parts[1]}.py").is_file()
                    if (
                        parts[0] in sections
                        and parts[-1] not in FILE_SUFFIXES
                        and not module
                        and not _param_exists(key)
                    ):
                        problems.append(f"{doc.name}: `{key}` is no param")
    assert problems == []
