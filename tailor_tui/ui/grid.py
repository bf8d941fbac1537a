"""The layer-by-checkpoint grid: one row per model row, one column per checkpoint.

A line-API widget: each frame renders only the cells in view, so a run of 81 rows x 100
checkpoints redraws a pick in milliseconds (a DataTable re-renders every cell of every
visible row on any change). The row names (column 0) and the two header lines stay in view
while the rest scrolls. Coordinates are DataTable's: column 0 is the names, checkpoint i is
column i + 1; a coordinate's row is the draft's row, whatever line shows it. A multimodal
model's rows come under a header line per stack (`grid_lines`): `f` folds the stack under the
cursor into its header, which then stands for its every row (a pick there picks them all).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.coordinate import Coordinate
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tailor_tui.health.healing import Health, damage, numbers
from tailor_tui.planning.recipe_draft import RecipeDraft
from tailor_tui.ui.actions import GRID, bindings
from tailor_tui.ui.describe import background, header_suffix, metric_text, row_range
from tailor_tui.ui.grid_lines import GridLines, RowGroup, groups_of
from tailor_tui.units import shown

PICKED, HOLDS, DISABLED, TIED = "●", "·", "✗", "tied"
OPEN, FOLDED, INDENT = "▾", "▸", "  "  # a stack's header, open and folded; its rows' names, indented
HEADER_HEIGHT = 2
MIN_WIDTH = 10  # a checkpoint column fits "● picked" and its padding
WIDE = 24  # a checkpoint column that also shows its cell's value (`● picked  2.48%`): where they all fit
WIDER = 32  # one that shows its weight RMS and Δ (`● picked  0.115 Δ2.48%`, as --stats): where they all fit


@dataclass(frozen=True)
class GridCell:
    text: str
    style: str = ""  # a Rich style ("bold red on #1f3a5f")


class CheckpointGrid(ScrollView, can_focus=True):
    """Columns: the row names, then each checkpoint by step. With health statistics, every
    cell a checkpoint holds is coloured by the chosen metric (scaled per row) and an
    unhealthy one says NaN / CRC / ERR."""

    BINDINGS = bindings(GRID)  # the moves and Enter (`actions`)
    COMPONENT_CLASSES = {"grid--header", "grid--names", "grid--cursor"}
    DEFAULT_CSS = """
    CheckpointGrid { background: $surface; }
    CheckpointGrid > .grid--header { background: $panel; color: $foreground; text-style: bold; }
    CheckpointGrid > .grid--names { background: $panel; color: $foreground; }
    CheckpointGrid > .grid--cursor { background: $block-cursor-background; color: $block-cursor-foreground;
                                     text-style: bold; }
    CheckpointGrid:blur > .grid--cursor { background: $block-cursor-blurred-background; text-style: none; }
    """

    class CursorMoved(Message):
        """The cursor is on another cell."""

        def __init__(self, grid: "CheckpointGrid", coordinate: Coordinate) -> None:
            super().__init__()
            self.grid, self.coordinate = grid, coordinate

    class SelectionChanged(Message):
        """The block of rows selected (`selection`) changed: started, extended, dropped."""

        def __init__(self, grid: "CheckpointGrid") -> None:
            super().__init__()
            self.grid = grid

    class Chosen(Message):
        """Enter or a click on a cell: pick it."""

        def __init__(self, grid: "CheckpointGrid", coordinate: Coordinate) -> None:
            super().__init__()
            self.grid, self.coordinate = grid, coordinate

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.draft: RecipeDraft | None = None
        self.health: Health | None = None
        self.metric = "rel_change"
        self.selection: tuple[int, int] | None = None  # rows (first, last) of a range being selected
        self._anchor: int | None = None  # the row the selection started at (v): the cursor's moves extend it from there
        self._shape: tuple | None = None
        self._drawn: dict[str, tuple] = {}  # row -> what its cells were drawn from
        self._index: dict[str, int] = {}
        self._rows: list[list[GridCell]] = []  # per row: its name cell, then one per checkpoint
        self._headers: list[tuple[GridCell, GridCell]] = []  # per column, names included
        self._widths: list[int] = []  # per column, names included
        self._starts: list[int] = []  # x of each checkpoint column in the scrolling part
        self._cursor = Coordinate(0, 0)
        self._versions: list[int] = []  # per row, bumped when its cells change: the line cache's key
        self._lines: dict[tuple, Strip] = {}  # rendered lines of this frame's geometry
        self.folded: set[str] = set()  # the stacks folded into their header line
        self.numbers = 0  # what the cells show of their values beside their mark (`_numbers`: wide terminals)
        self._health_version, self._layout = 0, GridLines(0)

    # --- what DataTable users expect ----------------------------------------------------

    @property
    def cursor_coordinate(self) -> Coordinate:
        return self._cursor

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def move_cursor(self, *, row: int | None = None, column: int | None = None) -> None:
        if not self._rows:
            return
        row, column = self._cursor.row if row is None else row, self._cursor.column if column is None else column
        # the names column is a label, not a cell: the cursor stays on the checkpoints' columns
        target = Coordinate(max(0, min(len(self._rows) - 1, row)), max(1, min(len(self._widths) - 1, column)))
        self._scroll_to_cell(target)
        if target != self._cursor:
            before, self._cursor = self._cursor, target
            self._refresh_rows([before.row, target.row], header=before.column != target.column)
            if self.selection is not None and self._anchor is not None:  # a selection follows the cursor
                self._select((min(self._anchor, target.row), max(self._anchor, target.row)))
            self.post_message(self.CursorMoved(self, target))

    # --- a block of rows (v, shift+arrows): one pick for them all ------------------------

    def toggle_selection(self) -> None:
        """Start a block selection at the cursor's row, or drop the one there is."""
        if self.selection is not None:
            self.clear_selection()
            return
        self._anchor = self._cursor.row
        self._select((self._anchor, self._anchor))

    def extend_selection(self, step: int) -> None:
        """Move the cursor `step` rows, the selection with it (started here where there is none)."""
        if self.selection is None:
            self.toggle_selection()
        self.move_cursor(row=max(0, min(self.row_count - 1, self._cursor.row + step)))

    def clear_selection(self) -> None:
        if self.selection is not None:
            self._anchor = None
            self._select(None)

    def _select(self, selection: tuple[int, int] | None) -> None:
        if selection != self.selection:
            self.selection = selection
            self.post_message(self.SelectionChanged(self))

    def current(self) -> tuple[str | None, int | None]:
        """(row name, checkpoint column) under the cursor; column None on the names column."""
        if self.draft is None or not self._rows:
            return None, None
        return self.draft.rows[self._cursor.row].name, (self._cursor.column - 1 if self._cursor.column else None)

    def cell_text(self, row: str, checkpoint: int) -> str:
        """What the cell of `row` and checkpoint `checkpoint` says (tests and tools)."""
        return self._rows[self._index[row]][checkpoint + 1].text

    def header_text(self, checkpoint: int) -> str:
        return "\n".join(cell.text for cell in self._headers[checkpoint + 1])

    def column_x(self, checkpoint: int) -> int:
        """Where checkpoint `checkpoint`'s column starts on screen (scrolled to the left)."""
        return self._widths[0] + self._starts[checkpoint] - round(self.scroll_x)

    def selected_rows(self) -> list[str]:
        if self.selection is None or self.draft is None:
            return []
        first, last = self.selection
        return [r.name for r in self.draft.rows[first: last + 1]]

    def block_rows(self) -> list[str]:
        """The rows a pick takes at once: the selection's, or those of the folded stack under the
        cursor; [] for a pick of one row."""
        folded = self.folded_stack()
        return folded[1] if self.selection is None and folded is not None else self.selected_rows()

    def folded_stack(self) -> tuple[str, list[str]] | None:
        """(name, rows) of the folded stack whose header the cursor is on, or None."""
        folded = self._layout.folded_at(self._cursor.row)
        if folded is None or self.draft is None:
            return None
        return folded.name, [r.name for r in self.draft.rows[folded.first: folded.last + 1]]

    def jump(self, text: str) -> bool:
        """Put the cursor on the first row named `text`, else whose name starts with it, else that contains it (its
        stack unfolded); whether there is one."""
        names = [r.name for r in self.draft.rows] if self.draft is not None else []
        found = next((i for match in (str.__eq__, str.startswith, str.__contains__)
                      for i, name in enumerate(names) if match(name, text)), None)
        if found is None:
            return False
        folded = self._layout.folded_at(found)
        if folded is not None:
            self.folded.discard(folded.name)
            self._lay_out()
            self._lines.clear()
            self.refresh()
        self.move_cursor(row=found)
        return True

    def toggle_fold(self) -> str | None:
        """Fold the stack under the cursor into its header line, or unfold it; its name, or None."""
        group = self._layout.stack_of(self._cursor.row)  # None in a model of one stack
        if group is None:
            return None
        self.folded ^= {group.name}
        self._lay_out()
        self._lines.clear()
        self.refresh()
        self.call_after_refresh(self._scroll_to_cell, self._cursor)
        return group.name

    # --- what is shown ------------------------------------------------------------------

    def show(self, draft: RecipeDraft, health: Health | None = None, metric: str = "rel_change",
             health_version: int = 0) -> None:
        """Show `draft`: only rows whose source, base, statistics or selection changed
        are worked out again (a pick: one row); the columns are rebuilt only when they change
        (another base relabels every header, new losses too)."""
        self.health, self.metric, self._health_version = health, metric, health_version
        losses = tuple(header_suffix(health, i) for i in range(len(draft.checkpoints)))
        self.numbers = self._numbers(draft)
        shape = (draft.base, len(draft.checkpoints), len(draft.rows), losses, self.numbers)
        if self.draft is not draft or shape != self._shape:
            self.draft, self._shape = draft, shape
            self._index = {r.name: i for i, r in enumerate(draft.rows)}
            self._headers = [(GridCell("row", "bold"), GridCell("step · loss" if any(losses) else "step", "dim"))]
            self._headers += [self._header(i) for i in range(len(draft.checkpoints))]
            self._rows = [self._cells(r.name) for r in draft.rows]
            self._drawn = {r.name: self._signature(r.name, health_version) for r in draft.rows}
            self._versions = [v + 1 for v in self._versions[: len(self._rows)]]
            self._versions += [0] * (len(self._rows) - len(self._versions))
            self._lines.clear()
            self._lay_out()
            self._widths = []
            self._measure(self._rows)
            cursor = self._cursor
            if cursor.column == 0 or cursor.column > len(draft.checkpoints):
                cursor = cursor._replace(column=draft.base + 1)
            self._cursor = Coordinate(min(cursor.row, len(self._rows) - 1), cursor.column)
            self.call_after_refresh(self._scroll_to_cell, self._cursor)
            self.refresh()
            return
        changed = []
        for row in draft.rows:
            signature = self._signature(row.name, health_version)
            if self._drawn.get(row.name) != signature:
                self._drawn[row.name] = signature
                i = self._index[row.name]
                self._rows[i] = self._cells(row.name)
                self._versions[i] += 1
                changed.append(i)
        if changed:
            if self._measure([self._rows[i] for i in changed]):
                self._lines.clear()
                self.refresh()
            else:
                self._refresh_rows(changed)

    def _lay_out(self) -> None:
        """Which line shows which row or stack header (after new rows or a fold)."""
        groups = groups_of(r.group for r in self._shown.rows)
        self.folded &= {g.name for g in groups}
        self._layout = GridLines(len(self._rows), groups, self.folded)
        self.virtual_size = Size(self.virtual_size.width, HEADER_HEIGHT + len(self._layout))

    def _refresh_rows(self, rows: list[int], header: bool = False) -> None:
        """Repaint only the lines of `rows` and of their stacks' headers (and the header) where in view."""
        width, top, layout = self.size.width, round(self.scroll_y), self._layout
        lines = {layout.lines[row] for row in rows if 0 <= row < layout.count}
        lines |= {layout.entries.index(g) for row in rows if (g := layout.stack_of(row)) is not None}
        regions = [Region(0, 0, width, HEADER_HEIGHT)] if header else []
        regions += [Region(0, HEADER_HEIGHT + line - top, width, 1) for line in lines
                    if 0 <= line - top < self.size.height - HEADER_HEIGHT]
        if regions:
            self.refresh(*regions)

    @property
    def _shown(self) -> RecipeDraft:
        """The draft `show` works out the cells of (set before it does)."""
        if self.draft is None:
            raise RuntimeError("the grid shows no draft yet")
        return self.draft

    def _signature(self, row: str, health_version: int) -> tuple:
        comp = self._shown
        return (comp.source_of(row), comp.base, self.metric, health_version, self._selected(row))

    def _selected(self, row: str) -> bool:
        return self.selection is not None and self.selection[0] <= self._index[row] <= self.selection[1]

    def _measure(self, rows: list[list[GridCell]]) -> bool:
        """Widen the columns to fit the headers and `rows` (they never narrow while the columns
        stay); True if any changed."""
        widths = [max(cell_len(h[0].text), cell_len(h[1].text)) for h in self._headers]
        for cells in rows:
            for i, cell in enumerate(cells):
                widths[i] = max(widths[i], cell_len(cell.text))
        widths = [w + 2 for w in widths]  # a space each side
        widths[1:] = [max(w, MIN_WIDTH) for w in widths[1:]]
        if len(widths) == len(self._widths):
            widths = [max(a, b) for a, b in zip(widths, self._widths)]
        if widths == self._widths:
            return False
        self._widths = widths
        self._starts, x = [], 0
        for w in widths[1:]:
            self._starts.append(x)
            x += w
        self.virtual_size = Size(widths[0] + x, HEADER_HEIGHT + len(self._layout))
        return True

    def _header(self, column: int) -> tuple[GridCell, GridCell]:
        comp = self._shown
        ckpt = comp.checkpoints[column]
        step = f"step {ckpt.step}{header_suffix(self.health, column)}"
        name = shown(comp.label(column))  # a folder's name, as text (never control codes)
        if column == comp.base:
            return GridCell(name, "bold reverse"), GridCell(f"{step} BASE", "bold reverse")
        if comp.incompatibility(column):
            return GridCell(name, "dim strike"), GridCell(f"{step} {DISABLED}", "dim strike")
        return GridCell(name, "bold"), GridCell(step, "bold")

    def _cells(self, row: str) -> list[GridCell]:
        comp, health = self._shown, self.health
        r = comp.base_checkpoint.row(row)
        style = "dim italic" if r.tied else ""
        indent = INDENT if r.group else ""
        cells = [GridCell(indent + shown(row), style + (" reverse bold" if self._selected(row) else ""))]
        source = comp.source_of(row)
        scale = row_range(health, row, self.metric)
        for column in range(len(comp.checkpoints)):
            cell = health.cell(row, column) if health is not None else None
            bad = damage(cell)
            colour = background(cell, self.metric, scale)
            if comp.incompatibility(column):
                cells.append(GridCell(DISABLED, "dim"))
            elif r.tied:
                cells.append(GridCell(f"{TIED} {PICKED}" if column == source else TIED, "dim"))
            elif column == source and not comp.holds(column, row):
                cells.append(GridCell("! not saved", "bold red"))  # a partial base, no pick yet
            elif column == source:
                if bad:
                    cells.append(GridCell(f"{PICKED} {bad}", "bold red reverse"))
                elif column == comp.base:
                    cells.append(GridCell(f"{PICKED} base{self._value(cell)}", "bold cyan" + colour))
                else:
                    cells.append(GridCell(f"{PICKED} picked{self._value(cell)}", "bold green" + colour))
            elif comp.holds(column, row):
                cells.append(GridCell(bad, "bold red") if bad else
                             GridCell(f" {HOLDS} {self._value(cell) or ' '}", "dim" + colour))
            else:
                cells.append(GridCell("–", "dim"))
        return cells

    def _group_cells(self, group: RowGroup) -> list[GridCell]:
        """A stack's header line: its name and size, then how many of its rows each checkpoint gives."""
        comp = self._shown
        folded = group.name in self.folded
        title = f"{FOLDED if folded else OPEN} {shown(group.name)} · {len(group.rows)} rows"
        sources = [comp.source_of(r.name) for r in comp.rows[group.first: group.last + 1]]
        cells = [GridCell(title, "bold")]
        for column in range(len(comp.checkpoints)):
            count = sources.count(column)
            if comp.incompatibility(column):
                cells.append(GridCell(DISABLED, "dim"))
            else:
                cells.append(GridCell(f"{PICKED} {count}" if count else "", "bold" if folded else "dim"))
        return cells

    def _value(self, cell) -> str:
        """`  2.48%`: a healthy cell's value of the metric where the cells show numbers, `  0.115 Δ2.48%`
        (weight RMS and Δ) where they show both; else ""."""
        if not self.numbers or cell is None or not cell.healthy:
            return ""
        return f"  {numbers(cell) if self.numbers > 1 else metric_text(cell, self.metric)}"

    # --- drawing --------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        if not self._rows or width <= 0:
            return Strip.blank(width, self.rich_style)
        at = y - HEADER_HEIGHT + round(self.scroll_y)
        entry = self._layout.entries[at] if y >= HEADER_HEIGHT and at < len(self._layout) else None
        if isinstance(entry, RowGroup):
            on = self._cursor.column if self._layout.folded_at(self._cursor.row) == entry else -1
            version: object = tuple(self._versions[entry.first: entry.last + 1])
            row: object = (entry, entry.name in self.folded)
        else:
            row = entry if entry is not None else (-1 - y if y < HEADER_HEIGHT else len(self._rows))
            version = self._versions[row] if 0 <= row < len(self._rows) else 0
            on = self._cursor.column if row in (self._cursor.row, -1, -2) else -1
        key = (row, version, on, round(self.scroll_x), width, self.has_focus)
        line = self._lines.get(key)
        if line is None:
            if len(self._lines) > 4 * (self.size.height + 8):  # another frame's: drop them
                self._lines.clear()
            line = self._lines[key] = self._draw_line(y, width)
        return line

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._lines.clear()  # another theme or focus: every line looks different

    def _draw_line(self, y: int, width: int) -> Strip:
        base = self.rich_style
        cursor_line = self._layout.lines[self._cursor.row] if self._layout.count else -1
        if y < HEADER_HEIGHT:
            cells = [h[y] for h in self._headers]
            row, line_style = -1, base + self.get_component_rich_style("grid--header")
        else:
            line = y - HEADER_HEIGHT + round(self.scroll_y)
            if line >= len(self._layout):
                return Strip.blank(width, base)
            entry = self._layout.entries[line]
            folded = isinstance(entry, RowGroup) and entry.name in self.folded
            # the cursor's row is drawn on its line: a folded stack's header, or the row's own
            row = self._cursor.row if line == cursor_line and (folded or entry == self._cursor.row) else -3
            if isinstance(entry, RowGroup):
                cells, line_style = self._group_cells(entry), base + self.get_component_rich_style("grid--header")
            else:
                cells, line_style, row = self._rows[entry], base, entry
        names = self._widths[0]
        name_style = line_style + (self.get_component_rich_style("grid--names") if row >= 0 else Style())
        segments = [self._segment(cells[0], names, name_style, row == self._cursor.row and self._cursor.column == 0)]
        left, room = round(self.scroll_x), max(0, width - names)
        first = max(0, bisect_right(self._starts, left) - 1)
        origin = self._starts[first] if self._starts else 0  # where the first column in view starts
        column, x, scrolled = first, origin, []
        underline = Style(underline=True)
        while column < len(self._starts) and x < left + room:
            w = self._widths[column + 1]
            cursor = row == self._cursor.row and self._cursor.column == column + 1
            style = line_style + (underline if row == -1 and self._cursor.column == column + 1 else Style())
            scrolled.append(self._segment(cells[column + 1], w, style, cursor))
            x += w
            column += 1
        strip = Strip(scrolled).crop(left - origin, left - origin + room)
        return Strip.join([Strip(segments), strip]).extend_cell_length(width, base).crop(0, width)

    def _segment(self, cell: GridCell, width: int, style: Style, cursor: bool) -> Segment:
        text = f" {cell.text}"
        text += " " * max(0, width - cell_len(text))
        look = style + Style.parse(cell.style) if cell.style else style
        if cursor:
            look += self.get_component_rich_style("grid--cursor")
        return Segment(text, look)

    def _scroll_to_cell(self, cell: Coordinate) -> None:
        region = self.scrollable_content_region
        body = max(1, region.height - HEADER_HEIGHT)
        y = self.scroll_y
        line = self._layout.lines[cell.row] if 0 <= cell.row < self._layout.count else cell.row
        if line < y:
            y = line
        elif line >= y + body:
            y = line - body + 1
        x = self.scroll_x
        if cell.column > 0 and self._starts:
            start = self._starts[cell.column - 1]
            end, room = start + self._widths[cell.column], max(1, region.width - self._widths[0])
            if start < x:
                x = start
            elif end > x + room:
                x = min(start, end - room)
        if (x, y) != (self.scroll_x, self.scroll_y):
            self.scroll_to(x=x, y=y, animate=False, immediate=True)

    def on_resize(self, _event: events.Resize) -> None:
        if self.draft is not None and self._numbers(self.draft) != self.numbers:
            self.show(self.draft, self.health, self.metric, self._health_version)  # numbers in or out
        self._scroll_to_cell(self._cursor)

    def _numbers(self, draft: RecipeDraft) -> int:
        """What the cells show of their values: 0 nothing (no statistics yet, or narrow: 80 columns), 1
        the metric's value where every checkpoint's column fits WIDE in the widget's width, 2 weight RMS
        and Δ where each fits WIDER (a 200-column terminal, a few checkpoints)."""
        if self.health is None or not draft.rows:
            return 0
        names = max(cell_len(r.name) for r in draft.rows) + 2 + len(INDENT)
        room = (self.size.width - names) // len(draft.checkpoints)
        return 2 if room >= WIDER else 1 if room >= WIDE else 0

    # --- keys and the mouse ----------------------------------------------------------------

    def action_cursor(self, rows: int, columns: int) -> None:
        row = self._layout.step(self._cursor.row, rows) if rows else self._cursor.row
        self.move_cursor(row=row, column=self._cursor.column + columns)

    def action_page(self, direction: int) -> None:
        page = max(1, self.scrollable_content_region.height - HEADER_HEIGHT - 1)
        self.move_cursor(row=self._layout.step(self._cursor.row, direction * page))

    def action_choose(self) -> None:
        if self._rows:
            self.post_message(self.Chosen(self, self._cursor))

    def cell_at(self, x: int, y: int) -> Coordinate | None:
        """The cell at (x, y) of the widget's content, None outside the rows."""
        if not self._rows or y < HEADER_HEIGHT:
            return None
        row = self._layout.row_at(y - HEADER_HEIGHT + round(self.scroll_y))
        if row is None:  # past the last line, or an open stack's header
            return None
        if x < self._widths[0]:
            return Coordinate(row, 0)
        at = x - self._widths[0] + round(self.scroll_x)
        column = bisect_right(self._starts, at)
        if column < 1 or at >= self._starts[column - 1] + self._widths[column]:
            return None
        return Coordinate(row, column)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and offset.x < self._widths[0] and self._header_clicked(offset.y):
            return
        cell = self.cell_at(offset.x, offset.y) if offset is not None else None
        if cell is None:
            return
        self.move_cursor(row=cell.row, column=cell.column or None)  # a row's name: that row, same column
        if cell.column > 0:  # one click on a checkpoint's cell picks it
            self.post_message(self.Chosen(self, cell))

    def _header_clicked(self, y: int) -> bool:
        """A click on a stack header's name folds or unfolds that stack."""
        line = y - HEADER_HEIGHT + round(self.scroll_y)
        if y < HEADER_HEIGHT or not 0 <= line < len(self._layout):
            return False
        entry = self._layout.entries[line]
        if not isinstance(entry, RowGroup):
            return False
        if self._layout.stack_of(self._cursor.row) != entry:
            self.move_cursor(row=entry.first)
        self.toggle_fold()
        return True
