from pathlib import Path

import pytest

from pipeline.config import ConfigError, Params, load_params, parse_params
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


def test_gtsrb_root_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_params({"data": {"source": "gtsrb", "root": "data/raw"}}).data
    monkeypatch.delenv("GTSRB_ROOT", raising=False)
    assert config.resolved_root() == Path("data/raw")
    monkeypatch.setenv("GTSRB_ROOT", "/elsewhere")
    assert config.resolved_root() == Path("/elsewhere")


def test_params_yaml_and_the_config_defaults_are_one_set() -> None:
    """A key left out of a params file means what the shipped params.yaml says: the defaults agree, field by field."""
    import yaml

    shipped = load_params(REPO / "params.yaml")
    defaults = Params()
    default_values = defaults.model_dump()
    differ = [
        f"{section}.{key}: params.yaml {value!r}, config.py {default_values[section][key]!r}"
        for section, fields in shipped.model_dump().items()
        for key, value in fields.items()
        if default_values[section][key] != value
    ]
    assert differ == []
    # ... and params.yaml spells out every key, so it documents the whole configuration.
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = [f"{s}.{k}" for s, fields in defaults.model_dump().items() for k in fields if k not in raw.get(s, {})]
    assert missing == []
