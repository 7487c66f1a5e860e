"""Config-key listings for ``bertpipe <stage> --help``, generated from the config dataclasses.

Every key of a stage's config is listed with its type, default and attribute docstring (the
string literal under each field), grouped by section: top-level keys first, then one group
per nested section (``model.*``, ``zero.*``) or list of sections (``phases[i].*``). The
listing is read from the classes themselves, so it cannot drift from what the config loader
accepts. Docstrings come from the source (``.py`` files ship in the wheel); without source the
listing still has every key, type and default.

``bertpipe pretrain --help`` prints the usual help, the stage's examples and every key;
``--help optimizer`` (or ``--help-config optimizer``) one section, ``--help zero.stage`` one key.
The parser side is :class:`bertpipe.cli_args.ConfigHelpAction`; this module and the config
modules are imported only when such a help is printed, so ``bertpipe --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "KeyHelp",
    "SectionHelp",
    "UnknownSectionError",
    "config_sections",
    "print_config_help",
    "render_config_help",
]

TOP = "top"  # the name that selects the top-level keys


@dataclasses.dataclass(frozen=True)
class KeyHelp:
    """One config key: full dotted name (``phases[i].max_steps``), type, default, docstring."""

    key: str
    type: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class SectionHelp:
    """The keys of one section: ``name`` is ``top``, ``model``, ``phases``..."""

    name: str
    title: str  # "top-level keys", "model.*", "phases[i].*"
    doc: str
    keys: list[KeyHelp]


class UnknownSectionError(ValueError):
    """``--help X`` names no section or key; the message lists the known sections."""


# --------------------------------------------------------------------------- collecting


def config_sections(cls: type) -> list[SectionHelp]:
    """Every key of dataclass ``cls``, grouped: top-level keys first, then each section."""
    instance = _default_instance(cls)
    top: list[KeyHelp] = []
    sections: list[SectionHelp] = []
    docs = _docs(cls)
    for f, hint in _fields(cls):
        value = _default_value(f, instance)
        doc = docs.get(f.name, "")
        item = _list_item_class(hint)
        if _is_dataclass_type(hint):
            title = f"{f.name}.*"
            keys = _keys(hint, f.name, value)
            sections.append(SectionHelp(f.name, title, _join_docs(_class_doc(hint), doc), keys))
        elif item is not None:
            title = f"{f.name}[i].*"
            extra = _list_default_text(value)
            sections.append(
                SectionHelp(
                    f.name,
                    title,
                    _join_docs(_class_doc(item), doc, extra),
                    _keys(item, f"{f.name}[i]", None),
                )
            )
        else:
            top.append(KeyHelp(f.name, type_text(hint), value_text(value), doc))
    if top:
        sections.insert(0, SectionHelp(TOP, "top-level keys", _class_doc(cls), top))
    return sections


def _keys(cls: type, prefix: str, instance: Any) -> list[KeyHelp]:
    """The keys of a nested section (recursing into deeper sections)."""
    if instance is None:
        instance = _default_instance(cls)
    docs = _docs(cls)
    out: list[KeyHelp] = []
    for f, hint in _fields(cls):
        key = f"{prefix}.{f.name}"
        value = _default_value(f, instance)
        item = _list_item_class(hint)
        if _is_dataclass_type(hint):
            out.extend(_keys(hint, key, value))
        elif item is not None:
            out.append(KeyHelp(key, "list of sections", value_text(value), docs.get(f.name, "")))
            out.extend(_keys(item, f"{key}[i]", None))
        else:
            out.append(KeyHelp(key, type_text(hint), value_text(value), docs.get(f.name, "")))
    return out


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: show it as written
        hints = {}
    return [
        (f, hints.get(f.name, f.type))
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init
    ]


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except Exception:  # required fields, or defaults that do not validate on their own
        return None


def _default_value(f: dataclasses.Field[Any], instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        try:
            return f.default_factory()
        except Exception:
            return _REQUIRED
    return _REQUIRED


class _Required:
    def __repr__(self) -> str:
        return "required"


_REQUIRED = _Required()


def _docs(cls: type) -> dict[str, str]:
    from bertpipe.config import field_docs

    try:
        return field_docs(cls)
    except Exception:  # source that does not parse (or is not ours): no docstrings
        return {}


def _class_doc(cls: type) -> str:
    """The first paragraph of a dataclass's own docstring (not the generated signature)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    first = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(first.split())


