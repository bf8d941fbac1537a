"""Saving and loading recipes from the composer, never losing one (a mixin of the composer's screen)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint
from tailor_tui.errors import TailorError
from tailor_tui.planning.recipe_file import converted_path, load_recipe
from tailor_tui.team.sbatch import write_sbatch
from tailor_tui.ui.dialogs import Answer, Confirm, ErrorDialog, PathPrompt
from tailor_tui.units import WHOLE_NUMBER, clipped, whole_number

if TYPE_CHECKING:
    from tailor_tui.ui.host import ComposerHost, Saved


class RecipeActions:
    """ctrl+s, S (save as) and ctrl+o: a recipe that failed to load is never the save target;
    w: the world size to compose for (in the recipe too)."""

    def action_set_world_size(self: ComposerHost, then_plan: bool = False) -> None:
        """Ask for the data-parallel world size to compose for (empty: the base's); from the plan
        dialog (`then_plan`), show the plan again with it."""
        comp = self.composition
        if comp is None or (not then_plan and not self.editable()):
            return
        if isinstance(comp.base_checkpoint, DcpCheckpoint):
            self.notify("a PyTorch Distributed Checkpoint loads at any world size: there is none to choose", timeout=5)
            return

        def done(value: str | None) -> None:
            if value is None:  # Esc: nothing changes
                return
            text = value.strip()
            size = whole_number(text)
            if text and not (size is not None and size >= 1):
                self.app.push_screen(ErrorDialog(f"world size '{clipped(text)}': a whole number of at least 1 (the "
                                                 f"data-parallel ranks to compose for, in {WHOLE_NUMBER}), or "
                                                 "empty for the base's"))
                return
            dropped = comp.set_world_size(size if text else None)
            if dropped:
                self.notify(f"{', '.join(dropped)}: back to the base (their checkpoints have another world size)",
                            severity="warning", timeout=8)
            self.refresh_view()
            if then_plan:
                self.plan_worker(comp.to_recipe())

        base = comp.base_checkpoint.world_size
        self.app.push_screen(PathPrompt(f"World size to compose for (the base: {base} ranks; empty keeps it)",
                                    str(comp.world_size or "")), done)

    def action_save_recipe(self: ComposerHost, then: Saved | None = None) -> None:
        """Save the picks (asking where, the first time); `then(path)` once they are saved."""
        comp = self.composition
        if comp is None:
            return
        if comp.recipe_path is not None:
            self.save_to(comp.recipe_path, then=then)
        else:
            self.action_save_recipe_as(then=then)

    def action_save_recipe_as(self: ComposerHost, then: Saved | None = None) -> None:
        comp = self.composition
        if comp is None:
            return

        def done(value: str | None) -> None:
            if value:
                self.save_to(Path(os.path.expanduser(value)), then=then)

        if comp.recipe_path is None and comp.read_from is not None:
            try:
                default = converted_path(comp.read_from)
            except TailorError:
                default = comp.read_from.with_name("recipe.yaml")
            title = f"Save the picks as a tailor-tui recipe ({self.rel(comp.read_from)}, LLMTailor's, stays as it is)"
        else:
            default, title = comp.recipe_path or self.options.recipe or Path("recipe.yaml"), "Save the recipe as"
        self.app.push_screen(PathPrompt(title, str(default)), done)

    def action_write_batch_job(self: ComposerHost, bytes_to_write: int) -> None:
        """Save the recipe, then write the sbatch script that composes it over several nodes."""
        def write(recipe: Path) -> None:
            try:
                script = write_sbatch(recipe, bytes_to_write)
            except TailorError as exc:
                self.app.push_screen(ErrorDialog(str(exc)))
                return
            self.notify(f"wrote {self.rel(script)}; submit it with: sbatch {self.rel(script)}", timeout=15)

        self.action_save_recipe(then=write)

    def save_to(self: ComposerHost, path: Path, confirmed: bool = False, then: Saved | None = None) -> None:
        """Save there; a file the composer did not load or save is replaced only when confirmed;
        `then(path)` once saved."""
        comp = self.active_composition  # the save actions return before this without one
        if path.is_dir():  # a folder is no recipe file: say so, never "Replace .?" then "Is a directory"
            self.app.push_screen(ErrorDialog(f"{path} is a folder: name the recipe file to save, e.g. "
                                             f"{path / 'fix.yaml'}", title="Cannot save the recipe"))
            return
        target = comp.recipe_path
        ours, llmtailor = _same_file(path, target), _same_file(path, comp.read_from)
        if llmtailor and not confirmed:
            def replace(yes: Answer) -> None:
                if yes:
                    self.save_to(path, confirmed=True, then=then)

            self.app.push_screen(Confirm(f"Replace the LLMTailor recipe {self.rel(path)}?",
                                         f"{path} is the LLMTailor recipe these picks were read from. Replacing it "
                                         "writes a tailor-tui recipe in its place: its slices become one pick per "
                                         "row, and LLMTailor cannot read it any more. Back keeps it; save to "
                                         "another name with S.", accept="Replace", decline="Back"), replace)
            return
        if path.exists() and not ours and not confirmed:
            def answer(yes: Answer) -> None:
                if yes:
                    self.save_to(path, confirmed=True, then=then)

            self.app.push_screen(Confirm(f"Replace {self.rel(path)}?",
                                     f"{path} exists and was not loaded into this composer: its contents would "
                                     "be replaced by these picks.", accept="Replace", decline="Back"), answer)
            return
        try:
            saved = comp.save(path)
        except TailorError as exc:
            self.app.push_screen(ErrorDialog(str(exc)))
            return
        self.notify(f"recipe saved to {saved}; run it with: tailor-tui --apply {saved}")
        self.update_title()
        if then is not None:
            then(Path(saved))

    def action_load_recipe(self: ComposerHost) -> None:
        if not self.editable():
            return
        comp = self.active_composition

        def done(value: str | None) -> None:
            if value:
                self.adopt_recipe(Path(os.path.expanduser(value)))
                self.refresh_view()

        def ask_path(yes: Answer = True) -> None:
            if yes:
                self.app.push_screen(PathPrompt("Load a recipe", str(comp.recipe_path or "")), done)

        if comp.saved:
            ask_path()
        else:
            self.app.push_screen(Confirm("Load a recipe?", "The current picks are not saved; loading a recipe "
                                     "replaces them (undo brings them back).", accept="Load", decline="Back"),
                             ask_path)

    def adopt_recipe(self: ComposerHost, path: Path) -> None:
        try:
            recipe = load_recipe(path, run=self.options.run_dir)  # an LLMTailor recipe's paths: in this run
            self.active_composition.load(recipe)
        except TailorError as exc:
            self.app.push_screen(ErrorDialog(str(exc), title="Cannot load the recipe"))
            return
        if recipe.converted_from is not None:  # ctrl+s asks where: never over the LLMTailor file
            self.notify(f"read {self.rel(path)} as an {recipe.converted_from} recipe; ctrl+s saves the picks "
                        "as a tailor-tui recipe beside it, leaving it as it is")


def _same_file(path: Path, other: Path | None) -> bool:
    """Whether `path` is the file `other` names (both there: compared by identity)."""
    return other is not None and path.exists() and other.exists() and os.path.samefile(path, other)
