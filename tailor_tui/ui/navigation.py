"""Moving around the grid and selecting blocks of rows (a mixin of the composer's screen)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailor_tui.ui.dialogs import PathPrompt
from tailor_tui.ui.grid import CheckpointGrid

if TYPE_CHECKING:
    from tailor_tui.ui.host import ComposerHost


class Navigation:
    """g / G, / (jump to a row), v and shift+arrows (select rows: the grid's own selection), f (fold a stack)."""

    def action_select_rows(self: ComposerHost) -> None:
        """Start (or drop) a block selection at the cursor's row; moving up or down extends it."""
        if self.editable():
            self.query_one(CheckpointGrid).toggle_selection()

    def action_extend_selection(self: ComposerHost, step: int) -> None:
        if self.editable():
            self.query_one(CheckpointGrid).extend_selection(step)

    def action_clear_selection(self: ComposerHost) -> None:
        self.query_one(CheckpointGrid).clear_selection()

    def action_fold(self: ComposerHost) -> None:
        """Fold the stack under the cursor (a multimodal model's vision encoder, language model…)
        into its header line, or unfold it."""
        if not self.editable():
            return
        if self.query_one(CheckpointGrid).toggle_fold() is None:
            self.notify("this model has one stack: nothing to fold", timeout=3)
        self.refresh_view()

    def action_first_row(self: ComposerHost) -> None:
        if self.editable():
            self.query_one(CheckpointGrid).move_cursor(row=0)

    def action_last_row(self: ComposerHost) -> None:
        if self.editable():
            grid = self.query_one(CheckpointGrid)
            grid.move_cursor(row=grid.row_count - 1)

    def action_jump(self: ComposerHost) -> None:
        """Go to the first row whose name starts with (else contains) what is typed."""
        if not self.editable():
            return
        comp = self.active_composition

        def done(value: str | None) -> None:
            text = (value or "").strip()
            if not text:
                return
            names = [r.name for r in comp.rows]
            found = next((i for i, n in enumerate(names) if n == text), None)
            found = found if found is not None else next((i for i, n in enumerate(names) if n.startswith(text)), None)
            found = found if found is not None else next((i for i, n in enumerate(names) if text in n), None)
            if found is None:
                self.notify(f"no row named like '{text}'", severity="warning")
            else:
                grid = self.query_one(CheckpointGrid)
                grid.reveal(found)
                grid.move_cursor(row=found)

        self.app.push_screen(PathPrompt("Jump to row (e.g. layers.40)", ""), done)
