"""Row health for people: the `--stats` table, the `--heal` summary, progress lines."""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import TextIO

from tailor_tui.checkpoints.checkpoint import distinct_names
from tailor_tui.events import TaskFinished, TaskProgressed
from tailor_tui.health.healing import Cell, Healing, Health, numbers, why_unhealthy
from tailor_tui.health.stats_run import CellsComputed, StatsPlanned
from tailor_tui.units import shown, size, throughput

OUTLIER = 3.0  # a rel_change this many times the row's median is marked


def cell_text(cell: Cell | None) -> str:
    """`0.0213 Δ0.41%` (`healing.numbers`), `·` for a row not saved there (a partial checkpoint)."""
    return "·" if cell is None else numbers(cell)


def outliers(health: Health, row: str) -> set[int]:
    """Columns whose rel_change stands out in `row` (OUTLIER × the row's median)."""
    values = {i: c.rel_change for i, c in health.row_cells(row).items() if c.rel_change is not None}
    if len(values) < 3:
        return set()
    median = statistics.median(values.values())
    return {i for i, v in values.items() if median > 0 and v > OUTLIER * median}


def table(health: Health) -> list[str]:
    """One line per row; a column per checkpoint; unhealthy cells ✗, outlying changes ▲."""
    names = [shown(name) for name in distinct_names([c.path for c in health.checkpoints])]  # measured as printed
    rows = health.rows()
    label = {row: shown(row) for row in rows}
    texts = {}
    for row in rows:
        marked = outliers(health, row)
        for i in range(len(names)):
            text = cell_text(health.cell(row, i))
            texts[row, i] = text + (" ▲" if i in marked else "")
    width = [max([len(names[i]), *(len(texts[r, i]) for r in rows)]) for i in range(len(names))]
    first = max([len("row"), *(len(label[r]) for r in rows)])

    def line(label: str, cells: list[str]) -> str:
        return "  ".join([f"{label:<{first}}", *(f"{c:>{w}}" for c, w in zip(cells, width))]).rstrip()

    losses = [health.logs.get(i) for i in range(len(names))]
    out = [line("row", names)]
    if any(log and log.loss is not None for log in losses):
        out.append(line("loss", ["—" if not log or log.loss is None else f"{log.loss:.4g}" for log in losses]))
    groups = {r.name: r.group for c in health.checkpoints for r in c.rows}
    last = ""
    for row in rows:
        group = groups.get(row, "")
        if group and group != last:  # a multimodal model's stack: a line before its first row
            out.append(f"[{shown(group)}]")
        last = group
        out.append(line(label[row], [texts[row, i] for i in range(len(names))]))
    bad = sum(1 for c in health.cells.values() if not c.healthy)
    out.append("")
    out.append("cells: fp32 weight RMS and Δ (change since the previous checkpoint holding the row); "
               "✗ unhealthy (NaN/Inf, CRC failure), ▲ outlying change, · not saved")
    out.append(f"{bad} unhealthy cell(s)" if bad else "every cell is healthy")
    return out


def healing_lines(health: Health, healing: Healing, base: int) -> list[str]:
    lines = []
    for row, column in healing.picks.items():
        if column != base:
            why = healing.reasons.get(row, f"{health.checkpoints[base].name} did not save it")
            lines.append(f"{row} <- {health.checkpoints[column].name} ({why})")
    for row in healing.hopeless:
        cells = [f"{health.checkpoints[i].name}: {why_unhealthy(c)}" for i, c in health.row_cells(row).items()]
        lines.append(f"{row}: no healthy checkpoint ({'; '.join(cells) or 'no checkpoint holds it'})")
    return lines


class StatsProgress:
    """Progress of computing statistics, on stderr: one line redrawn on a terminal, a line every
    few seconds and one per finished checkpoint in logs."""

    def __init__(self, out: TextIO = sys.stderr, live: bool | None = None):
        self.out = out
        self.live = out.isatty() if live is None else live
        self.total = self.done = 0
        self.peak_rss = 0  # bytes: the largest of the statistics workers'
        self._tasks: dict[str, int] = {}
        self._last, self._started = 0.0, time.monotonic()

    def __call__(self, event) -> None:
        if isinstance(event, StatsPlanned):
            self.total = event.to_read
            cached = f", {event.cached_ranks} cached" if event.cached_ranks else ""
            self._say(f"statistics of {event.checkpoints} checkpoint(s): {event.ranks} {event.files}{cached}, "
                      f"{size(event.to_read)} to read")
        elif isinstance(event, (TaskProgressed, TaskFinished)):
            if isinstance(event, TaskFinished):
                self.peak_rss = max(self.peak_rss, event.peak_rss)
            self._tasks[event.task] = event.total if isinstance(event, TaskFinished) else event.done
            self.done = sum(self._tasks.values())
            now = time.monotonic()
            if self.done and now - self._last >= (0.1 if self.live else 5.0):
                self._last = now
                rate, eta = throughput(self.done, self.total, now - self._started)
                text = (f"statistics: {self.done / max(self.total, 1):.0%} {size(self.done)}/{size(self.total)} "
                        f"{size(rate)}/s ETA {math.ceil(eta)}s")
                if self.live:
                    self.out.write(f"\r\x1b[2K{text}")
                    self.out.flush()
                else:
                    self._say(text)
        elif isinstance(event, CellsComputed) and not self.live:
            bad = sum(1 for c in event.cells.values() if not c.healthy)
            self._say(f"{event.name}: statistics of {len(event.cells)} row(s), {bad} unhealthy")

    def close(self) -> None:
        if self.live:
            self.out.write("\r\x1b[2K")
            self.out.flush()

    def _say(self, text: str) -> None:
        if self.live:
            self.out.write("\r\x1b[2K")
        print(shown(text), file=self.out, flush=True)


