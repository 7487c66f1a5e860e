"""The import graph, built from the source (AST, imports inside functions included).

* The core (``bertpipe/`` outside ``bertpipe/app/``) imports no stage (``bertpipe.preprocessing``,
  ``bertpipe.training``, ``bertpipe.finetuning``) and not the application layer, not even lazily
  inside a function or by ``importlib.import_module("...")``; nor does it hold their module
  names as strings to import later (a table of commands such as
  ``"bertpipe.training.cli:add_pretrain_command"``).
* Nothing outside the application layer imports it.
* Stages import forwards only (docs: DESIGN "Imports follow the same direction"): preprocessing
  imports no other stage, training does not import finetuning.
* Inside training, the components' rules: the shared core (``training.core``) imports no
  pre-training module (``training.pretrain``) nor the planner; the models
  (``training.models``) import no DeepSpeed and no other training component (they are plain
  torch, usable without a process group).
* No module imports another component's private name (``from bertpipe.training.pretrain.trainer
  import _Faults`` in finetuning), nor reads one off an imported module (``trainer._Faults``).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name -> folder, as pyproject.toml installs them
ROOTS = {
    "bertpipe": ROOT / "bertpipe",
    "bertpipe.preprocessing": ROOT / "preprocessing",
    "bertpipe.training": ROOT / "training",
    "bertpipe.finetuning": ROOT / "finetuning",
}
STAGES = ("bertpipe.preprocessing", "bertpipe.training", "bertpipe.finetuning")
MODULE_PATH = re.compile(r"bertpipe(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")
APP = "bertpipe.app"
# stage -> the stages it must not import (data and imports move forward only)
BACKWARDS = {
    "bertpipe.preprocessing": ("bertpipe.training", "bertpipe.finetuning"),
    "bertpipe.training": ("bertpipe.finetuning",),
}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package relative imports in this module start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    """One import in a module: the module imported and, for ``from M import x``, ``x``."""

    line: int
    module: str
    name: str | None = None

    def targets(self) -> list[str]:
        """What the import may load: ``M``, and ``M.x`` when ``x`` may be a submodule."""
        return [self.module] + ([f"{self.module}.{self.name}"] if self.name else [])


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def component(name: str) -> str:
    """The unit that keeps its private names to itself: a stage, the app, or the core."""
    for unit in (*STAGES, APP):
        if is_under(name, unit):
            return unit
    return "bertpipe"


def discover() -> dict[str, Module]:
    modules = {}
    for prefix, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            is_package = parts[-1] == "__init__"
            dotted = ".".join((prefix, *(parts[:-1] if is_package else parts)))
            modules[dotted] = Module(dotted, path, is_package)
    return modules


def imports_of(source: str, package: str) -> Iterator[Import]:
    """Every import in ``source``, at any depth (functions, classes, ``if TYPE_CHECKING``),
    relative ones resolved against ``package``, plus ``importlib.import_module("x")`` and
    ``__import__("x")`` calls with a literal name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                yield Import(node.lineno, base, alias.name)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield Import(node.lineno, first.value)


