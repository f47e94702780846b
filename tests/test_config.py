from pathlib import Path

import pytest

from pipeline.config import ConfigError, Params, load_params, parse_params, set_params

REPO = Path(__file__).resolve().parent.parent


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
    config = parse_params({"data": {"root": "data/raw"}}).data
    monkeypatch.delenv("GTSRB_ROOT", raising=False)
    assert config.resolved_root() == Path("data/raw")
    monkeypatch.setenv("GTSRB_ROOT", "/elsewhere")
    assert config.resolved_root() == Path("/elsewhere")


def test_set_params_edits_in_place_keeping_comments(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    path.write_text(original)
    params = set_params(path, ["train.epochs=2", "benchmark.backends=[onnxruntime]", "monitor.url=http://h:1"])
    assert params.train.epochs == 2 and params.benchmark.backends == ["onnxruntime"]
    assert load_params(path) == params
    text = path.read_text()
    assert "  epochs: 2\n" in text and '  url: "http://h:1"' in text
    assert len(text.splitlines()) == len(original.splitlines())
    assert sum(line.count("#") for line in text.splitlines()) == sum(line.count("#") for line in original.splitlines())


def test_set_params_refuses_mistakes_without_writing(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())
    before = path.read_text()
    for bad, message in [
        ("train.epoch=2", "train.epoch: unknown key"),
        ("train.epochs=many", "train.epochs: input should be a valid integer"),
        ("epochs=2", "expected SECTION.KEY=VALUE"),
    ]:
        with pytest.raises(ConfigError, match=message):
            set_params(path, [bad])
    assert path.read_text() == before
