"""The grid's lines: a multimodal model's rows under a header line per stack, each stack foldable.

Pure bookkeeping (no Textual): which row or stack header each line of the grid shows, which line
shows a row (a folded stack's rows: its header), and where a move of the cursor by lines lands. The
cursor is always on a row; on a folded stack it stands on the stack's header, which stands for
every row of the stack. A model of one stack (every decoder-only model) has no headers: line i is
row i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class RowGroup:
    """A group of consecutive rows (`vision`: rows first..last)."""

    name: str
    first: int
    last: int

    @property
    def rows(self) -> range:
        return range(self.first, self.last + 1)


def groups_of(groups: Iterable[str]) -> tuple[RowGroup, ...]:
    """The stacks of rows whose groups are `groups` (in the rows' order); () if they have none."""
    groups = list(groups)
    if not any(groups):
        return ()
    stacks: list[RowGroup] = []
    for i, group in enumerate(groups):
        if stacks and stacks[-1].name == group:
            stacks[-1] = RowGroup(group, stacks[-1].first, i)
        else:
            stacks.append(RowGroup(group, i, i))
    return tuple(stacks)


class GridLines:
    """The lines of rows grouped in `stacks`, with the stacks named in `folded` folded."""

    def __init__(self, count: int, stacks: tuple[RowGroup, ...] = (), folded: Iterable[str] = ()):
        self.count, self.stacks = count, stacks
        self.folded = {s.name for s in stacks} & set(folded)
        self.entries: list[int | RowGroup] = []  # per line: a row's index, or a stack's header
        self.lines: list[int] = [0] * count  # per row: the line showing it
        for stack in stacks or (None,):
            rows = range(count) if stack is None else stack.rows
            if stack is not None:
                self.entries.append(stack)
            for row in rows:
                self.lines[row] = len(self.entries) - 1 if stack is not None and stack.name in self.folded \
                    else len(self.entries)
                if stack is None or stack.name not in self.folded:
                    self.entries.append(row)

    def __len__(self) -> int:
        return len(self.entries)

    def stack_of(self, row: int) -> RowGroup | None:
        return next((s for s in self.stacks if s.first <= row <= s.last), None)

    def folded_at(self, row: int) -> RowGroup | None:
        """The folded stack whose header stands for `row`, or None."""
        stack = self.stack_of(row)
        return stack if stack is not None and stack.name in self.folded else None

    def step(self, row: int, lines: int) -> int:
        """The row `lines` lines below (above, if negative) `row`'s line; the headers of open stacks
        are passed over (they stand for no row of their own)."""
        if not self.count:
            return row
        direction = -1 if lines < 0 else 1
        target = max(0, min(len(self.entries) - 1, self.lines[row] + lines))
        onward = range(target, len(self.entries) if direction > 0 else -1, direction)
        back = range(target, -1 if direction > 0 else len(self.entries), -direction)
        found = next((r for line in (*onward, *back) if (r := self.row_at(line)) is not None), None)
        return row if found is None else found

    def row_at(self, line: int) -> int | None:
        """The row `line` shows: a row's own line, or a folded stack's header (its first row)."""
        if not 0 <= line < len(self.entries):
            return None
        entry = self.entries[line]
        if isinstance(entry, RowGroup):
            return entry.first if entry.name in self.folded else None
        return entry