def module_strings(source: str) -> Iterator[tuple[int, str]]:
    """String constants that are a dotted ``bertpipe.*`` module path, optionally with
    ``:attribute`` (what ``importlib`` or a command table would load)."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_PATH.fullmatch(node.value)
        ):
            yield node.lineno, node.value.partition(":")[0]


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def private_uses(source: str, module: Module, modules: dict[str, Module]) -> Iterator[str]:
    """``from M import _x`` and ``alias._x`` (``alias`` bound to module M) where M belongs to
    another component than ``module``."""
    own = component(module.name)
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> bertpipe module it is bound to
    for imp_node in ast.walk(tree):
        if isinstance(imp_node, ast.Import):
            for alias in imp_node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for imp in imports_of(source, module.package):
        if not is_under(imp.module, "bertpipe") or imp.name is None:
            continue
        submodule = f"{imp.module}.{imp.name}"
        if submodule in modules:
            aliases[imp.name] = submodule
        if component(imp.module) == own or not _private(imp.name):
            continue
        yield f"{module.path.relative_to(ROOT)}:{imp.line} imports {imp.name} from {imp.module}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and component(aliases[node.value.id]) != own
        ):
            where = f"{module.path.relative_to(ROOT)}:{node.lineno}"
            yield f"{where} reads {node.attr} of {aliases[node.value.id]}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


MODULES = discover()


def _violations(check: str) -> list[str]:
    found = []
    for module in MODULES.values():
        source = module.path.read_text(encoding="utf-8")
        where = module.path.relative_to(ROOT)
        if check == "private":
            found += list(private_uses(source, module, MODULES))
            continue
        forbidden = _forbidden(module.name, check)
        for imp in imports_of(source, module.package):
            for target in imp.targets():
                if any(is_under(target, f) for f in forbidden):
                    found.append(f"{where}:{imp.line} imports {target}")
                    break
        if check == "core":
            for line, name in module_strings(source):
                if any(is_under(name, f) for f in forbidden):
                    found.append(f"{where}:{line} names {name} (to import it)")
    return found


# training's packages -> what they must not import (any depth, lazily included)
TRAINING_RULES = {
    "bertpipe.training.core": ("bertpipe.training.pretrain", "bertpipe.training.plan"),
    "bertpipe.training.models": (
        "deepspeed",
        "bertpipe.training.core",
        "bertpipe.training.pretrain",
        "bertpipe.training.checkpoint",
        "bertpipe.training.plan",
    ),
}


def _forbidden(name: str, check: str) -> tuple[str, ...]:
    if check == "training":
        return next((rule for pkg, rule in TRAINING_RULES.items() if is_under(name, pkg)), ())
    if check == "core":
        is_core = component(name) == "bertpipe"
        return (*STAGES, APP) if is_core else ()
    if check == "app":
        return () if is_under(name, APP) else (APP,)
    for stage, later in BACKWARDS.items():
        if is_under(name, stage):
            return later
    return ()


# --------------------------------------------------------------------------- the checker


def test_the_checker_sees_nested_relative_and_dynamic_imports() -> None:
    source = textwrap.dedent(
        """
        import os
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from bertpipe.training.pretrain.config import PretrainConfig
        def f():
            from bertpipe.preprocessing import shard_format
            import importlib
            importlib.import_module("bertpipe.finetuning.loop")
        class C:
            def g(self):
                from ..app import cli
                from . import formatting
        """
    )
    found = {(i.module, i.name) for i in imports_of(source, "bertpipe.tracking")}
    assert ("bertpipe.training.pretrain.config", "PretrainConfig") in found
    assert ("bertpipe.preprocessing", "shard_format") in found
    assert ("bertpipe.finetuning.loop", None) in found
    assert ("bertpipe.app", "cli") in found
    assert ("bertpipe.tracking", "formatting") in found
    table = 'COMMANDS = {"pretrain": "bertpipe.training.cli:add_pretrain_command"}'
    assert list(module_strings(table)) == [(1, "bertpipe.training.cli")]
    assert not list(module_strings('"""Uses bertpipe.training.cli to run."""'))


def test_the_graph_covers_core_stages_and_app() -> None:
    names = set(MODULES)
    for expected in (
        "bertpipe.config",
        "bertpipe.tracking.lifecycle",
        "bertpipe.app.cli",
        "bertpipe.app.compare.query",
        "bertpipe.training.pretrain.trainer",
        "bertpipe.finetuning.run",
        "bertpipe.preprocessing.pipeline",
    ):
        assert expected in names


def test_private_check_sees_cross_component_private_imports() -> None:
    source = textwrap.dedent(
        """
        from bertpipe.training.pretrain.trainer import _Faults, run_pretraining
        from bertpipe.training.pretrain import trainer
        from bertpipe.finetuning.tasks.base import _own_helper
        def f():
            return trainer._poisoned
        """
    )
    run = MODULES["bertpipe.finetuning.run"]
    found = list(private_uses(source, run, MODULES))
    assert len(found) == 2, found
    assert "imports _Faults from bertpipe.training.pretrain.trainer" in found[0]
    assert "reads _poisoned of bertpipe.training.pretrain.trainer" in found[1]


# --------------------------------------------------------------------------- the rules


def test_core_imports_no_stage_and_not_the_app() -> None:
    found = _violations("core")
    assert not found, "the core (bertpipe/ outside bertpipe/app/) must not import:\n" + "\n".join(
        found
    )


def test_only_the_app_imports_the_app() -> None:
    found = _violations("app")
    assert not found, "only bertpipe/app/ may import bertpipe.app:\n" + "\n".join(found)


def test_stages_import_forwards_only() -> None:
    found = _violations("stages")
    assert not found, "a stage imports a later stage:\n" + "\n".join(found)


def test_no_private_names_across_components() -> None:
    found = _violations("private")
    assert not found, "private names used across components:\n" + "\n".join(found)


def test_training_core_imports_no_stage_and_models_no_deepspeed() -> None:
    found = _violations("training")
    assert not found, "training's components import what their rules forbid:\n" + "\n".join(found)


def test_the_training_rules_see_what_they_forbid() -> None:
    """The rules catch the imports they exist for (tried by hand as well: an import of the
    trainer added to core/engine.py, of deepspeed to models/bert/model.py; both failed)."""
    engine = MODULES["bertpipe.training.core.engine"]
    model = MODULES["bertpipe.training.models.bert.model"]
    assert _forbidden(engine.name, "training") and _forbidden(model.name, "training")
    bad_core = "def f():\n    from bertpipe.training.pretrain.trainer import run_pretraining\n"
    bad_model = "import deepspeed\n"
    for module, source in ((engine, bad_core), (model, bad_model)):
        forbidden = _forbidden(module.name, "training")
        hits = [
            target
            for imp in imports_of(source, module.package)
            for target in imp.targets()
            if any(is_under(target, f) for f in forbidden)
        ]
        assert hits, (module.name, source)
