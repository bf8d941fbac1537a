"""The YAML recipe (version 1): which checkpoint supplies each row.

    version: 1
    base: run/checkpoint-600          # every row not listed, plus all non-layer state
    output: run/checkpoint-600-tailored
    world_size: 4                     # optional: reshard for 4 data-parallel ranks
    layers:
      embed_tokens: run/checkpoint-500
      layers.1: run/checkpoint-500

Relative paths resolve against the recipe file's folder. Loading checks the file's
own shape (keys, types) and reports problems as `file:line:col: ...`; whether rows
and checkpoints exist is checked against the checkpoints when a plan is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tailor_tui.checkpoints.side_files import read_small
from tailor_tui.errors import OutputError, RecipeError, UsageError
from tailor_tui.units import WHOLE_NUMBER, clipped, whole_number

# A recipe names one line per row: bounded before PyYAML composes it (a node costs it about
# 500 bytes and 30 µs): its bytes by the side files' bound (1 MiB, `$TAILOR_TUI_MAX_SIDE_FILE`),
# its YAML nodes (two per row) and nesting counted by libyaml's parser first
MAX_NODES = 1 << 15
MAX_DEPTH = 8
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

VERSION = 1
KEYS = ("version", "base", "output", "world_size", "layers")


# Written at the top of every new recipe tailor-tui saves. Saving over a recipe keeps what a person
# wrote in it (`recipe_text`); one tailor-tui wrote and nobody changed is written anew.
HEADER = ("# tailor-tui recipe: compose it with `tailor-tui --apply THIS_FILE`.\n"
          "# Saved by tailor-tui; saving it again keeps your comments, key order and blank lines.\n")
# The headers earlier releases wrote: a recipe under one, unchanged since, is still tailor-tui's own
OLD_HEADERS = ("# tailor-tui recipe: compose it with `tailor-tui --apply THIS_FILE`.\n"
               "# Saved by tailor-tui; comments are not kept when it saves this file again.\n",)


@dataclass
class Recipe:
    base: Path
    output: Path | None = None
    layers: dict[str, Path] = field(default_factory=dict)  # row name as written -> checkpoint
    world_size: int | None = None  # the output's data-parallel world size; None: the base's
    source_file: Path | None = None
    # Where each key / row was written, for error messages: key -> "file:line:col".
    where: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # The format it was read from when not tailor-tui's ("LLMTailor": planning.mergekit); ctrl+s never
    # saves over such a file
    converted_from: str | None = field(default=None, compare=False)

    def location(self, key: str) -> str:
        return self.where.get(key) or str(self.source_file or "recipe")

    def to_yaml(self, relative_to: Path | None = None) -> str:
        """The recipe as YAML, paths relative to `relative_to` (the file's folder) when given."""

        def show(p: Path) -> str:
            if relative_to is None:
                return str(p)
            return os.path.relpath(Path(p).absolute(), Path(relative_to).absolute())

        doc: dict = {"version": VERSION, "base": show(self.base)}
        if self.output is not None:
            doc["output"] = show(self.output)
        if self.world_size is not None:
            doc["world_size"] = self.world_size
        doc["layers"] = {row: show(p) for row, p in self.layers.items()}
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)

    def fresh_text(self, folder: Path) -> str:
        """The recipe as tailor-tui writes a new one: HEADER, then its keys, paths relative to `folder`."""
        return HEADER + self.to_yaml(relative_to=folder)

    def as_saved(self, text: str, folder: Path) -> bool:
        """Whether `text` (this recipe's file, in `folder`) is it exactly as tailor-tui writes it, under
        this release's header or an earlier one's."""
        body = self.to_yaml(relative_to=folder)
        return any(text == header + body for header in (HEADER, *OLD_HEADERS))



def _at(source: str, node: yaml.Node) -> str:
    mark = node.start_mark
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _scalar_path(node: yaml.Node, source: str, what: str, folder: Path) -> Path:
    if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:str" or not node.value:
        raise RecipeError(f"{_at(source, node)}: {what} must be a checkpoint folder path")
    p = Path(os.path.expanduser(node.value))
    return p if p.is_absolute() else _within(folder / p)


INT = "tag:yaml.org,2002:int"


def recipe_int(node: yaml.Node, source: str, must: str, least: int = 0) -> int:
    """The one reading of a whole number in a recipe (`world_size`, an LLMTailor `layer_range`): a
    YAML integer (`4`, `!!int "4"`) spelt as `units.whole_number` reads one, at least `least`; else
    RecipeError `FILE:LINE:COL: {must}, not 'VALUE'` (a long value cut), saying how to write one
    where the YAML is an integer tailor-tui does not read (`²`, `0x10`, 5,000 digits)."""
    text = node.value if isinstance(node, yaml.ScalarNode) else None
    value = whole_number(text) if text is not None and node.tag == INT else None
    if value is not None and value >= least:
        return value
    said = "?" if text is None else clipped(text)
    how = f" (a recipe's whole numbers are {WHOLE_NUMBER})" if value is None and node.tag == INT else ""
    raise RecipeError(f"{_at(source, node)}: {must}, not '{said}'{how}")


