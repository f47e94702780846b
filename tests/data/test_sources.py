"""A data source is one file and one line in DATA_SOURCES: in a copy of the package, a toy source (a JSON-lines
file of `{"path", "label"}` records) validates as `data.source`, gets the photos recipe and its file's name, and
`pipeline prepare` turns it into prepared splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, parse_params
from pipeline.data.sources import DATA_SOURCES, lister
from tests.helpers import REPO
from tests.helpers.digits import write_digits_folder
from tests.helpers.package_copy import package_with

TOY_SOURCE = '''
"""data.source jsonl: a file of {"path": ..., "label": ...} lines, paths relative to it."""

import json
from pathlib import Path

from pipeline.data.listing import Listing, SignFile, class_order


def list_jsonl(root: Path, download: bool = False) -> Listing:
    records = [json.loads(line) for line in Path(root).read_text().splitlines() if line.strip()]
    classes = class_order({str(r["label"]) for r in records})
    index = {name: i for i, name in enumerate(classes)}
    files = [SignFile(Path(root).parent / r["path"], index[str(r["label"])], None, -1) for r in records]
    return Listing(Path(root).stem, classes, files, None)
'''
TABLE_LINE = '    "jsonl": DataSource("pipeline.data.jsonl:list_jsonl", root_is_file=True),\n'


def test_the_table_names_each_source_and_an_unknown_one_is_refused() -> None:
    assert {"folder", "csv"} <= set(DATA_SOURCES) and "jsonl" not in DATA_SOURCES
    assert callable(lister("folder"))
    with pytest.raises(ConfigError, match=r"unknown data source 'jsonl'; choose one of .*folder, csv"):
        parse_params({"data": {"source": "jsonl"}})


@pytest.mark.slow
def test_a_new_data_source_is_one_file_and_one_line_through_prepare(tmp_path: Path) -> None:
    code = package_with(tmp_path / "code", "data/jsonl.py", TOY_SOURCE, "data/sources.py", '    "csv": DataSource(',
                        TABLE_LINE)  # fmt: skip

    digits = write_digits_folder(tmp_path / "digits")
    records = [{"path": str(p.relative_to(digits)), "label": p.parent.name} for p in sorted(digits.rglob("*.png"))]
    (digits / "handwriting.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    work = tmp_path / "project"
    work.mkdir()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"].update({"source": "jsonl", "root": str(digits / "handwriting.jsonl"), "image_size": 16})
    params["tracking"]["enabled"] = False
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(code)}
    shown = subprocess.run([sys.executable, "-m", "pipeline.cli", "params"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "recipe = 'photos'" in shown.stdout and "name = 'handwriting'" in shown.stdout, shown.stdout[:3000]
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "prepare"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((work / "data" / "prepared" / "manifest.json").read_text())
    assert manifest["dataset"] == "handwriting" and manifest["classes"] == [str(d) for d in range(10)]
    total = sum(split["count"] for split in manifest["splits"].values())  # less exact duplicates across splits
    assert 0.95 * len(records) <= total <= len(records), manifest["splits"]
    assert (work / "data" / "prepared" / "test" / "images-00000.npy").is_file()
