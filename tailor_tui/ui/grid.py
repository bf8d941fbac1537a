"""The layer-by-checkpoint grid: one row per model row, one column per checkpoint."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from ..composition import Composition

PICKED, HOLDS, DISABLED, TIED = "●", "·", "✗", "tied"


class CheckpointGrid(DataTable):
    """Columns: the row name, then each checkpoint by step. Column 0 is the row names."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="cell", zebra_stripes=False, header_height=2, **kwargs)
        self.composition: Composition | None = None
        self._shape: tuple[int, int, int] | None = None

    def show(self, composition: Composition) -> None:
        """Show `composition`: cells update in place; the table is rebuilt only when the
        columns change (another base relabels every header)."""
        shape = (composition.base, len(composition.checkpoints), len(composition.rows))
        if self.composition is composition and shape == self._shape:
            for row in composition.rows:
                for column, cell in enumerate(self._cells(row.name)):
                    self.update_cell(row.name, "row" if column == 0 else str(column - 1), cell)
            return
        self._shape = shape
        cursor = self.cursor_coordinate
        self.composition = composition
        self.clear(columns=True)
        self.add_column(Text("row", style="bold"), key="row")
        for i, ckpt in enumerate(composition.checkpoints):
            self.add_column(self._header(i), key=str(i))
        for row in composition.rows:
            self.add_row(*self._cells(row.name), key=row.name)
        if cursor.column == 0 or cursor.column > len(composition.checkpoints):
            cursor = cursor._replace(column=composition.base + 1)
        self.move_cursor(row=min(cursor.row, len(composition.rows) - 1), column=cursor.column)

    def _header(self, column: int) -> Text:
        comp = self.composition
        ckpt = comp.checkpoints[column]
        if column == comp.base:
            return Text(f"{ckpt.name}\nstep {ckpt.step} BASE", style="bold reverse")
        if comp.incompatibility(column):
            return Text(f"{ckpt.name}\nstep {ckpt.step} ✗", style="dim strike")
        return Text(f"{ckpt.name}\nstep {ckpt.step}", style="bold")

    def _cells(self, row: str) -> list[Text]:
        comp = self.composition
        r = comp.base_checkpoint.row(row)
        cells = [Text(row, style="dim italic" if r.tied else "")]
        source = comp.source_of(row)
        for column in range(len(comp.checkpoints)):
            if comp.incompatibility(column):
                cells.append(Text(DISABLED, style="dim"))
            elif r.tied:
                mark = f"{TIED} {PICKED}" if column == source else TIED
                cells.append(Text(mark, style="dim"))
            elif column == source and not comp.holds(column, row):
                cells.append(Text("! not saved", style="bold red"))  # a partial base, no pick yet
            elif column == source:
                style = "bold green" if column != comp.base else "bold cyan"
                cells.append(Text(f"{PICKED} picked" if column != comp.base else f"{PICKED} base", style=style))
            elif comp.holds(column, row):
                cells.append(Text(HOLDS, style="dim"))
            else:
                cells.append(Text("–", style="dim"))
        return cells

    async def _on_click(self, event) -> None:
        before = self.cursor_coordinate
        await super()._on_click(event)
        meta = event.style.meta
        # DataTable selects only on a second click; here one click on a cell picks it.
        if meta.get("row", -1) >= 0 and meta.get("column", -1) >= 0 and self.cursor_coordinate != before:
            self._post_selected_message()

    def current(self) -> tuple[str | None, int | None]:
        """(row name, checkpoint column) under the cursor; column None on the names column."""
        if self.composition is None or not self.row_count:
            return None, None
        coord = self.cursor_coordinate
        row = self.composition.rows[coord.row].name
        return row, (coord.column - 1 if coord.column > 0 else None)
