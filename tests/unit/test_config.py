"""Config loading: types, unknown keys, precedence, nested sections, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from bertpipe.config import ConfigError, field_docs, flatten, load_config, to_dict, to_yaml


@dataclass
class Inner:
    size: int = 3
    """How big."""
    rate: float = 0.5
    mode: Literal["a", "b"] = "a"

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ConfigError("size", "must not be negative")


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    items: list[Inner] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    maybe: int | None = None
    flag: bool = False


def test_defaults_file_and_overrides_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: file\ninner:\n  size: 7\n  rate: 1\n")
    cfg = load_config(Outer, str(path), ["inner.size=9", "items=[{size: 1}, {mode: b}]", "maybe=4"])
    assert cfg.name == "file"
    assert cfg.inner.size == 9 and cfg.inner.rate == 1.0 and isinstance(cfg.inner.rate, float)
    assert [i.size for i in cfg.items] == [1, 3] and cfg.items[1].mode == "b"
    assert cfg.maybe == 4


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("inner.sise=3", "inner.sise", "unknown key"),
        ("inner.size=abc", "inner.size", "expected an integer"),
        ("inner.mode=c", "inner.mode", "must be one of"),
        ("flag=yes please", "flag", "expected true or false"),
        ("inner.size=-1", "inner.size", "must not be negative"),
        ("items=[{size: -2}]", "items[0].size", "must not be negative"),
        ("inner=3", "inner", "expected a section"),
        ("name", "name", "key=value"),
    ],
)
def test_errors_name_the_full_key(override: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Outer, None, [override])
    assert info.value.key == key
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_or_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Outer, str(bad))


def test_round_trip_yaml_and_flatten(tmp_path: Path) -> None:
    cfg = load_config(Outer, None, ["tags={a: b}", "items=[{size: 2}]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(Outer, str(path)) == cfg
    flat = flatten(to_dict(cfg))
    assert flat["inner.size"] == 3 and flat["tags.a"] == "b"


def test_field_docs_are_read_from_the_class() -> None:
    assert field_docs(Inner)["size"] == "How big."


def test_shipped_stage_configs_validate() -> None:
    """Every YAML recipe shipped under configs/ parses into its stage's config."""
    from bertpipe.preprocessing.config import PreprocessConfig, TokenizerConfig
    from bertpipe.training.pretrain.config import PretrainConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    classes = {
        "tokenizer": TokenizerConfig,
        "preprocess": PreprocessConfig,
        "pretrain": PretrainConfig,
    }
    checked = set()
    for path in sorted(root.glob("*.yaml")):
        stage = path.stem.split("-")[0]
        assert stage in classes, f"{path.name}: name it <stage>-<what>.yaml"
        cfg = load_config(classes[stage], str(path))
        checked.add(stage)
        if isinstance(cfg, PretrainConfig):  # the batch arithmetic of the intended cluster
            world = {"pretrain-bert-large-lamb": 32, "pretrain-bert-base-adamw": 8}.get(
                path.stem, 1
            )
            cfg.check_world(world)
    assert checked == set(classes)


def test_list_items_are_addressed_by_index(tmp_path: Path) -> None:
    cfg = load_config(Outer, None, ["items=[{size: 1}, {size: 2}]", "items[1].mode=b"])
    assert cfg.items[1].mode == "b" and cfg.items[0].mode == "a"
    with pytest.raises(ConfigError) as info:
        load_config(Outer, None, ["items=[{size: 1}]", "items[3].size=2"])
    assert info.value.key == "items[3]" or "has no item 3" in str(info.value)
    # a list the file leaves unset comes from the dataclass defaults
    from bertpipe.training.pretrain.config import PretrainConfig

    pre = load_config(
        PretrainConfig, None, ["phases[0].max_steps=7", "phases[0].data=s3://b/seq128"]
    )
    assert pre.phases[0].max_steps == 7 and pre.phases[0].data == "s3://b/seq128"
    with pytest.raises(ConfigError, match=r"a\.b\.c or a\[0\]\.b"):
        load_config(Outer, None, ["items[x].size=2"])
