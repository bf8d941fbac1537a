"""The recipe being made in the composer (`RecipeDraft`): scanned checkpoints, base, picks, undo.

Plain Python, no Textual: the TUI renders it and calls its methods; tests drive it
directly. A RecipeDraft turns into a Recipe (and back) so the TUI's work can be
re-run headlessly with `tailor-tui --apply`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tailor_tui.checkpoints.checkpoint import Checkpoint, Row, distinct_names, incompatibility, tied_partner
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint, dcp_incompatibility
from tailor_tui.checkpoints.lineage import other_folder, other_run
from tailor_tui.errors import RecipeError
from tailor_tui.planning.output import default_output, is_default_output
from tailor_tui.planning.recipe import Recipe
from tailor_tui.planning.recipe_file import save_recipe
from tailor_tui.planning.recipe_text import Sameness


@dataclass
class RecipeDraft:
    checkpoints: list[Checkpoint]  # ordered by step: the grid's columns
    base: int  # index of the base checkpoint
    picks: dict[str, int] = field(default_factory=dict)  # row -> column; rows absent use the base
    output: Path | None = None
    recipe_path: Path | None = None  # the recipe the picks were loaded from or saved to: where ctrl+s saves
    # the LLMTailor recipe the picks were read from: never where ctrl+s saves (`converted_path` is), replaced only
    # when asked by name
    read_from: Path | None = None
    world_size: int | None = None  # compose for this many data-parallel ranks (resharding); None: the base's
    # the output was named (set, or by a recipe loaded or saved): never moved on (`renew_default_output`)
    output_named: bool = False
    _undo: list[tuple] = field(default_factory=list, repr=False)  # earlier states (`_state`)
    _redo: list[tuple] = field(default_factory=list, repr=False)
    _saved_state: tuple | None = field(default=None, repr=False)  # the state as last saved or loaded
    _known: dict = field(default_factory=dict, repr=False)  # (rule, base, column) -> its answer

    @classmethod
    def start(cls, checkpoints: list[Checkpoint]) -> "RecipeDraft":
        """A composition of `checkpoints` (ordered by step) with the newest as base and every row
        from the newest checkpoint that holds it (partial checkpoints hold some rows)."""
        if not checkpoints:
            raise RecipeError("no checkpoints to compose")
        comp = cls(list(checkpoints), len(checkpoints) - 1)
        comp._fill_missing()
        comp.output = comp.default_output()
        comp._saved_state = comp._state()
        return comp

    def _state(self) -> tuple:
        return (self.base, dict(self.picks), self.output, self.world_size)

    def _restore(self, state: tuple) -> None:
        self.base, self.picks, self.output, self.world_size = state

    def unsaved_changes(self) -> list[str]:
        """What changed since the last save or load, in words (`the picks`, `the world size`, …)."""
        names = ("the base", "the picks", "the output folder", "the world size")
        return [name for name, now, then in zip(names, self._state(), self._saved_state or (None,) * 4)
                if now != then]

    @property
    def saved(self) -> bool:
        """No change since the last save or load (undo back to that state counts as none)."""
        return self._state() == self._saved_state

    def _fill_missing(self) -> None:
        """Rows the base did not save come from the newest compatible checkpoint that did."""
        for row in self.rows:
            if row.tied or row.name in self.picks or self.holds(self.base, row.name):
                continue
            for column in reversed(range(len(self.checkpoints))):
                if self.holds(column, row.name) and self.incompatibility(column) is None:
                    self.picks[row.name] = column
                    break

    def missing_rows(self) -> list[str]:
        """Rows whose source did not save them (a partial base without a pick)."""
        return [r.name for r in self.rows if not r.tied and not self.holds(self.source_of(r.name), r.name)]

    # --- what the grid shows -------------------------------------------------------------

    @property
    def base_checkpoint(self) -> Checkpoint:
        return self.checkpoints[self.base]

    @property
    def rows(self) -> tuple[Row, ...]:
        return self.base_checkpoint.rows

    def source_of(self, row: str) -> int:
        r = self.base_checkpoint.row(row)
        if r.tied:
            return self.source_of(tied_partner(self.base_checkpoint, r))
        return self.picks.get(row, self.base)

    def label(self, column: int) -> str:
        """The column's checkpoint name, with parent folders where several checkpoints share it."""
        if "labels" not in self._known:
            self._known["labels"] = distinct_names([c.path for c in self.checkpoints])
        return self._known["labels"][column]

    def incompatibility(self, column: int) -> str | None:
        """Why checkpoint `column` cannot be combined with the base, or None (worked out once
        per base, column and whether the output is resharded: the grid asks for every cell on
        every change). Resharding re-partitions every source, whatever its world size."""
        resharding = self.world_size is not None
        if isinstance(self.base_checkpoint, DcpCheckpoint):
            return self._about(column, dcp_incompatibility, "incompatibility")
        if isinstance(self.checkpoints[column], DcpCheckpoint):
            return ("it is a PyTorch Distributed Checkpoint and the base a DeepSpeed ZeRO-3 checkpoint: a recipe takes "
                    "its rows (--apply), the composer shows one format's checkpoints")
        return self._about(column, lambda a, b: incompatibility(a, b, repartitioned=resharding),
                           ("incompatibility", resharding))

    def other_run(self, column: int) -> str | None:
        """Why checkpoint `column` may come from another training run than the base, or None."""
        dcp = isinstance(self.base_checkpoint, DcpCheckpoint) or isinstance(self.checkpoints[column], DcpCheckpoint)
        return self._about(column, other_folder if dcp else other_run, "other_run")

    def _about(self, column: int, rule, name) -> str | None:
        if column == self.base:
            return None
        key = (name, self.base, column)
        if key not in self._known:
            self._known[key] = rule(self.base_checkpoint, self.checkpoints[column])
        return self._known[key]

    def holds(self, column: int, row: str) -> bool:
        """Whether checkpoint `column` holds weights for `row` (a partial checkpoint: only the
        rows it saved)."""
        ckpt = self.checkpoints[column]
        try:
            return not ckpt.row(row).tied and ckpt.holds(row)
        except KeyError:
            return False

    # --- editing (each change can be undone) ---------------------------------------------

    def _remember(self) -> None:
        self._undo.append(self._state())
        self._redo.clear()

    def pick(self, row: str, column: int) -> None:
        r = self.base_checkpoint.row(row)
        if r.tied:
            raise RecipeError(f"row '{row}' is tied to {tied_partner(self.base_checkpoint, r)}; pick that row")
        reason = self.incompatibility(column)
        if reason:
            raise RecipeError(f"{self.checkpoints[column].name} cannot be combined with the base: {reason}")
        if not self.holds(column, row):
            raise RecipeError(f"{self.checkpoints[column].name} is a partial checkpoint that did not save row '{row}'")
        if self.source_of(row) == column:
            return
        self._remember()
        if column == self.base:
            self.picks.pop(row, None)
        else:
            self.picks[row] = column

    def pick_rows(self, rows: list[str], column: int) -> list[str]:
        """A block of rows from `column` as one undoable change: rows without weights of their
        own (tied) and rows a partial `column` did not save keep their source. Returns the rows
        whose source changed."""
        reason = self.incompatibility(column)
        if reason:
            raise RecipeError(f"{self.checkpoints[column].name} cannot be combined with the base: {reason}")
        changed = [r for r in rows if not self.base_checkpoint.row(r).tied and self.holds(column, r)
                   and self.source_of(r) != column]
        if changed:
            self._remember()
            for row in changed:
                if column == self.base:
                    self.picks.pop(row, None)
                else:
                    self.picks[row] = column
        return changed

    def pick_column(self, column: int) -> None:
        """Every row from `column`."""
        reason = self.incompatibility(column)
        if reason:
            raise RecipeError(f"{self.checkpoints[column].name} cannot be combined with the base: {reason}")
        self._remember()
        if column == self.base:
            self.picks = {row: col for row, col in self.picks.items() if not self.holds(column, row)}
        else:  # a partial column gives the rows it saved; the others keep their source
            self.picks.update({r.name: column for r in self.rows if self.holds(column, r.name)})

    def healable_rows(self) -> list[str]:
        """The rows healing picks a checkpoint for (`health.healing.heal`): those with weights of their own."""
        return [r.name for r in self.rows if not r.tied]

    def combines_with(self, column: int) -> bool:
        """Whether checkpoint `column` can be combined with the base (what healing may pick from)."""
        return self.incompatibility(column) is None

    def apply_healing(self, picks: Mapping[str, int]) -> list[str]:
        """Take healing's `picks` ({row: column}, `Healing.picks`) as one undoable change; the rows whose
        source changed."""
        changed = [row for row, col in picks.items() if self.source_of(row) != col]
        if changed:
            self._remember()
            for row in changed:
                if picks[row] == self.base:
                    self.picks.pop(row, None)
                else:
                    self.picks[row] = picks[row]
        return changed

    def set_base(self, column: int) -> None:
        """Make `column` the base; picks it cannot be combined with are dropped."""
        if column == self.base:
            return
        self._remember()
        old_output_default = self._is_default_output()
        self.base = column
        self.picks = {
            row: col
            for row, col in self.picks.items()
            if col != column and self.incompatibility(col) is None and row in self.base_checkpoint.row_names()
        }
        self._fill_missing()
        if old_output_default:
            self.output = self.default_output()

    def set_output(self, output: Path) -> None:
        self._remember()
        self.output, self.output_named = output, True

    def set_world_size(self, world_size: int | None) -> list[str]:
        """Compose for `world_size` ranks (None: the base's world size). Back at the base's, picks
        from checkpoints of another world size cannot stay: they are dropped (returned)."""
        if world_size == self.world_size:
            return []
        if isinstance(self.base_checkpoint, DcpCheckpoint):
            raise RecipeError("a PyTorch Distributed Checkpoint loads at any world size: there is none to choose")
        self._remember()
        self.world_size = world_size
        dropped = [row for row, col in self.picks.items() if self.incompatibility(col) is not None]
        for row in dropped:
            del self.picks[row]
        self._fill_missing()
        return dropped

    def undo(self) -> bool:
        if not self._undo:
            return False
        self._redo.append(self._state())
        self._restore(self._undo.pop())
        return True

    def redo(self) -> bool:
        if not self._redo:
            return False
        self._undo.append(self._state())
        self._restore(self._redo.pop())
        return True

    def default_output(self) -> Path:
        """Where the output goes when nobody named it (`planning.output.default_output`: never an existing
        path)."""
        return default_output(self.base_checkpoint.path)

    def _is_default_output(self) -> bool:
        """Whether the output is a default name for the base (so it follows a change of base)."""
        return is_default_output(self.base_checkpoint.path, self.output)

    def renew_default_output(self) -> None:
        """A default output nobody named (`output_named`: not set, no recipe saved or loaded names it) that exists
        by now (composed since it was chosen, or made by anything else) moves on to the next free default name;
        not an undo step (the default follows, as it follows the base)."""
        if (not self.output_named and self._is_default_output() and self.output is not None
                and os.path.lexists(self.output)):
            self.output = self.default_output()
            if self._saved_state is not None and self._saved_state[2] != self.output:
                self._saved_state = (*self._saved_state[:2], self.output, *self._saved_state[3:])

    # --- recipes ----------------------------------------------------------------------------

    def to_recipe(self) -> Recipe:
        layers = {r.name: self.checkpoints[self.picks[r.name]].path for r in self.rows if r.name in self.picks}
        return Recipe(base=self.base_checkpoint.path, output=self.output, layers=layers, world_size=self.world_size)

    def save(self, path: Path) -> Path:
        """Save the picks to `path`; over a recipe a person wrote, only what changed is edited in it."""
        saved = save_recipe(self.to_recipe(), path, same=Sameness(row=self._row_name, place=self._place))
        self.recipe_path, self._saved_state, self.output_named = saved, self._state(), True  # (the file names it)
        return saved

    def _column_of(self, path: Path) -> int | None:
        """The scanned checkpoint `path` names (its folder or a DeepSpeed tag folder in it), or None."""
        resolved = Path(path).resolve()
        for i, c in enumerate(self.checkpoints):
            if resolved in (c.path.resolve(), c.tag_dir.resolve()):
                return i
        return None

    def _place(self, path: Path) -> object:
        column = self._column_of(path)
        return Path(path).resolve() if column is None else column

    def _row_name(self, written: str) -> str:
        try:
            return self.base_checkpoint.row(written).name
        except KeyError:
            return written

    def load(self, recipe: Recipe) -> None:
        """Adopt a recipe's picks; its checkpoints must be among the scanned ones."""
        def column(path: Path, what: str) -> int:
            found = self._column_of(path)
            if found is None:
                raise RecipeError(f"{recipe.location(what)}: {path} is not among the scanned checkpoints")
            return found

        base = column(recipe.base, "base")
        picks = {}
        for row, path in recipe.layers.items():
            name = self.checkpoints[base].recipe_row(row, recipe.location("row:" + row)).name
            col = column(path, "row:" + row)
            if col != base:
                picks[name] = col
        self._remember()
        self.base, self.picks, self.world_size = base, picks, recipe.world_size
        self.output = recipe.output or self.default_output()
        self.output_named = recipe.output is not None
        converted = recipe.converted_from is not None
        self.recipe_path, self.read_from = (None, recipe.source_file) if converted else (recipe.source_file, None)
        self._saved_state = self._state()
