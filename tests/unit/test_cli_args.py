"""Flags generated from options dataclasses (``bertpipe.cli_args``): names, types, defaults,
help from the field docstrings; and ``bertpipe plan`` / ``bertpipe runs compare`` keep every
flag they had when their flags were written by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bertpipe.app.compare.cli import COMPARE_FLAGS
from bertpipe.app.compare.query import CompareQuery
from bertpipe.cli_args import Flag, add_dataclass_arguments, dataclass_from_args
from bertpipe.errors import BertpipeError
from bertpipe.training.plan.cli import PLAN_FLAGS
from bertpipe.training.plan.options import PlanOptions


@dataclasses.dataclass
class Options:
    """A toy options class."""

    size: int = 3
    """How many, at 100% (a percent sign must survive argparse)."""
    rate: float | None = None
    """The rate; unset: derived."""
    name: str = "x"
    verbose: bool = False
    """Say more."""
    order: bool | None = None
    """Ascending."""
    lengths: tuple[int, ...] = ()
    """Lengths per phase."""
    words: list[str] = dataclasses.field(default_factory=list)
    """Words to keep."""
    pairs: dict[str, str] = dataclasses.field(default_factory=dict)
    """KEY=VALUE pairs."""


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BertpipeError(f"bad --pair {item!r}")
        out[key] = value
    return out


FLAGS = {
    "lengths": Flag("--length", metavar="N[,N...]", separator=","),
    "pairs": Flag("--pair", parse=_pairs),
    "order": Flag(negative="--reverse"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_dataclass_arguments(parser, Options, FLAGS)
    return parser


def _build(*argv: str) -> Options:
    return dataclass_from_args(Options, _parser().parse_args(list(argv)), FLAGS)


def test_no_flags_give_the_defaults() -> None:
    assert _build() == Options()


def test_every_kind_of_field() -> None:
    options = _build(
        "--size", "5", "--rate", "0.5", "--name", "y", "--verbose", "--reverse",
        "--length", "128,512", "--length", "64", "--words", "a", "--words", "b",
        "--pair", "k=v",
    )  # fmt: skip
    assert options == Options(
        size=5,
        rate=0.5,
        name="y",
        verbose=True,
        order=False,
        lengths=(128, 512, 64),
        words=["a", "b"],
        pairs={"k": "v"},
    )
    assert _build("--order").order is True


def test_bad_values() -> None:
    with pytest.raises(BertpipeError, match=r"--length '12x': expected integers"):
        _build("--length", "12x")
    with pytest.raises(BertpipeError, match="bad --pair"):
        _build("--pair", "novalue")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--order", "--reverse"])  # one or the other


def test_help_is_the_field_docstring_with_its_default() -> None:
    text = " ".join(_parser().format_help().split())
    assert (
        "--size SIZE How many, at 100% (a percent sign must survive argparse); default 3." in text
    )
    assert "--rate RATE The rate; unset: derived." in text
    assert "--length N[,N...] Lengths per phase; repeatable, or comma-separated." in text
    assert "--reverse the opposite of --order" in text


def test_types_that_cannot_be_flags() -> None:
    @dataclasses.dataclass
    class Bad:
        on: bool = True

    with pytest.raises(TypeError, match=r"Bad\.on"):
        add_dataclass_arguments(argparse.ArgumentParser(), Bad)

    @dataclasses.dataclass
    class Nested:
        options: Options = dataclasses.field(default_factory=Options)

    with pytest.raises(TypeError, match=r"Nested\.options"):
        add_dataclass_arguments(argparse.ArgumentParser(), Nested)


# --------------------------------------------------------------------------- plan, runs


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_plan_flags_are_the_hand_written_ones_and_cover_every_field() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, PlanOptions, PLAN_FLAGS)
    assert {
        "--nodes",
        "--gpus-per-node",
        "--gpu",
        "--gpu-memory-gb",
        "--mfu",
        "--inter-node-gbps",
        "--intra-node-gbps",
        "--overlap",
        "--seq-len",
        "--vocab-size",
        "--cuda-overhead-gb",
        "--attention-scores",
    } <= _options(parser)
    assert dataclass_from_args(PlanOptions, parser.parse_args([]), PLAN_FLAGS) == PlanOptions()
    assert all(action.help for action in parser._actions), "a field without a docstring"
    args = parser.parse_args(["--mfu", "0.5", "--seq-len", "64,256", "--attention-scores"])
    options = dataclass_from_args(PlanOptions, args, PLAN_FLAGS)
    assert (options.mfu, options.seq_lens, options.attention_scores_stored) == (
        0.5,
        (64, 256),
        True,
    )


def test_compare_flags_are_the_hand_written_ones_and_cover_every_field() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, CompareQuery, COMPARE_FLAGS)
    assert _options(parser) == {
        "-h",
        "--help",
        "--tracking-uri",
        "--experiment",
        "--stage",
        "--tag",
        "--children-of",
        "--all-states",
        "--max-runs",
        "--metric",
        "--param",
        "--sort",
        "--ascending",
        "--descending",
    }
    assert dataclass_from_args(CompareQuery, parser.parse_args([]), COMPARE_FLAGS) == (
        CompareQuery()
    )
    assert all(action.help for action in parser._actions), "a field without a docstring"
    args = parser.parse_args(["--tag", "a=b", "--metric", "eval/*", "--descending"])
    query = dataclass_from_args(CompareQuery, args, COMPARE_FLAGS)
    assert (query.tags, query.metrics, query.ascending) == ({"a": "b"}, ["eval/*"], False)
