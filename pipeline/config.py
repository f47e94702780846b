"""Typed, validated configuration: params.yaml -> pydantic models, checked once at the edge.

Every section is strict (no silent type coercion) and forbids unknown keys, so a typo in params.yaml
stops the run with a one-line message naming the key instead of being ignored.
Three layers make the params a stage sees: the field defaults (the sections' models: pipeline/params/), under the
recipe's values (`recipe`: pipeline/recipes/<name>.yaml, or a YAML file of your own), under params.yaml's own keys.
A key that params.yaml leaves out or sets to null (`~`) takes the recipe's value, so one key picks a recipe and any
key you set still wins. The names a run carries (MLflow experiment and registered model, served model, image,
container) follow `name` (pipeline/params/names.py).

This module holds `Params` (the whole file) and the layering (`parse_params`, `load_params`, `explain`); the
sections live in pipeline/params/ and every name is importable from here. Of the package it imports only
pipeline/params/, the data sources' table (pipeline/data/sources.py) and, to check a network's name, the networks'
table (pipeline/architectures/__init__.py): no torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.data.sources import DATA_SOURCES, DEFAULT_SOURCE, recipe_for
from pipeline.params.base import LIBRARY_NETWORK, AmpMode, OnOffAuto, PathField, Section
from pipeline.params.names import NAME_PATTERN, NAMED_KEYS, name_of_data, with_names
from pipeline.params.serving import (
    MONITOR_URL_ENV,
    BenchmarkConfig,
    ContainerizeConfig,
    DeployConfig,
    DriftConfig,
    MonitorConfig,
    SampleLogConfig,
    ServeConfig,
)
from pipeline.params.training import (
    AugmentParams,
    DataConfig,
    EvaluateConfig,
    ModelConfig,
    OptimizeConfig,
    RegularizeParams,
    SearchRange,
    TrackingConfig,
    TrainConfig,
    TuneConfig,
)

# Every name, in the order the API page (docs/api/config.md) shows them.
__all__ = [  # noqa: RUF022
    "PathField",
    "OnOffAuto",
    "AmpMode",
    "MONITOR_URL_ENV",
    "RECIPES_DIR",
    "NAME_PATTERN",
    "NAMED_KEYS",
    "Section",
    "DataConfig",
    "LIBRARY_NETWORK",
    "ModelConfig",
    "TrainConfig",
    "AugmentParams",
    "RegularizeParams",
    "EvaluateConfig",
    "TrackingConfig",
    "BenchmarkConfig",
    "SampleLogConfig",
    "ServeConfig",
    "OptimizeConfig",
    "ContainerizeConfig",
    "DeployConfig",
    "DriftConfig",
    "MonitorConfig",
    "SearchRange",
    "TuneConfig",
    "Params",
    "ConfigError",
    "recipe_names",
    "read_recipe",
    "name_of_data",
    "recipe_layer",
    "resolve",
    "with_names",
    "explain",
    "parse_params",
    "load_params",
]

RECIPES_DIR = Path(__file__).with_name("recipes")


class Params(Section):
    """The whole of params.yaml: the recipe applied, the project's name, the memory budget and every section."""

    recipe: str = Field(recipe_for(DEFAULT_SOURCE), min_length=1)
    """The defaults under your keys: `auto` (the data source's recipe: `photos` for a folder or CSV), a built-in
    recipe by name (pipeline/recipes/: `photos`, a network and input size for ordinary photos), or a YAML file of
    your own (params.yaml's sections) over the built-in recipe `auto` would pick. It sets the keys
    params.yaml leaves at ~. Parsed params hold the recipe that was applied."""
    name: str = Field(DATA_SOURCES[DEFAULT_SOURCE].name or "images", pattern=NAME_PATTERN)
    """Your project's name: the MLflow experiment, registered model, served model, image and container take it
    (each can still be set on its own). Empty: the data source's name for its data, else the data folder's."""
    memory_gb: float = Field(4.0, ge=0.0, le=65536.0)
    """The resident memory a stage may use on the CPU, in GB: evaluation batches larger than fit at the data's image
    size are lowered, and a training batch is stepped as micro-batches whose gradients add up (the same update).
    Logged when it happens; 0 = no limit (pipeline/machine/memory_budget.py)."""
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    augment: AugmentParams = AugmentParams()
    regularize: RegularizeParams = RegularizeParams()
    evaluate: EvaluateConfig = EvaluateConfig()
    optimize: OptimizeConfig = OptimizeConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    serve: ServeConfig = ServeConfig()
    containerize: ContainerizeConfig = ContainerizeConfig()
    deploy: DeployConfig = DeployConfig()
    monitor: MonitorConfig = MonitorConfig()
    tracking: TrackingConfig = TrackingConfig()
    tune: TuneConfig = TuneConfig()

    @model_validator(mode="before")
    @classmethod
    def _names(cls, raw: Any) -> Any:
        return with_names(raw) if isinstance(raw, dict) else raw