def _within(path: Path) -> Path:
    """`path` with `..` and symlinks above its last name resolved (as the file system does, not
    by text), relative to the working folder when it lies under it: messages say `demo-run/x`,
    not `recipes/../demo-run/x`. The last name is kept as written, so an output (or source)
    that is itself a symbolic link is still seen as one."""
    full = path.resolve() if path.name in ("", ".", "..") else path.parent.resolve() / path.name
    try:
        return full.relative_to(Path.cwd())
    except (ValueError, OSError):
        return full


def check_size(text: str, source: str) -> None:
    """Refuse text of more YAML nodes, or nested deeper, than a recipe has, before it is composed
    (malformed YAML is left to the composer, which says where)."""
    nodes = depth = 0
    try:
        for event in yaml.parse(text, Loader=_PARSER):
            nodes += isinstance(event, yaml.NodeEvent)
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if nodes > MAX_NODES or depth > MAX_DEPTH:
                raise RecipeError(f"{source}: not a recipe: more than {MAX_NODES:,} YAML values, or nested more than "
                                  f"{MAX_DEPTH} deep (a recipe maps rows to checkpoints, one line each)")
    except yaml.YAMLError:
        pass


def parse_recipe(text: str, source: str = "recipe", folder: Path = Path(".")) -> Recipe:
    """Parse recipe text; relative paths resolve against `folder`."""
    check_size(text, source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise RecipeError(f"{at}: malformed YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: malformed YAML: {exc}") from None
    except RecursionError:
        raise RecipeError(f"{source}: not a recipe: nested more than {MAX_DEPTH} deep") from None
    if root is None:
        raise RecipeError(f"{source}: the recipe is empty; it needs at least `version: 1` and `base:`")
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{_at(source, root)}: a recipe is a mapping with keys {', '.join(KEYS)}")

    nodes: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key, value in root.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        if name not in KEYS:
            raise RecipeError(
                f"{_at(source, key)}: unknown key '{name}'; a recipe has only {', '.join(KEYS)}"
            )
        if name in nodes:
            raise RecipeError(f"{_at(source, key)}: key '{name}' is given twice")
        nodes[name] = (key, value)

    if "version" not in nodes:
        raise RecipeError(f"{source}: missing `version: {VERSION}`")
    version = nodes["version"][1]
    if not (isinstance(version, yaml.ScalarNode) and version.value == str(VERSION)):
        raise RecipeError(
            f"{_at(source, version)}: unsupported recipe version '{getattr(version, 'value', '?')}'; "
            f"this tailor-tui reads version {VERSION}"
        )
    if "base" not in nodes:
        raise RecipeError(f"{source}: missing `base:` (the checkpoint that supplies every other row)")

    where = {key: _at(source, k) for key, (k, _) in nodes.items()}
    base = _scalar_path(nodes["base"][1], source, "`base`", folder)
    output = None
    if "output" in nodes:
        output = _scalar_path(nodes["output"][1], source, "`output`", folder)

    world_size = None
    if "world_size" in nodes:
        world_size = recipe_int(nodes["world_size"][1], source, "`world_size` must be a whole number of at least 1 "
                                "(the data-parallel ranks to reshard for)", least=1)

    layers: dict[str, Path] = {}
    if "layers" in nodes:
        lnode = nodes["layers"][1]
        is_null = isinstance(lnode, yaml.ScalarNode) and lnode.tag == "tag:yaml.org,2002:null"
        if not is_null:
            if not isinstance(lnode, yaml.MappingNode):
                raise RecipeError(
                    f"{_at(source, lnode)}: `layers` maps row names to checkpoint folders"
                )
            for key, value in lnode.value:
                if not isinstance(key, yaml.ScalarNode) or not key.value:
                    raise RecipeError(f"{_at(source, key)}: a row name must be plain text")
                row = key.value
                if row in layers:
                    raise RecipeError(f"{_at(source, key)}: row '{row}' is given twice")
                layers[row] = _scalar_path(value, source, f"the source of row '{row}'", folder)
                where[f"row:{row}"] = _at(source, key)
    return Recipe(base=base, output=output, layers=layers, world_size=world_size, where=where)


def as_tailor_wrote_it(path: Path) -> bool:
    """Whether the file at `path` is a recipe exactly as tailor-tui saves one (its header, its keys,
    nothing a person added or changed since): one that may be written again without asking."""
    try:
        text = read_small(path).decode()
        recipe = parse_recipe(text, source=str(path), folder=path.parent)
    except (OSError, ValueError, UnicodeDecodeError, RecipeError):
        return False
    return not path.is_symlink() and recipe.as_saved(text, path.parent)


def check_recipe_target(path: Path, force: bool) -> None:
    """Where a command writes a recipe it makes (--heal, --import): a new file, one tailor-tui wrote
    and nobody changed since (a recovery run again), or one the user lets it replace (--force); a
    recipe a person wrote or edited (its comments, its output) is never replaced in silence."""
    if path.is_dir():
        raise UsageError(f"--recipe {path}: is a folder; name the recipe file to write there, e.g. {path / 'fix.yaml'}")
    if not path.parent.is_dir():
        raise OutputError(f"--recipe {path}: its folder {path.parent} does not exist; create it or name another file")
    if (path.exists() or path.is_symlink()) and not force and not as_tailor_wrote_it(path):
        raise OutputError(f"--recipe {path}: the file exists and is not a recipe as tailor-tui wrote it (edited, "
                          "or a person's); it is replaced only with --force (or name a new file)")
