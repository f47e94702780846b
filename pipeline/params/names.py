"""The names a run carries (MLflow experiment and registered model, served model, image, container): each key of
NAMED_KEYS left empty is made from `name`, and an empty `name` from the data."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeline.data.sources import DATA_SOURCES, DEFAULT_SOURCE

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# Keys left empty take a name made from `name`.
NAMED_KEYS = {
    ("tracking", "experiment"): "{name}",
    ("tracking", "registered_model_name"): "{name}-classifier",
    ("serve", "model_name"): "{name}",
    ("serve", "title"): "{name} image classifier",
    ("containerize", "image"): "{name}-server",
    ("deploy", "container_name"): "{name}-server",
}
# Folder names that say nothing about the data: a name is taken from the folder above them.
_GENERIC_FOLDERS = {"train", "training", "data", "raw", "images", "imgs", "dataset", "datasets", "photos", "all", "."}


def name_of_data(source: str, root: Any) -> str:
    """A project name from the data: the source's own (DataSource.name), else the data folder's (or CSV's) name,
    skipping folder names that say nothing (train, data, images, ...)."""
    known = DATA_SOURCES.get(source)
    if known and known.name:
        return known.name
    path = Path(str(root or "")).expanduser().absolute()
    parts = [path.stem if known and known.root_is_file else path.name, *(p.name for p in path.parents)]
    for part in parts:
        slug = re.sub(r"[^a-z0-9]+", "-", part.lower()).strip("-")[:63].strip("-")
        if slug and slug not in _GENERIC_FOLDERS:
            return slug
    return "images"


def with_names(raw: dict[str, Any]) -> dict[str, Any]:
    """`name` (else the data's name) and every empty key of NAMED_KEYS made from it."""
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    name = raw.get("name") or name_of_data(str(data.get("source") or DEFAULT_SOURCE), data.get("root"))
    named: dict[str, Any] = {**raw, "name": name}
    for (section, key), template in NAMED_KEYS.items():
        values = named.get(section)
        if values is None or isinstance(values, dict):
            values = dict(values or {})
            if not values.get(key) and isinstance(name, str):
                values[key] = template.format(name=name)
            named[section] = values
    return named
