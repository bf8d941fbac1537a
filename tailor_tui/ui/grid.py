"""The layer-by-checkpoint grid: one row per model row, one column per checkpoint."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from ..composition import Composition
from ..health import Health
from .heatmap import background, damage, header_suffix, row_range

PICKED, HOLDS, DISABLED, TIED = "●", "·", "✗", "tied"


class CheckpointGrid(DataTable):
    """Columns: the row name, then each checkpoint by step. Column 0 is the row names.
    With health statistics, every cell a checkpoint holds is coloured by the chosen metric
    (scaled per row) and an unhealthy one says NaN / CRC / ERR."""

    def __init__(self, **kwargs) -> None:
        # the row names stay in view when a wide run scrolls sideways (the header row always does)
        super().__init__(cursor_type="cell", zebra_stripes=False, header_height=2, fixed_columns=1, **kwargs)
        self.composition: Composition | None = None
        self.health: Health | None = None
        self.metric = "rel_change"
        self._shape: tuple | None = None
        self._drawn: dict[str, tuple] = {}  # row -> what its cells were drawn from
        self.selection: tuple[int, int] | None = None  # rows (first, last) of a range being selected

    def show(self, composition: Composition, health: Health | None = None, metric: str = "rel_change",
             health_version: int = 0) -> None:
        """Show `composition`: only rows whose source, base or statistics changed are redrawn
        (a pick redraws one row); the table is rebuilt only when the columns change (another
        base relabels every header, new losses too)."""
        self.health, self.metric = health, metric
        self._index = {r.name: i for i, r in enumerate(composition.rows)}
        losses = tuple(header_suffix(health, i) for i in range(len(composition.checkpoints)))
        shape = (composition.base, len(composition.checkpoints), len(composition.rows), losses)
        if self.composition is composition and shape == self._shape:
            for row in composition.rows:
                signature = self._signature(row.name, health_version)
                if self._drawn.get(row.name) == signature:
                    continue
                self._drawn[row.name] = signature
                for column, cell in enumerate(self._cells(row.name)):
                    self.update_cell(row.name, "row" if column == 0 else str(column - 1), cell)
            return
        self._shape = shape
        cursor = self.cursor_coordinate
        self.composition = composition
        self._drawn = {row.name: self._signature(row.name, health_version) for row in composition.rows}
        self.clear(columns=True)
        self.add_column(Text("row", style="bold"), key="row")
        for i, ckpt in enumerate(composition.checkpoints):
            self.add_column(self._header(i), key=str(i))
        for row in composition.rows:
            self.add_row(*self._cells(row.name), key=row.name)
        if cursor.column == 0 or cursor.column > len(composition.checkpoints):
            cursor = cursor._replace(column=composition.base + 1)
        self.move_cursor(row=min(cursor.row, len(composition.rows) - 1), column=cursor.column)

    def _signature(self, row: str, health_version: int) -> tuple:
        comp = self.composition
        return (comp.source_of(row), comp.base, self.metric, health_version, self._selected(row)) if comp else ()

    def _selected(self, row: str) -> bool:
        if self.selection is None:
            return False
        return self.selection[0] <= self._index[row] <= self.selection[1]

    def selected_rows(self) -> list[str]:
        if self.selection is None or self.composition is None:
            return []
        first, last = self.selection
        return [r.name for r in self.composition.rows[first: last + 1]]

    def _header(self, column: int) -> Text:
        comp = self.composition
        ckpt = comp.checkpoints[column]
        loss = header_suffix(self.health, column) + (" · composed" if ckpt.composed else "")
        if column == comp.base:
            return Text(f"{ckpt.name}\nstep {ckpt.step}{loss} BASE", style="bold reverse")
        if comp.incompatibility(column):
            return Text(f"{ckpt.name}\nstep {ckpt.step}{loss} ✗", style="dim strike")
        return Text(f"{ckpt.name}\nstep {ckpt.step}{loss}", style="bold")

    def _cells(self, row: str) -> list[Text]:
        comp, health = self.composition, self.health
        r = comp.base_checkpoint.row(row)
        style = "dim italic" if r.tied else ""
        cells = [Text(row, style=style + (" reverse bold" if self._selected(row) else ""))]
        source = comp.source_of(row)
        scale = row_range(health, row, self.metric)
        for column in range(len(comp.checkpoints)):
            cell = health.cell(row, column) if health is not None else None
            bad = damage(cell)
            colour = background(cell, self.metric, scale)
            if comp.incompatibility(column):
                cells.append(Text(DISABLED, style="dim"))
            elif r.tied:
                mark = f"{TIED} {PICKED}" if column == source else TIED
                cells.append(Text(mark, style="dim"))
            elif column == source and not comp.holds(column, row):
                cells.append(Text("! not saved", style="bold red"))  # a partial base, no pick yet
            elif column == source:
                style = "bold green" if column != comp.base else "bold cyan"
                label = "picked" if column != comp.base else "base"
                if bad:
                    cells.append(Text(f"{PICKED} {bad}", style="bold red reverse"))
                else:
                    cells.append(Text(f"{PICKED} {label}", style=style + colour))
            elif comp.holds(column, row):
                cells.append(Text(bad, style="bold red") if bad else Text(f" {HOLDS} ", style="dim" + colour))
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
