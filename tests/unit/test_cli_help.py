"""``bertpipe <stage> --help``: every config key, sections, examples that load, global flags.

The CLI runs in-process (``bertpipe.app.cli.main``); help exits through ``SystemExit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import shlex
import subprocess
import sys
import typing
from collections.abc import Iterator

import pytest
import yaml

from bertpipe.app.cli import build_parser, main
from bertpipe.cli_args import ConfigHelpAction
from bertpipe.config import field_docs, load_config
from bertpipe.config_help import config_sections, load_class
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.evaluation.config import EvaluateConfig
from bertpipe.preprocessing.config import PreprocessConfig, TokenizerConfig
from bertpipe.training.pretrain.config import PretrainConfig

# stage command -> the config its handler loads (checked against each parser's help action)
STAGES: dict[tuple[str, ...], type] = {
    ("tokenizer", "train"): TokenizerConfig,
    ("preprocess",): PreprocessConfig,
    ("pretrain",): PretrainConfig,
    ("plan",): PretrainConfig,
    ("finetune",): FinetuneConfig,
    ("sweep",): FinetuneConfig,
    ("evaluate",): EvaluateConfig,
}
STAGE_IDS = [" ".join(k) for k in STAGES]


@pytest.fixture(autouse=True)
def _fixed_width_and_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Help at a known width; main() sets up logging, which is put back afterwards."""
    monkeypatch.setenv("COLUMNS", "100")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run_help(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def expected_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of ``cls`` as the help names it, walked here independently of the code."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f"{prefix}{f.name}"
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            keys += expected_keys(hint, key + ".")
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            keys += expected_keys(args[0], key + "[i].")
        else:
            keys.append(key)
    return keys


def expected_docs(cls: type) -> list[str]:
    docs = [" ".join(d.replace("``", "`").split()) for d in field_docs(cls).values()]
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            docs += expected_docs(hint)
        elif args and dataclasses.is_dataclass(args[0]):
            docs += expected_docs(args[0])
    return docs


def listed_keys(out: str) -> set[str]:
    # a key whose type is too long for its line has the type on the next one
    return set(re.findall(r"^  (\S+)(?:  |\n)", out, flags=re.MULTILINE))


def flat(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------- full listing


@pytest.mark.parametrize("stage", list(STAGES), ids=STAGE_IDS)
def test_stage_help_lists_every_key_with_type_default_and_doc(
    stage: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    cls = STAGES[stage]
    code, out, _ = run_help(capsys, *stage, "--help")
    assert code == 0
    assert out.startswith(f"usage: bertpipe {' '.join(stage)}")
    keys = expected_keys(cls)
    assert len(keys) > 10
    missing = set(keys) - listed_keys(out)
    assert not missing, f"keys missing from `bertpipe {' '.join(stage)} --help`: {missing}"
    text = flat(out)
    docs = expected_docs(cls)
    assert len(docs) > 10
    for doc in docs:
        assert doc in text
    # every stage's help shows examples and the section names
    assert "examples:" in out
    assert "--help SECTION" in text


def test_types_defaults_and_sections_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_help(capsys, "pretrain", "--help")
    preset = r"^  model\.preset\s+\{tiny,mini,small,medium,base,large,modernbert-base,\s*"
    assert re.search(preset + r"modernbert-large\} =\s+base$", out, re.M)
    assert re.search(r"^  optimizer\.betas +\[float, float\] = \[0\.9, 0\.999\]", out, re.M)
    assert re.search(r"^  only_phase +str \| null = null", out, re.M)
    assert re.search(r"^  phases\[i\]\.learning_rate +float = 0\.0001", out, re.M)
    assert re.search(
        r"^  log_every_steps +int = 10 +Log metrics every N optimizer steps\.$", out, re.M
    )
    for title in ("top-level keys", "model.*", "phases[i].*", "optimizer.*", "zero.*"):
        assert re.search(rf"^{re.escape(title)}", out, re.M), title
    for title in ("checkpoint.*", "tracking.*", "data.*", "eval.*"):
        assert re.search(rf"^{re.escape(title)}", out, re.M), title
    # a section's default comes from the parent config: finetune's ZeRO defaults to stage 0
    _, out, _ = run_help(capsys, "finetune", "--help", "zero.stage")
    assert re.search(r"^  zero\.stage +int = 0", out, re.M)


def test_description_is_for_users_and_names_real_recipes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bertpipe.recipes import shipped

    _, out, _ = run_help(capsys, "pretrain", "--help")
    assert "pretrain-bert-large.yaml" not in out
    assert "parsers and handlers" not in out  # the module docstring is not the description
    assert "bert-large-lamb" in out
    names = {r.short for r in shipped()}
    for stage in STAGES:
        _, out, _ = run_help(capsys, *stage, "--help")
        for name in re.findall(r"--config (\S+)", out):
            if name not in ("CONFIG", "file", "takes"):
                assert name in names, f"{stage}: --config {name} is no shipped recipe"


# --------------------------------------------------------------------------- one section


def test_help_section_shows_only_that_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_help(capsys, "pretrain", "--help", "optimizer")
    assert code == 0
    keys = listed_keys(out)
    assert keys == {k for k in expected_keys(PretrainConfig) if k.startswith("optimizer.")}
    assert "model.preset" not in out and "usage:" not in out
    assert out.startswith("optimizer.*")

    for query in ("phases", "phases[i]", "phases[0]", "phases.*"):
        _, out, _ = run_help(capsys, "pretrain", "--help", query)
        assert listed_keys(out) == {
            k for k in expected_keys(PretrainConfig) if k.startswith("phases[i].")
        }, query

    _, out, _ = run_help(capsys, "pretrain", "--help", "top")
    assert "output" in listed_keys(out) and "model.preset" not in out


def test_help_one_key_and_bare_field_name(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_help(capsys, "pretrain", "--help", "zero.stage")
    assert listed_keys(out) == {"zero.stage"}
    _, out, _ = run_help(capsys, "pretrain", "--help", "phases[1].max_steps")
    assert listed_keys(out) == {"phases[i].max_steps"}
    _, out, _ = run_help(capsys, "pretrain", "--help", "learning_rate")
    assert listed_keys(out) == {"phases[i].learning_rate"}
    _, out, _ = run_help(capsys, "finetune", "--help", "learning_rate")  # a key: just that
    assert listed_keys(out) == {"learning_rate"}
    _, out, _ = run_help(capsys, "finetune", "--help", "max_seq_length")
    assert listed_keys(out) == {"task.max_seq_length"}
    _, out, _ = run_help(capsys, "preprocess", "--help", "paths")  # every key of that name
    assert listed_keys(out) == {"input.paths", "quality.decontaminate.paths"}


def test_help_config_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_help(capsys, "preprocess", "--help-config")
    assert code == 0 and "usage:" not in out
    assert set(expected_keys(PreprocessConfig)) <= listed_keys(out)
    _, out, _ = run_help(capsys, "preprocess", "--help-config", "masking")
    assert listed_keys(out) == {k for k in expected_keys(PreprocessConfig) if "masking." in k}
    _, out, _ = run_help(capsys, "tokenizer", "train", "-h", "input")
    assert "input.paths" in listed_keys(out) and "vocab_size" not in out


def test_unknown_section_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_help(capsys, "pretrain", "--help", "optimiser")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "optimiser" in lines[0]
    for name in ("model", "phases", "optimizer", "zero", "checkpoint", "tracking"):
        assert name in lines[0]


def test_listing_without_source_still_has_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    def no_source(obj: object) -> str:
        raise OSError("no source")

    monkeypatch.setattr(inspect, "getsource", no_source)
    sections = config_sections(PretrainConfig)
    keys = {k.key for s in sections for k in s.keys}
    assert keys == set(expected_keys(PretrainConfig))
    assert all(k.doc == "" for s in sections for k in s.keys)


# --------------------------------------------------------------------------- examples


def help_actions() -> dict[tuple[str, ...], ConfigHelpAction]:
    """The ``--help`` action of every command that reads a config (found by ``--config``)."""
    found: dict[tuple[str, ...], ConfigHelpAction] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*path, name))
        if "--config" in parser._option_string_actions:
            action = parser._option_string_actions["--help"]
            assert isinstance(action, ConfigHelpAction), path
            found[path] = action

    walk(build_parser(), ())
    return found


def test_every_config_command_lists_the_config_its_handler_loads() -> None:
    actions = help_actions()
    assert set(actions) == set(STAGES)
    for stage, action in actions.items():
        assert load_class(action.config) is STAGES[stage], stage


@pytest.mark.parametrize("stage", list(STAGES), ids=STAGE_IDS)
def test_examples_are_shown_and_load(
    stage: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    action = help_actions()[stage]
    cls = STAGES[stage]
    assert action.examples and action.example
    # the KEY=VALUE example of this stage loads into this stage's config
    load_config(cls, None, shlex.split(action.example))
    _, out, _ = run_help(capsys, *stage, "--help")
    assert flat(action.example) in flat(out)  # shown in the KEY=VALUE help
    shown = flat(out.split("examples:", 1)[1].split("config keys:", 1)[0].replace("\\\n", " "))
    for line in action.examples:
        argv = shlex.split(line, comments=True)
        assert argv[0] == "bertpipe" and tuple(argv[1 : 1 + len(stage)]) == stage
        assert flat(line.split("  #")[0]) in shown
        # through the real command line, stopping after the config is resolved
        assert main([*argv[1:], "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        resolved = load_config(
            cls, argv[argv.index("--config") + 1] if "--config" in argv else None, overrides
        )
        assert printed == yaml.safe_load(_yaml(resolved))


def _yaml(cfg: object) -> str:
    from bertpipe.config import to_yaml

    return to_yaml(cfg)


def test_pretrain_example_keys_exist_in_pretrain_config() -> None:
    action = help_actions()[("pretrain",)]
    valid = set(expected_keys(PretrainConfig))
    for item in [*shlex.split(action.example), *shlex.split(" ".join(action.examples), True)]:
        if "=" in item and not item.startswith("-"):
            key = re.sub(r"\[\d+\]", "[i]", item.split("=")[0])
            assert key in valid, item


# --------------------------------------------------------------------------- global flags


@pytest.mark.parametrize(
    ("argv", "level", "traceback"),
    [
        (["pretrain"], "INFO", False),
        (["--log-level", "DEBUG", "pretrain"], "DEBUG", False),
        (["pretrain", "--log-level", "debug"], "DEBUG", False),
        (["--log-level", "WARNING", "pretrain", "--log-level", "ERROR"], "ERROR", False),
        (["--traceback", "pretrain"], "INFO", True),
        (["pretrain", "x=1", "--traceback"], "INFO", True),
        (["--local_rank=3", "pretrain", "--log-level", "DEBUG"], "DEBUG", False),
        (["tokenizer", "train", "--traceback", "--log-level", "WARNING"], "WARNING", True),
        (["tokenizer", "--log-level", "DEBUG", "train"], "DEBUG", False),
        (["export", "ckpt", "out", "--log-level", "DEBUG"], "DEBUG", False),
        (["runs", "compare", "--traceback"], "INFO", True),
        (["configs", "list", "--log-level", "ERROR"], "ERROR", False),
    ],
)
def test_global_flags_before_or_after_the_command(
    argv: list[str], level: str, traceback: bool
) -> None:
    args = build_parser().parse_args(argv)
    assert args.log_level == level
    assert args.traceback is traceback


def test_deepspeed_local_rank_before_the_command() -> None:
    args = build_parser().parse_args(["--local_rank=1", "pretrain", "--config", "demo"])
    assert args.local_rank == 1 and args.command == "pretrain" and args.config == "demo"


def test_log_level_after_the_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pretrain", "--config", "demo", "--print-config", "--log-level", "DEBUG"]
    assert main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["preset"] == "tiny"
    assert logging.getLogger().level == logging.DEBUG


def test_bad_log_level_is_refused_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_help(capsys, "pretrain", "--log-level", "LOUD")
    assert code == 2 and "--log-level" in err


# --------------------------------------------------------------------------- speed


def test_top_level_help_imports_no_config_module() -> None:
    code = (
        "import sys; from bertpipe.app.cli import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in sys.modules if m.startswith('bertpipe.') and "
        "(m.endswith('.config') and m != 'bertpipe.config' or m == 'bertpipe.config_help')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
