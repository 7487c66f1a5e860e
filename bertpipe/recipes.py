"""The recipes shipped with bertpipe (``configs/`` in the repository, ``bertpipe.configs``
once installed): listed by ``bertpipe configs list``, and resolved by name wherever a
``--config`` is read, so an installed wheel runs ``--config bert-large-lamb`` from any folder.

A ``--config`` value that names an existing file (or any URL) is that file. Otherwise it is
looked up among the shipped recipes: by file name (``pretrain-bert-large-lamb.yaml``), stem
(``pretrain-bert-large-lamb``) or stem without its stage prefix (``bert-large-lamb``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from bertpipe.config import ConfigError

# the first word of a recipe's file name is the stage that reads it
STAGES = ("pretrain", "preprocess", "tokenizer", "finetune", "sweep")


@dataclass(frozen=True)
class Recipe:
    name: str  # file stem
    stage: str
    path: Path
    summary: str  # the file's first comment line

    @property
    def short(self) -> str:
        """The name without its stage prefix (``bert-large-lamb``), or the stem itself."""
        prefix = self.stage + "-"
        return self.name[len(prefix) :] if self.name.startswith(prefix) else self.name


def _folder() -> Path:
    # the package is a plain folder in a wheel and an editable install alike (no zip imports)
    return Path(str(resources.files("bertpipe.configs")))


def shipped() -> list[Recipe]:
    """Every shipped recipe, sorted by name."""
    out = []
    for path in sorted(_folder().glob("*.yaml")):
        stage = next((s for s in STAGES if path.stem.split("-")[0] == s), "")
        summary = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                summary = line.lstrip("# ").strip()
                break
        out.append(Recipe(path.stem, stage, path, summary))
    return out


def resolve(value: str) -> str:
    """The file a ``--config`` value means: an existing file or URL as given, else the
    shipped recipe of that name. Raises a one-line error naming the shipped ones."""
    if "://" in value or Path(value).expanduser().exists():
        return value
    looks_like_path = "/" in value  # a missing file, not a recipe name
    recipes = shipped()
    matches = [r for r in recipes if value in (r.path.name, r.name, r.short)]
    if len(matches) == 1 and not looks_like_path:
        return str(matches[0].path)
    names = ", ".join(r.short for r in recipes)
    if looks_like_path:
        raise ConfigError("", f"config file {value} does not exist")
    raise ConfigError(
        "",
        f"config file {value} does not exist, and no shipped recipe has that name "
        f"(shipped: {names}; see `bertpipe configs list`)",
    )


def add_configs_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "configs",
        help="list or print the shipped recipes (usable as --config NAME)",
        description=(
            "The recipes shipped with bertpipe. Any stage's --config takes a recipe's name "
            "(e.g. --config bert-large-lamb) as well as a file; `configs show NAME > my.yaml` "
            "gives a copy to edit."
        ),
    )
    actions = parser.add_subparsers(dest="configs_action", metavar="ACTION", required=True)
    actions.add_parser("list", help="name, stage and summary of each recipe").set_defaults(
        handler=_list
    )
    show = actions.add_parser("show", help="print one recipe's YAML")
    show.add_argument("name", help="recipe name, as `configs list` prints it")
    show.set_defaults(handler=_show)


def _list(args: argparse.Namespace, passthrough: list[str]) -> int:
    recipes = shipped()
    width = max(len(r.short) for r in recipes)
    for r in recipes:
        print(f"{r.short:<{width}}  {r.stage or '-':<10}  {r.summary}")
    print(f"\n({len(recipes)} recipes in {_folder()}; use as --config NAME)")
    return 0


def _show(args: argparse.Namespace, passthrough: list[str]) -> int:
    sys.stdout.write(Path(resolve(args.name)).read_text(encoding="utf-8"))
    return 0
