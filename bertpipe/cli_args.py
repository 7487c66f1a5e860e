"""The command-line arguments every stage command shares, and flags made from dataclasses.

Stage command modules (``preprocessing/cli.py``, ``training/cli.py``, ``finetuning/cli.py``,
``training/plan/cli.py``) build their parsers with these helpers; the ``bertpipe`` program
that gathers them is the application layer's (:mod:`bertpipe.app.cli`).

* :func:`add_config_arguments` / :func:`config_from_args`: ``--config FILE.yaml`` and
  ``key.sub=value`` overrides (command line > file > defaults), ``--print-config``, and a
  ``-h/--help [SECTION]`` that lists every config key (:class:`ConfigHelpAction`, generated
  from the config dataclasses by :mod:`bertpipe.config_help`).
* :func:`add_stage_command`: one stage command registered in one call (its subparser, the
  config arguments above and its handler).
* :func:`add_global_options`: ``--log-level`` and ``--traceback``, before or after a command.
* :func:`add_dataclass_arguments` / :func:`dataclass_from_args`: one ``--flag`` per field of
  an options dataclass (``bertpipe plan``'s, ``bertpipe runs compare``'s), its type, default
  and help (the field's docstring) read from the class, so a flag cannot drift from the
  option it sets. :class:`Flag` renames a flag or adds what the class cannot say.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from bertpipe import fsio
from bertpipe.config import field_docs, load_config, to_yaml
from bertpipe.errors import BertpipeError

__all__ = [
    "LOG_LEVELS",
    "ConfigHelpAction",
    "Flag",
    "add_config_arguments",
    "add_dataclass_arguments",
    "add_global_options",
    "add_stage_command",
    "config_from_args",
    "dataclass_from_args",
    "write_resolved_config",
]

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# --------------------------------------------------------------------------- stage configs


class ConfigHelpAction(argparse.Action):
    """``-h/--help [SECTION]`` and ``--help-config [SECTION]`` of a stage command: print the
    help with the config keys of ``config`` (``"module:Class"``), or one SECTION's; the
    listing is built by :mod:`bertpipe.config_help`, imported only then."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: object = argparse.SUPPRESS,
        help: str | None = None,
        *,
        config: str,
        example: str = "",
        examples: Sequence[str] = (),
        full: bool = True,
    ) -> None:
        super().__init__(
            option_strings, dest, nargs="?", default=default, metavar="SECTION", help=help
        )
        self.config = config
        self.example = example
        self.examples = tuple(examples)
        self.full = full

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from bertpipe.config_help import print_config_help

        query = values if isinstance(values, str) else None
        print_config_help(parser, self.config, query, full=self.full, examples=self.examples)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config: str | None = None,
    *,
    example: str = "section.key=value",
    examples: Sequence[str] = (),
) -> None:
    """The arguments every stage command shares.

    ``config`` (``"package.module:ConfigClass"``, imported only when help is printed) makes
    ``-h/--help [SECTION]`` and ``--help-config [SECTION]`` list the config keys; the parser
    must then be created with ``add_help=False``. ``example`` is a few overrides shown in the
    KEY=VALUE help, ``examples`` whole command lines shown under "examples:" (both must load:
    tests/unit/test_cli_help.py runs them with ``--print-config``).
    """
    if config is not None:
        if parser.add_help:
            raise ValueError(f"{parser.prog}: create the parser with add_help=False")
        parser.add_argument(
            "-h",
            "--help",
            action=ConfigHelpAction,
            config=config,
            examples=examples,
            example=example,
            help="show this help, examples and every config key, and exit; "
            "with SECTION (e.g. phases, or a key), only that part",
        )
        parser.add_argument(
            "--help-config",
            action=ConfigHelpAction,
            config=config,
            full=False,
            help="list the config keys (or one SECTION's) with types, defaults and docs",
        )
    parser.add_argument(
        "-c",
        "--config",
        help="YAML config file, or the name of a shipped recipe (`bertpipe configs list`)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"config overrides (command line > file > defaults), e.g. {example}",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )


def add_stage_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    config: str,
    example: str,
    examples: Sequence[str],
    handler: Callable[[argparse.Namespace, list[str]], int],
    raw_description: bool = False,
) -> argparse.ArgumentParser:
    """Register the stage command ``name`` on ``sub``: a subparser with ``help`` and
    ``description`` (kept as written with ``raw_description``, else re-wrapped), the config
    arguments of :func:`add_config_arguments` for ``config`` (``"package.module:ConfigClass"``)
    with its ``example`` and ``examples``, and ``handler(args, passthrough)`` as what runs it.
    Returns the parser, for the command's own arguments."""
    extra: dict[str, Any] = {}
    if raw_description:
        extra["formatter_class"] = argparse.RawDescriptionHelpFormatter
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description, add_help=False, **extra
    )
    add_config_arguments(parser, config, example=example, examples=examples)
    parser.set_defaults(handler=handler)
    return parser


