"""Config loading: YAML + overrides through one validation path, unknown keys rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from headway.config import describe, load_config, to_dict
from headway.errors import ConfigError
from headway.run_config import RunConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_and_overrides_are_typed_and_overrides_win(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "data:\n  sources: [chitchat, my.jsonl]\n  limit: 7\n"
        "train:\n  lr: 1e-4\n  max_steps: 300\n",
    )
    config = load_config(RunConfig, path, ["train.lr=3e-4", "data.pack=true", "data.limit=null"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.train.max_steps == 300
    assert isinstance(config.train.max_steps, int)
    assert config.data.sources == ["chitchat", "my.jsonl"]
    assert config.data.pack is True
    assert config.data.limit is None
    assert config.target.name == "smollm2-135m"  # untouched section keeps its defaults


def test_list_override_splits_on_commas() -> None:
    config = load_config(RunConfig, None, ["data.sources=a.jsonl,b.parquet"])
    assert config.data.sources == ["a.jsonl", "b.parquet"]
    bracketed = load_config(RunConfig, None, ["data.sources=[a.jsonl, b.parquet]"])
    assert bracketed.data.sources == ["a.jsonl", "b.parquet"]
    none = load_config(RunConfig, None, ["train.log_with=[]"])
    assert none.train.log_with == []


def test_empty_list_in_file_round_trips(tmp_path: Path) -> None:
    config = load_config(RunConfig, write(tmp_path, "train:\n  log_with: []\n"))
    assert config.train.log_with == []
    with pytest.raises(ConfigError, match=r"data\.max_length has an empty value"):
        load_config(RunConfig, write(tmp_path, "data:\n  max_length: []\n"))


def test_same_value_from_file_or_command_line_gives_same_config(tmp_path: Path) -> None:
    from_file = load_config(RunConfig, write(tmp_path, "train:\n  batch_size: 16\n"))
    from_cli = load_config(RunConfig, None, ["train.batch_size=16"])
    assert to_dict(from_file) == to_dict(from_cli)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.lrr=1"], "did you mean 'train.lr'"),
        (["trian.lr=1"], "did you mean 'train'"),
        (["train.lr=abc"], "train.lr: invalid float value"),
        (["train.mixed_precision=fp8"], "train.mixed_precision: invalid choice"),
        (["train.max_steps=0"], "train.max_steps=0 must be > 0"),
        (["train.warmup_steps=5000"], "train.warmup_steps=5000"),
        (["data.pack=maybe"], "data.pack"),
        (["train.lr=null"], "train.lr cannot be null"),
        (["train.log_with=mlflow"], "tensorboard and/or wandb"),
        (["lr=1"], "section.key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        load_config(RunConfig, None, overrides)


def test_unknown_key_in_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  learning_rate: 1e-3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, path)
    assert str(path) in str(caught.value)
    assert "unknown key 'train.learning_rate'" in str(caught.value)


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 1\n  bad: [unclosed\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:\d+: invalid YAML"):
        load_config(RunConfig, path)


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="holds a NUL byte"):
        load_config(RunConfig, f"{tmp_path}/recipe\0.yaml")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(RunConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="must be a mapping of keys"):
        load_config(RunConfig, write(tmp_path, "train: 3\n"))


def test_recipes_in_configs_folder_are_valid() -> None:
    recipes = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
    for recipe in recipes:
        load_config(RunConfig, recipe)


def test_describe_lists_every_key_with_help() -> None:
    text = describe(RunConfig)
    for key in ("target.name", "data.sources", "data.max_length", "train.lr", "train.log_with"):
        assert key in text
    assert "default 0.001" in text


def test_a_value_with_a_line_break_is_refused_on_one_line() -> None:
    """Found by tests/test_fuzz.py: the parser quotes a bad value back, line break and all."""
    with pytest.raises(ConfigError) as refused:
        load_config(RunConfig, None, ["eagle.fc_bias=0\n0"])
    assert "\n" not in str(refused.value) and "eagle.fc_bias" in str(refused.value)
