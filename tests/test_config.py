from pathlib import Path

import pytest

from pipeline.config import NAMED_KEYS, ConfigError, Params, load_params, parse_params
from tests.helpers import REPO


def test_repository_params_are_valid() -> None:
    params = load_params(REPO / "params.yaml")
    assert isinstance(params, Params)
    assert params.data.image_size >= 8


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        parse_params({"data": {"image_sise": 32}})
    assert str(info.value) == (
        "params.yaml: data.image_sise: unknown key (check the spelling; see params.yaml for the valid keys)"
    )


def test_unknown_section_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^params.yaml: trian: unknown key"):
        parse_params({"trian": {}})


def test_wrong_type_names_key_and_expectation() -> None:
    with pytest.raises(ConfigError) as info:
        parse_params({"data": {"image_size": "32"}})
    message = str(info.value)
    assert message.startswith("params.yaml: data.image_size: input should be a valid integer")
    assert "'32'" in message
    assert "\n" not in message


def test_out_of_range_value() -> None:
    with pytest.raises(ConfigError, match=r"data.val_fraction: input should be less than 0.5, got 0.7"):
        parse_params({"data": {"val_fraction": 0.7}})


def test_an_unquoted_off_is_the_word_as_dvc_exp_run_writes_it(tmp_path: Path) -> None:
    """`dvc exp run -S optimize.bf16=off` writes `bf16: off` (YAML 1.2, a string), which PyYAML reads as false."""
    written = tmp_path / "params.yaml"
    written.write_text("optimize:\n  bf16: off\ntrain:\n  amp: off\n")
    params = load_params(written)
    assert (params.optimize.bf16, params.train.amp) == ("off", "off")
    written.write_text("optimize:\n  bf16: on\n")
    assert load_params(written).optimize.bf16 == "on"
    with pytest.raises(ConfigError, match=r"train.amp: input should be 'auto', 'bf16' or 'off', got 'on'"):
        parse_params({"train": {"amp": True}})


def test_every_error_gets_its_own_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_params({"data": {"image_size": 2, "seed": "x"}})
    assert len(str(info.value).splitlines()) == 2


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_params([1, 2])


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_params(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "missing.yaml")


def test_params_yaml_and_the_config_defaults_are_one_set() -> None:
    """A key params.yaml writes out means what config.py's default says; a key it leaves to the recipe (~) is set by
    every built-in recipe; and params.yaml spells out every key, so it documents the whole configuration."""
    import yaml

    from pipeline.config import read_recipe, recipe_names

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    defaults = Params().model_dump(mode="json")
    shipped = load_params(REPO / "params.yaml").model_dump(mode="json")
    named = {f"{s}.{k}" for s, k in NAMED_KEYS}
    differ = [
        f"{section}.{key}: params.yaml {shipped[section][key]!r}, config.py {defaults[section][key]!r}"
        for section, fields in raw.items()
        if isinstance(fields, dict)
        for key, value in fields.items()
        if value is not None and f"{section}.{key}" not in named and defaults[section][key] != shipped[section][key]
    ]
    assert differ == []
    missing = [f"{s}.{k}" for s, fields in defaults.items() if isinstance(fields, dict) for k in fields
               if k not in raw.get(s, {})]  # fmt: skip
    assert missing == []
    left_to_recipe = {f"{s}.{k}" for s, fields in raw.items() if isinstance(fields, dict)
                      for k, v in fields.items() if v is None}  # fmt: skip
    assert len(left_to_recipe) > 10
    assert "photos" in recipe_names()
    for recipe in recipe_names():
        layer = read_recipe(recipe)
        keys = {f"{s}.{k}" for s, fields in layer.items() for k in fields}
        assert keys == left_to_recipe, f"recipe {recipe} and params.yaml's ~ keys differ: {keys ^ left_to_recipe}"


def _raw(**data: object) -> dict[str, object]:
    """params.yaml with these data keys, its names left to `name` (a generated project writes its own in)."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update(data)
    raw["name"] = ""
    for section, key in NAMED_KEYS:
        raw[section][key] = ""
    return raw


def test_one_key_picks_the_recipe_and_auto_follows_the_data(tmp_path: Path) -> None:
    photos = parse_params(_raw(source="folder", root=str(tmp_path / "pets")))
    assert photos.recipe == "photos"
    assert photos.data.image_size > 32 and photos.data.resize == "center_crop" and photos.augment.hflip
    # photos move and scale by random-resized crops alone: no affine on top
    affine = photos.augment.rotation, photos.augment.translate, photos.augment.scale, photos.augment.shear
    assert affine == (0, 0, 0, 0)
    assert photos.evaluate.min_accuracy == 0.0 and photos.train.train_on_val  # decided on validation, then fitted on it
    assert photos.train.from_pretrained == "features" and photos.model.weights == "auto"
    # A recipe of your own: a YAML file of params.yaml's sections.
    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  image_size: 48\nmodel:\n  members: 3\n")
    own = parse_params({**_raw(source="folder", root=str(tmp_path / "pets")), "recipe": str(mine)})
    assert (own.data.image_size, own.model.members, own.model.name) == (48, 3, photos.model.name)
    with pytest.raises(ConfigError, match="neither a built-in recipe"):
        parse_params({**_raw(source="folder"), "recipe": "nope"})


def test_a_key_you_set_wins_over_the_recipe(tmp_path: Path) -> None:
    raw = _raw(source="folder", root=str(tmp_path / "pets"), image_size=64)
    raw["model"]["members"] = 3
    raw["model"]["name"] = "signnet"
    params = parse_params(raw)
    assert (params.recipe, params.data.image_size, params.model.members, params.model.name) == (
        "photos",
        64,
        3,
        "signnet",
    )
    assert params.augment.hflip  # the rest is still the recipe's
    # What a run used, written out and read back (the server's workers, tests), is the same params.
    assert parse_params(params.model_dump(mode="json")) == params


def test_pipeline_params_says_where_every_value_came_from(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    from pipeline.config import explain

    raw = _raw(source="folder", root=str(tmp_path / "pets"), image_size=64)
    rows = {key: (value, origin) for key, value, origin in explain(raw)}
    assert rows["recipe"] == ("photos", "auto, for data.source folder")
    assert rows["data.image_size"] == (64, "params.yaml")
    assert rows["model.name"][1] == "recipe photos" and rows["train.lr"][1] == "params.yaml"
    assert rows["memory_gb"] == (4.0, "params.yaml") and rows["name"] == ("pets", "the data")
    assert rows["tracking.registered_model_name"] == ("pets-classifier", "name")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    shown = subprocess.run([sys.executable, "-m", "pipeline.cli", "params"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert (
        "memory_gb = 4.0" in shown.stdout and "model.name = 'timm/efficientnet_lite0'  (recipe photos)" in shown.stdout
    )


def test_a_folder_run_carries_its_own_names(tmp_path: Path) -> None:
    folder = tmp_path / "pets" / "train"
    params = parse_params(_raw(source="folder", root=str(folder)))
    names = [params.name, params.tracking.experiment, params.tracking.registered_model_name, params.serve.model_name,
             params.serve.title, params.containerize.image, params.deploy.container_name]  # fmt: skip
    assert names == ["pets", "pets", "pets-classifier", "pets", "pets image classifier", "pets-server", "pets-server"]
    named = parse_params({**_raw(source="folder", root=str(folder)), "name": "flowers"})
    assert (named.tracking.registered_model_name, named.containerize.image) == ("flowers-classifier", "flowers-server")
    with pytest.raises(ConfigError, match="name"):
        parse_params({**_raw(source="folder", root=str(folder)), "name": "Not A Name"})