def _join_docs(*parts: str) -> str:
    return " ".join(p.strip() for p in parts if p and p.strip())


def _list_default_text(value: Any) -> str:
    if not isinstance(value, list | tuple):
        return ""
    if not value:
        return "Default: no items."
    names = [getattr(v, "name", None) for v in value]
    if all(isinstance(n, str) for n in names):
        listed = ", ".join(typing.cast(list[str], names))
        return f"Default: {len(value)} item{'s' if len(value) > 1 else ''} ({listed})."
    return f"Default: {len(value)} item{'s' if len(value) > 1 else ''}."


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _list_item_class(hint: Any) -> type | None:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (list, tuple, Sequence) and args and _is_dataclass_type(args[0]):
        return typing.cast(type, args[0])
    return None


# --------------------------------------------------------------------------- text


def type_text(hint: Any) -> str:
    """``int``, ``{adamw,lamb}``, ``int | null``, ``list[str]``, ``[float, float]``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return "any"
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " | ".join(parts)
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{type_text(args[0])}]"
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin in (list, Sequence):
        return f"list[{type_text(args[0])}]" if args else "list"
    if origin in (dict, Mapping):
        return f"dict[{', '.join(type_text(a) for a in args)}]" if args else "dict"
    if _is_dataclass_type(hint):
        return "section"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


def value_text(value: Any, nested: bool = False) -> str:
    """A default as it would be written in YAML: ``null``, ``true``, ``[0.9, 0.999]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _str_text(value, nested)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k}: {value_text(v, True)}" for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(v, True) for v in value) + "]"
    return str(value)


def _str_text(value: str, nested: bool) -> str:
    import yaml

    special = nested and any(c in value for c in "[]{},:#")
    try:
        same = yaml.safe_load(value) == value
    except yaml.YAMLError:
        same = False
    if value and same and not special and value.strip() == value:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _plain(doc: str) -> str:
    """Docstring markup for a terminal: ``x`` -> `x`."""
    return doc.replace("``", "`")


def render_sections(sections: Sequence[SectionHelp], width: int | None = None) -> str:
    """The listing: a header line per section, then one entry per key."""
    width = width or help_width()
    out: list[str] = []
    for i, section in enumerate(sections):
        if i:
            out.append("")
        header = section.title + (f"  {_plain(section.doc)}" if section.doc else "")
        out.extend(
            textwrap.wrap(header, width, subsequent_indent="    ", break_on_hyphens=False)
            or [section.title]
        )
        out.extend(_render_keys(section.keys, width))
    return "\n".join(out) + "\n"


def _render_keys(keys: Sequence[KeyHelp], width: int) -> list[str]:
    """``  key  type = default  doc`` on one line where it fits, else the doc wrapped below."""
    column = min(max((len(k.key) for k in keys), default=0), 30)
    out: list[str] = []
    for k in keys:
        head = f"  {k.key:<{column}}  {k.type} = {k.default}"
        doc = _plain(k.doc)
        one_line = f"{head}  {doc}" if doc else head
        if len(one_line) <= width:
            out.append(one_line)
            continue
        out.extend(textwrap.wrap(head, width, subsequent_indent=" " * 8, break_on_hyphens=False))
        if doc:
            out.extend(
                textwrap.wrap(
                    doc,
                    width,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 6,
                    break_on_hyphens=False,
                )
            )
    return out


def help_width() -> int:
    """argparse's width: the terminal's (or $COLUMNS) less 2, here kept within 60..100."""
    import shutil

    return max(60, min(100, shutil.get_terminal_size().columns - 2))


# --------------------------------------------------------------------------- selecting


