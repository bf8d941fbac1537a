"""The text a recipe is saved as over a recipe a person wrote: their file, edited where the recipe
changed and nowhere else.

Every comment (at the top, at the end of a line, between rows), blank line, key order, indentation
and quoting style survives: the edits are made to the text itself, at the places the strict parser
(PyYAML's nodes, `recipe.parse_recipe`) says each key, value and row was written.

- a changed `base`, `output`, `world_size` or row source: its value replaced, in the style it was
  written in (quoted stays quoted); an unchanged one is kept as written (`~/run`, `../run`), whatever
  its spelling: values are compared by the checkpoint they mean (`Sameness`);
- a removed key or row: its line(s) go, with its own end-of-line comment; the comments above it stay;
- an added row: one line after its nearest kept neighbour above it in the model's order (at the top
  of `layers` when none is), indented as its neighbours, quoted as its neighbour; an added key: after
  the key that comes before it in a recipe's order;
- a recipe with nothing changed: the same bytes.

The edited text is parsed again and must mean what the recipe says; when it does not (YAML this
editor does not handle: a flow-style recipe, anchors), or the file is not a valid tailor-tui recipe
(a mergekit one, a broken one), the recipe is written anew (`Recipe.fresh_text`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tailor_tui.checkpoints.side_files import read_small
from tailor_tui.errors import RecipeError
from tailor_tui.planning.recipe import KEYS, Recipe, parse_recipe


def _resolved(path: Path) -> object:
    return Path(path).resolve()


def _as_written(row: str) -> str:
    return row


@dataclass(frozen=True)
class Sameness:
    """When two spellings mean the same: `row` gives a row name's canonical name (the composer: its
    model's row; an alias written by hand means the same row), `place` what a checkpoint path means
    (the composer: its column, so `run/checkpoint-4/global_step4` is `run/checkpoint-4`)."""

    row: Callable[[str], str] = field(default=_as_written)
    place: Callable[[Path], object] = field(default=_resolved)

    def meaning(self, recipe: Recipe) -> tuple:
        rows = {self.row(r): self.place(p) for r, p in recipe.layers.items()}
        output = None if recipe.output is None else self.place(recipe.output)
        return self.place(recipe.base), output, recipe.world_size, rows, len(recipe.layers)


def text_to_save(recipe: Recipe, path: Path, same: Sameness | None = None) -> str:
    """What saving `recipe` at `path` writes: the file there, edited (its comments, order and layout
    kept), when it is a tailor-tui recipe a person wrote or changed; else the recipe anew."""
    fresh, same = recipe.fresh_text(path.parent), same or Sameness()
    try:
        old_text = read_small(path).decode()
        old = parse_recipe(old_text, source=str(path), folder=path.parent)
    except (OSError, ValueError, UnicodeDecodeError, RecipeError):
        return fresh  # none there, or not a tailor-tui recipe: nothing of it to keep
    if old.as_saved(old_text, path.parent):  # as tailor-tui wrote it: so it stays (--heal writes it again)
        return fresh
    try:
        edited = _Editor(old_text, old, path.parent, same).edit(recipe)
        again = parse_recipe(edited, source=str(path), folder=path.parent)
    except (RecipeError, yaml.YAMLError, _Unhandled):
        return fresh
    return edited if same.meaning(again) == same.meaning(recipe) else fresh


class _Unhandled(Exception):
    """YAML the editor leaves alone: the recipe is written anew."""


def _scalar(value: str | int, style: str | None = None) -> str:
    """`value` as one line of YAML, in `style` (' or ") when it was quoted, plain when it can be."""
    if isinstance(value, int):
        return str(value)
    style = style if style in ("'", '"') else None
    text = yaml.safe_dump([value], default_flow_style=True, default_style=style, width=1 << 20,
                          allow_unicode=True).strip()[1:-1]
    return text if "\n" not in text else _scalar(value, '"')  # a line break in a path: escaped


def _line_start(text: str, at: int) -> int:
    return text.rfind("\n", 0, at) + 1


def _end(text: str, node: yaml.Node) -> int:
    """Where the line(s) holding `node` end (after its end-of-line comment and line break)."""
    if isinstance(node, yaml.MappingNode) and node.value and not node.flow_style:
        return _end(text, node.value[-1][1])  # a block mapping's own end runs on over comments below it
    at = node.end_mark.index
    if at > 0 and text[at - 1] == "\n":
        return at
    line_break = text.find("\n", at)
    return len(text) if line_break < 0 else line_break + 1


class _Editor:
    def __init__(self, text: str, old: Recipe, folder: Path, same: Sameness):
        self.text, self.old, self.folder, self.same = text, old, folder, same
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # parse_recipe has checked and bounded it
        if not isinstance(root, yaml.MappingNode) or root.flow_style:
            raise _Unhandled
        self.entries = {k.value: (k, v) for k, v in root.value}
        self.edits: list[tuple[int, int, str]] = []  # (start, end, new text), applied in order of start

    def show(self, path: Path) -> str:
        return os.path.relpath(Path(path).absolute(), self.folder.absolute())

    def replace(self, node: yaml.Node, value: str | int) -> None:
        start, end = node.start_mark.index, node.end_mark.index
        block = node.style in ("|", ">") and self.text[start:end].endswith("\n")
        self.edits.append((start, end, _scalar(value, node.style) + ("\n" if block else "")))

    def insert(self, at: int, lines: str) -> None:
        self.edits.append((at, at, lines))

    def remove(self, key: yaml.Node, value: yaml.Node) -> None:
        self.edits.append((_line_start(self.text, key.start_mark.index), _end(self.text, value), ""))

    def edit(self, recipe: Recipe) -> str:
        wanted = {"base": recipe.base, "output": recipe.output, "world_size": recipe.world_size}
        had = {"base": self.old.base, "output": self.old.output, "world_size": self.old.world_size}
        for key, want in wanted.items():
            if key not in self.entries:
                if want is not None:
                    self.insert(self.after(key), f"{key}: {_scalar(self.value(want))}\n")
            elif want is None:
                self.remove(*self.entries[key])
            elif self.meant(had[key]) != self.meant(want):
                self.replace(self.entries[key][1], self.value(want))
        self.rows(recipe.layers)
        out, at = [], 0
        for start, end, new in sorted(self.edits, key=lambda e: (e[0], e[1])):
            if start < at:
                raise _Unhandled  # overlapping edits: not a layout this editor knows
            line = "\n" if new.endswith("\n") and start and self.text[start - 1] != "\n" else ""
            out += [self.text[at:start], line, new]
            at = end
        return "".join(out) + self.text[at:]

    def value(self, want: Path | int) -> str | int:
        return want if isinstance(want, int) else self.show(want)

    def meant(self, value: Path | int | None) -> object:
        return value if value is None or isinstance(value, int) else self.same.place(value)

    def after(self, key: str) -> int:
        """Where a key the file lacks goes: after every key that comes before it in a recipe."""
        return max((_end(self.text, self.entries[k][1]) for k in KEYS[:KEYS.index(key)] if k in self.entries),
                   default=0)

    def rows(self, layers: dict[str, Path]) -> None:
        same, old_rows = self.same, self.old.layers
        if "layers" not in self.entries:
            if layers:
                self.insert(len(self.text), "layers:\n" + "".join(
                    f"  {_scalar(row)}: {_scalar(self.show(p))}\n" for row, p in layers.items()))
            return
        key, node = self.entries["layers"]
        if isinstance(node, yaml.MappingNode) and node.flow_style:
            self.flow_rows(node, layers)
            return
        written = node.value if isinstance(node, yaml.MappingNode) else []
        if layers and not written and node.end_mark.index > node.start_mark.index:  # `layers: ~`, `null`
            self.edits.append((key.end_mark.index, node.end_mark.index, ":"))
        kept: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in written:
            row = same.row(k.value)
            if row not in layers:
                self.remove(k, v)
                continue
            kept[row] = (k, v)
            if same.place(old_rows[k.value]) != same.place(layers[row]):
                self.replace(v, self.show(layers[row]))
        indent = " " * (written[0][0].start_mark.column if written else key.start_mark.column + 2)
        neighbour: tuple[yaml.Node, yaml.Node] | None = None
        for row, path in layers.items():
            if row in kept:
                neighbour = kept[row]
                continue
            at = _end(self.text, neighbour[1]) if neighbour else _end(self.text, key)
            style = neighbour[1].style if neighbour else None
            self.insert(at, f"{indent}{_scalar(row)}: {_scalar(self.show(path), style)}\n")

    def flow_rows(self, node: yaml.MappingNode, layers: dict[str, Path]) -> None:
        """`layers: {row: source, ...}` stays in flow style, written anew when a row changed."""
        old = {self.same.row(r): self.same.place(p) for r, p in self.old.layers.items()}
        if old != {r: self.same.place(p) for r, p in layers.items()} or len(self.old.layers) != len(layers):
            rows = ", ".join(f"{_scalar(row)}: {_scalar(self.show(p))}" for row, p in layers.items())
            self.edits.append((node.start_mark.index, node.end_mark.index, "{" + rows + "}"))
