"""Typed configs: one dataclass per section, loaded from YAML with dotted overrides.

Precedence is command line > file > dataclass defaults. Every value is checked against the
field's type hint while it is read, and each dataclass may check relations between its
fields in ``__post_init__``; either way a bad value raises :class:`ConfigError`, whose
message names the full dotted key (``model.hidden_size``) and what to do about it.

Supported field types: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]`` and nested dataclasses.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from bertpipe.errors import BertpipeError

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "apply_overrides",
    "field_docs",
    "from_dict",
    "load_config",
    "to_dict",
    "to_yaml",
]


class ConfigError(BertpipeError, ValueError):
    """A config value is missing, unknown or wrong.

    ``key`` is the dotted path of the offending entry; the message says what to do.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"config key '{key}': {message}" if key else message)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of its key (for nested sections)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(key, self.message)


def load_config(
    cls: type[T],
    path: str | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from optional ``defaults``, then a YAML file, then ``key.sub=value`` overrides.

    Override values are parsed as YAML scalars or flow collections (``a=3``, ``b=[1,2]``,
    ``c=null``), so they get the same types as the file would give them. An item of a list
    section is addressed by its index: ``phases[1].max_steps=500`` (a list the file does not
    set is taken from the dataclass defaults first).
    """
    data: dict[str, Any] = _deep_copy(dict(defaults or {}))
    if path is not None:
        from bertpipe.recipes import resolve

        data = _merge(data, _read_yaml(resolve(path)))
    data = apply_overrides(data, overrides, lambda: _defaults_of(cls))
    return from_dict(cls, data)


_INDEXED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


def apply_overrides(
    data: dict[str, Any],
    overrides: Sequence[str],
    defaults: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` (or ``list[i].key=value``)
    override applied. ``defaults`` supplies lists the data does not hold yet."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(item, "an override must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"cannot parse value {raw!r}: {exc}") from None
        _set_path(out, key, value, defaults)
    return out


def _set_path(
    out: dict[str, Any], key: str, value: Any, defaults: Callable[[], dict[str, Any]] | None
) -> None:
    steps: list[str | int] = []
    for part in key.split("."):
        match = _INDEXED.match(part)
        if match is None:
            raise ConfigError(key, "an override key looks like a.b.c or a[0].b")
        steps.append(match.group(1))
        steps.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    node: Any = out
    default_node: Any = None
    for i, step in enumerate(steps[:-1]):
        where = _path_text(steps[: i + 1])
        nxt = steps[i + 1]
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise ConfigError(where, f"has no item {step} (the list has {size})")
            node = node[step]
            continue
        if not isinstance(node, dict):
            raise ConfigError(where, "is a value, not a section")
        if step not in node:
            if isinstance(nxt, int):
                if default_node is None and defaults is not None and node is out:
                    default_node = defaults()
                inherited = (default_node or {}).get(step) if node is out else None
                if not isinstance(inherited, list):
                    raise ConfigError(where, "is not a list set in the config file")
                node[step] = _deep_copy(inherited)
            else:
                node[step] = {}
        node = node[step]
        if isinstance(nxt, str) and not isinstance(node, dict):
            raise ConfigError(where, "is a value, not a section")
    last = steps[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(_path_text(steps), "names no list item")
        node[last] = value
    else:
        node[last] = value


def _path_text(steps: Sequence[str | int]) -> str:
    text = ""
    for step in steps:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


def _defaults_of(cls: type) -> dict[str, Any]:
    try:
        return dict(to_dict(cls()))
    except (TypeError, ConfigError):  # a class with required fields has no defaults to offer
        return {}


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking every key and value."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a section (mapping), got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(_join(prefix, str(key)), f"unknown key; known keys here: {known}")
    kwargs = {
        name: _coerce(hints[name], value, _join(prefix, name)) for name, value in data.items()
    }
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(
                _join(prefix, name), "is required; set it in the file or as an override"
            )
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise (exc.with_prefix(prefix) if prefix else exc) from None


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-safe copy of a config (tuples become lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, keys in declaration order, passwords in URLs redacted
    (it is written next to outputs and logged to MLflow)."""
    return yaml.safe_dump(redacted(to_dict(cfg)), sort_keys=False, default_flow_style=False)


def redacted(data: Any) -> Any:
    """``data`` (dicts, lists, scalars) with the password of every URL in its strings
    replaced by ``***`` (:func:`bertpipe.fsio.redact`)."""
    from bertpipe.fsio import redact

    if isinstance(data, str):
        return redact(data)
    if isinstance(data, Mapping):
        return {key: redacted(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(redacted(value) for value in data)
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        full = _join(prefix, str(key))
        if isinstance(value, Mapping):
            out.update(flatten(value, full))
        else:
            out[full] = value
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    if not isinstance(body, ast.ClassDef):
        return docs
    stmts = body.body
    for stmt, nxt in itertools.pairwise(stmts):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


# --------------------------------------------------------------------------- internals


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(exc.message)
        raise ConfigError(key, "; ".join(errors))
    if value is None:
        raise ConfigError(key, f"must not be null (expected {_type_name(hint)})")
    if origin is typing.Literal:
        if value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(key, f"must be one of {choices}, got {_show(value)}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(key, f"expected a list, got {_show(value)}")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {_show(value)}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(vt, v, f"{key}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {_show(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value.replace("_", ""))
            except ValueError:
                pass
            else:
                if as_float.is_integer():
                    return int(as_float)
        raise ConfigError(key, f"expected an integer, got {_show(value)}")
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected a number, got {_show(value)}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {_show(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {_show(value)}")
    raise ConfigError(key, f"unsupported config type {hint!r}")  # a bug in a config class


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line: ``line 3, column 7: expected ',' ...``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "") + "; fix the file"


def _read_yaml(path: str) -> dict[str, Any]:
    from bertpipe import fsio

    try:
        with fsio.open_url(path, "rt") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            "", f"config file {path} is not valid YAML: {_yaml_problem(exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {path} must hold a mapping at the top level")
    return data


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = _deep_copy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = _deep_copy(value)
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))