class ConfigError(Exception):
    """A user mistake in params.yaml: the message is meant to be shown as is, without a traceback."""


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; see params.yaml for the valid keys)"
    given = error.get("input")
    return f"{where}: {error['msg'].lower()}, got {given!r}"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def read_recipe(recipe: str, source: str = "params.yaml") -> dict[str, Any]:
    """A recipe's sections: a built-in name (pipeline/recipes/<name>.yaml) or a path to a YAML file of yours."""
    path = RECIPES_DIR / f"{recipe}.yaml" if re.fullmatch(r"[a-z0-9_-]+", recipe) else Path(recipe)
    if not path.is_file():
        raise ConfigError(
            f"{source}: recipe: {recipe!r} is neither a built-in recipe ({', '.join(recipe_names())}, auto) "
            "nor a YAML file"
        )
    try:
        layer = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path}: not valid YAML") from None
    if not isinstance(layer, dict) or {"recipe", "name"} & set(layer):
        raise ConfigError(f"{path}: a recipe is a mapping of params.yaml's sections (not recipe or name)")
    return layer


def _without_nulls(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_nulls(v) if isinstance(v, dict) else v for k, v in raw.items() if v is not None}


def _merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(under)
    for key, value in over.items():
        below = merged.get(key)
        merged[key] = _merge(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def recipe_layer(recipe: str, data_source: str, source: str = "params.yaml") -> dict[str, Any]:
    """A built-in recipe's keys; a file of yours over the built-in recipe your data would get."""
    layer = _without_nulls(read_recipe(recipe, source))
    if recipe not in recipe_names():
        layer = _merge(_without_nulls(read_recipe(recipe_for(data_source), source)), layer)
    return layer


def resolve(raw: dict[str, Any], source: str = "params.yaml") -> dict[str, Any]:
    """params.yaml's keys (nulls left out) over the recipe's: what Params validates (its names: with_names)."""
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    data_source = str(data.get("source") or DEFAULT_SOURCE)
    recipe = raw.get("recipe") or "auto"
    if not isinstance(recipe, str):
        raise ConfigError(f"{source}: recipe: expected a recipe name or a YAML file, got {recipe!r}")
    if recipe == "auto":
        recipe = recipe_for(data_source)
    merged = _merge(recipe_layer(recipe, data_source, source), _without_nulls(raw))
    merged["recipe"] = recipe
    return merged


def explain(raw: Any, source: str = "params.yaml") -> list[tuple[str, Any, str]]:
    """(key, value, origin) of every key a run uses: `params.yaml`, `recipe <name>`, `name` or `default`."""
    params = parse_params(raw, source)
    given = _without_nulls(raw) if isinstance(raw, dict) else {}
    layer = recipe_layer(params.recipe, params.data.source, source)
    chosen = source if raw.get("recipe") not in (None, "auto") else f"auto, for data.source {params.data.source}"
    rows: list[tuple[str, Any, str]] = [("recipe", params.recipe, chosen)]
    rows.append(("name", params.name, source if given.get("name") else "the data"))
    for section, values in params.model_dump(mode="json", exclude={"recipe", "name"}).items():
        if not isinstance(values, dict):  # a top-level key (memory_gb)
            origin = source if section in given else f"recipe {params.recipe}" if section in layer else "default"
            rows.append((section, values, origin))
            continue
        for key, value in values.items():
            if (section, key) in NAMED_KEYS and not (given.get(section) or {}).get(key):
                origin = "name"
            elif key in (given.get(section) or {}):
                origin = source
            elif key in (layer.get(section) or {}):
                origin = f"recipe {params.recipe}"
            else:
                origin = "default"
            rows.append((f"{section}.{key}", value, origin))
    return rows


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    raw = resolve(raw, source)
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(err)}" for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_params(path: Path = Path("params.yaml")) -> Params:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (run from the project root or pass --params)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}") from None
    return parse_params(raw, str(path))