def select(sections: Sequence[SectionHelp], query: str) -> list[SectionHelp]:
    """The part of the listing ``query`` names: a section (``optimizer``, ``phases``,
    ``phases[0]``, ``top``), a key (``zero.stage``, ``phases[1].max_steps``, ``seed``), a
    deeper prefix, or a bare field name (``learning_rate``: every key that ends so)."""
    q = re.sub(r"\[(\d+|i|\*)?\]", "[i]", query.strip())
    q = q.removesuffix(".*").rstrip(".")
    by_name = {s.name: s for s in sections}
    name = q.removesuffix("[i]")
    if name in by_name and (q == name or by_name[name].title.startswith(q + ".")):
        return [by_name[name]]
    found: list[SectionHelp] = []
    for rule in (
        lambda k: k.key == q or k.key.startswith((q + ".", q + "[i].")),
        lambda k: re.split(r"[.\]]", k.key)[-1] == q,
    ):
        found = [
            dataclasses.replace(s, keys=[k for k in s.keys if rule(k)])
            for s in sections
            if any(rule(k) for k in s.keys)
        ]
        if found:
            return found
    names = ", ".join(s.name for s in sections)
    raise UnknownSectionError(
        f"no config section or key {query!r}; sections: {names} "
        "(or a key such as "
        f"{_example_key(sections)})"
    )


def _example_key(sections: Sequence[SectionHelp]) -> str:
    for s in sections:
        if s.name != TOP and s.keys:
            return s.keys[0].key
    return sections[0].keys[0].key if sections and sections[0].keys else "KEY"


def render_config_help(
    cls: type, query: str | None = None, *, prog: str = "", width: int | None = None
) -> str:
    """The whole listing of ``cls`` (``query`` None), or the part ``query`` names."""
    sections = config_sections(cls)
    if query is None:
        names = ", ".join(s.name for s in sections)
        lists = [s.name for s in sections if s.title.endswith("[i].*")]
        item = f" (an item of a list: {lists[0]}[0].key=VALUE)" if lists else ""
        intro = (
            "config keys: write them in the --config file (YAML sections) or as KEY=VALUE "
            f"after the command{item}. "
            f"`{prog or 'bertpipe STAGE'} --help SECTION` shows one section: {names}."
        )
        lead = "\n".join(textwrap.wrap(intro, width or help_width()))
        return f"{lead}\n\n{render_sections(sections, width)}"
    return render_sections(select(sections, query), width)


# --------------------------------------------------------------------------- argparse


def wrap_command(line: str, width: int, indent: str = "") -> list[str]:
    """A shell command over several lines (`` \\`` continuations) where it is too long;
    words are split at spaces, so a quoted word must not hold one."""
    command, hash_, comment = line.partition("  #")
    words = command.split()
    out: list[str] = []
    current = indent
    for word in words:
        if current.strip() and len(current) + 1 + len(word) + 2 > width:
            out.append(current + " \\")
            current = indent + "    " + word
        else:
            current = current + (" " if current.strip() else "") + word
    out.append(current + (f"  #{comment}" if hash_ else ""))
    return out


def load_class(target: str) -> type:
    """``"package.module:ClassName"`` -> the class (imported only now)."""
    module, _, name = target.partition(":")
    return typing.cast(type, getattr(importlib.import_module(module), name))


def print_config_help(
    parser: argparse.ArgumentParser,
    config: str,
    query: str | None,
    *,
    full: bool = True,
    examples: Sequence[str] = (),
) -> None:
    """What ``-h/--help [SECTION]`` and ``--help-config [SECTION]`` of a stage print; exits.

    Without ``query``, ``full`` prints argparse's help, the stage's ``examples`` and every
    config key of ``config`` (``"module:Class"``); else the keys alone. With ``query``, only
    that section or key; an unknown one is a one-line error (exit 2).
    """
    width = help_width()
    try:
        listing = render_config_help(load_class(config), query, prog=parser.prog, width=width)
    except UnknownSectionError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    parts = []
    if query is None and full:
        parts.append(parser.format_help() + "\n")
        if examples:
            lines = [w for e in examples for w in wrap_command(e, width, "  ")]
            parts.append("examples:\n" + "\n".join(lines) + "\n\n")
    parts.append(listing)
    sys.stdout.write("".join(parts))
    parser.exit()