def config_from_args(cls: type[T], args: argparse.Namespace, extra: Sequence[str] = ()) -> T | None:
    """Load the stage config from ``--config`` and overrides; None after ``--print-config``."""
    cfg = load_config(cls, args.config, [*extra, *args.overrides])
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return None
    return cfg


def write_resolved_config(cfg: object, folder: str, name: str = "config.yaml") -> str:
    """Write the resolved config next to a stage's outputs; returns its URL."""
    url = fsio.join(folder, name)
    fsio.atomic_write_text(url, to_yaml(cfg))
    return url


def add_global_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--log-level`` and ``--traceback``: on the top-level parser with their defaults, on
    every subcommand (``top=False``) with ``SUPPRESS`` defaults, so they work before or after
    the command and a value given after it wins."""
    group = parser if top else parser.add_argument_group("global options (also before COMMAND)")
    group.add_argument(
        "--log-level",
        default="INFO" if top else argparse.SUPPRESS,
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)",
    )
    group.add_argument(
        "--traceback",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show the full traceback of input errors too",
    )


# --------------------------------------------------------------------------- dataclass flags


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line, where the field alone does not
    say it (see :func:`add_dataclass_arguments`)."""

    name: str | None = None
    """The flag; None: ``--`` and the field name with ``-`` for ``_``."""
    metavar: str | None = None
    choices: Sequence[str] | None = None
    negative: str | None = None
    """For a ``bool | None`` field: the flag that sets False (``--descending`` to
    ``--ascending``); default ``--no-NAME``."""
    separator: str | None = None
    """For a list field: each value given is also split at this (``--seq-len 128,512``)."""
    parse: Callable[[list[str]], Any] | None = None
    """Turns the values given (a list of strings) into the field's value; needed for a dict
    field (``parse_tags``). It raises :class:`~bertpipe.errors.BertpipeError` for bad input."""
    help: str | None = None
    """Replaces the field's docstring as the help."""
    negative_help: str | None = None


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    flags: Mapping[str, Flag] | None = None,
    *,
    fields: Sequence[str] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (or the named ``fields``) to ``parser``.

    The flag is ``--field-name`` unless ``flags`` renames it; its value goes to the field's
    name (build the instance with :func:`dataclass_from_args`). By the field's type: ``bool``
    is a switch (default False); ``bool | None`` a pair of switches that set True and False
    (default None); ``int``, ``float`` and ``str`` (or ``| None``) take one value; a list or
    ``tuple[X, ...]`` is repeatable, one value each time (or several, split at the
    :attr:`Flag.separator`); a dict needs a :attr:`Flag.parse`. The help is the field's
    docstring and its default. Any other type is a programming error (``TypeError``).
    """
    flags = flags or {}
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in _selected(cls, fields):
        spec = flags.get(f.name, Flag())
        name = _flag_name(f.name, spec)
        base, optional = _unwrap_optional(hints[f.name])
        default = _default(f)
        text = _help_text(spec.help or docs.get(f.name, ""))
        where = f"{cls.__name__}.{f.name}"
        if base is bool and optional:  # True, False or unset: two switches
            pair = parser.add_mutually_exclusive_group()
            pair.add_argument(
                name, dest=f.name, action="store_const", const=True, default=None, help=text
            )
            negative = spec.negative or "--no-" + name.removeprefix("--")
            negative_help = _help_text(spec.negative_help or f"the opposite of {name}")
            pair.add_argument(
                negative, dest=f.name, action="store_const", const=False, help=negative_help
            )
            continue
        if base is bool:
            if default is not False:
                raise TypeError(f"{where}: a switch must default to False")
            parser.add_argument(name, dest=f.name, action="store_true", help=text)
            continue
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "metavar": spec.metavar or name.lstrip("-").replace("-", "_").upper(),
        }
        item = _item_type(base)
        if item is not None or spec.parse is not None:  # repeatable
            if item is None and typing.get_origin(base) not in (dict, Mapping) and base is not dict:
                raise TypeError(f"{where}: {base} cannot be a flag")
            if spec.separator is None and item in (int, float):
                kwargs["type"] = item  # else converted after the split
            sep = {",": "comma", " ": "space"}.get(spec.separator or "", spec.separator)
            text = _note(text, f"repeatable, or {sep}-separated" if sep else "repeatable")
            parser.add_argument(name, action="append", default=[], help=text, **kwargs)
            continue
        if base not in (int, float, str):
            raise TypeError(f"{where}: {base} cannot be a flag")
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        if default is not None:
            text = _note(text, f"default {_value_text(default)}")
        parser.add_argument(name, type=base, default=default, help=text, **kwargs)


def dataclass_from_args(
    cls: type[T],
    args: argparse.Namespace,
    flags: Mapping[str, Flag] | None = None,
    *,
    fields: Sequence[str] | None = None,
) -> T:
    """The instance of ``cls`` from the flags :func:`add_dataclass_arguments` added (with the
    same ``flags``): list values split and converted, dicts parsed, tuples made tuples. A
    field without its flag in ``args`` keeps its default. Raises
    :class:`~bertpipe.errors.BertpipeError` for a value that does not convert."""
    flags = flags or {}
    hints = typing.get_type_hints(cls)
    values = vars(args)
    kwargs: dict[str, Any] = {}
    for f in _selected(cls, fields):
        if f.name not in values:
            continue
        spec = flags.get(f.name, Flag())
        value = values[f.name]
        base, _ = _unwrap_optional(hints[f.name])
        item = _item_type(base)
        if spec.parse is not None:
            value = spec.parse(list(value))
        elif item is not None:
            if spec.separator is not None:
                value = _split(value, spec.separator, item, _flag_name(f.name, spec))
            value = tuple(value) if typing.get_origin(base) is tuple else list(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _flag_name(field: str, spec: Flag) -> str:
    return spec.name or "--" + field.replace("_", "-")


def _selected(cls: type, names: Sequence[str] | None) -> list[dataclasses.Field[Any]]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if names is None:
        return list(by_name.values())
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return [by_name[n] for n in names]


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (it, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _item_type(hint: Any) -> Any:
    """The element type of ``list[X]`` or ``tuple[X, ...]``; None for other types."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is list and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _split(values: Sequence[str], separator: str, item: Any, flag: str) -> list[Any]:
    """``["128,512", "64"]`` -> ``[128, 512, 64]`` for ``item`` int; empty parts skipped."""
    out = []
    for value in values:
        for part in str(value).split(separator):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(item(part))
            except ValueError:
                noun = {int: "integers", float: "numbers"}.get(item, item.__name__)
                raise BertpipeError(f"{flag} {value!r}: expected {noun}") from None
    return out


def _help_text(doc: str) -> str:
    """A docstring as argparse help: reST roles and literals plain, ``%`` escaped."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    return text.replace("``", "`").replace("%", "%%")


def _note(text: str, note: str) -> str:
    """``"Doc."`` + note -> ``"Doc; note."``; a help without a final period gets
    ``" (note)"``."""
    text = text.rstrip()
    if text.endswith("."):
        return f"{text[:-1]}; {note}."
    return f"{text} ({note})" if text else note


def _value_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
