"""Headless progress: live bars on a terminal, plain periodic lines in logs.

Slurm and CI logs are not terminals; there, each task prints a line like
`rank 3: 41% 1.2 GiB/2.9 GiB written` every few seconds or 10%, whichever comes first.
Each counts one thing, and says which: bytes written (composing, exporting), or compared (verifying).

A 512-GPU run has 512 rank files, each a task: a line or a bar for each would flood a log with a
thousand lines and draw more bars than a terminal has rows. Beyond `FEW` tasks, both summarise (one
`Tally` of every task, one way of wording it, `Tally.line`): logs get one line for all the tasks
(`total: 41% 1.2 GiB/2.9 GiB written, 37 of 512 tasks done, 2 in progress, …`) at the same cadence,
and one when all are done; a terminal shows bars only for the tasks in progress, as many as fit.
"""

from __future__ import annotations

import shutil
import sys
import time
from itertools import islice
from typing import Callable, Iterable, TextIO

from tailor_tui.events import TaskFinished, TaskProgressed, written_and_shared
from tailor_tui.units import shown, size, throughput

FEW = 8  # up to this many tasks, each has its own lines (or bar); beyond, they are summed up


class Tally:
    """Every task's bytes done, and which tasks are waiting, in progress and done: what a summary says.

    Tasks known up front (`tasks`: [(name, total bytes)]) wait until their first event; others are
    counted from their first event on. A task is done at its `TaskFinished` or once its progress
    reaches its total (the TUI is told only progress). Each event costs O(1), whatever the number of
    tasks: a 512-rank composition reports every rank ten times a second.
    """

    def __init__(self, tasks: Iterable[tuple[str, int]] = ()) -> None:
        self.totals: dict[str, int] = dict(tasks)
        self.done: dict[str, int] = dict.fromkeys(self.totals, 0)
        self.known = bool(self.totals)  # the whole set is known: percent, `of N`, waiting and ETA make sense
        self.running: dict[str, None] = {}  # started, not done: in the order they started
        self.ended: set[str] = set()
        self.bytes_done, self.bytes_total = 0, sum(self.totals.values())
        self.shared, self.shared_how = 0, ""  # of the bytes done, those that share the base's blocks (a clone's)

    def add(self, event) -> str | None:
        """Counts a progress event: the name of its task, None for any other event."""
        if isinstance(event, TaskFinished):
            name, done, total = event.task, event.total, event.total
            self.shared += event.shared
            self.shared_how = self.shared_how or event.shared_how
        elif isinstance(event, TaskProgressed):
            name, done, total = event.task, event.done, event.total
        else:
            return None
        if name in self.ended:
            return name  # its TaskFinished after its last progress: nothing new
        self.bytes_total += total - self.totals.get(name, 0)
        self.bytes_done += done - self.done.get(name, 0)
        self.totals[name], self.done[name] = total, done
        if isinstance(event, TaskFinished) or done >= total:
            self.ended.add(name)
            self.running.pop(name, None)
        else:
            self.running.setdefault(name)
        return name

    def finish_all(self) -> None:
        """Every task done (the work said it is finished)."""
        for name, total in list(self.totals.items()):
            self.add(TaskFinished(name, total))

    @property
    def finished(self) -> int:
        return len(self.ended)

    @property
    def waiting(self) -> int:
        return len(self.totals) - len(self.ended) - len(self.running)

    @property
    def all_done(self) -> bool:
        return bool(self.totals) and len(self.ended) == len(self.totals)

    @property
    def fraction(self) -> float:
        return min(1.0, self.bytes_done / self.bytes_total) if self.bytes_total else 1.0

    def line(self, label: str, unit: str, elapsed: float, *, final: bool = False) -> str:
        """All the tasks in one line (of logs): the one wording of the summary, wherever it is printed.
        `final`: the work is over (tasks not known up front: those seen are all there were)."""
        rate, eta = throughput(self.bytes_done, self.bytes_total, elapsed)
        speed = f"{size(int(rate))}/s"
        n = len(self.totals)
        if self.all_done and (self.known or final):
            amount = written_and_shared(self.bytes_done, self.shared, self.shared_how, unit=unit)
            return f"{label}: done, {amount} by {n} tasks in {elapsed:.1f}s, {speed}"
        if not self.known:  # a process's own tasks, seen as they start: how many there will be is unknown
            return (f"{label}: {size(self.bytes_done)} {unit}, {self.finished} tasks done, "
                    f"{len(self.running)} in progress, {speed}")
        return (f"{label}: {self.fraction:.0%} {size(self.bytes_done)}/{size(self.bytes_total)} {unit}, "
                f"{self.finished} of {n} tasks done, {len(self.running)} in progress, {speed}"
                + (f", ETA {eta:.0f}s" if rate > 0 else ""))


class LineReporter:
    """Plain lines, for logs: each task's own while they are few, one line for them all once many.

    `each` (each task's lines) and `summary` (the lines for them all) are decided by the number of
    tasks when left None: `each` while there are at most FEW (known up front, or seen so far when
    none are given: a process's own share of a job), `summary` when not `each`. Summarising alone,
    it also prints one final line once every task is done (or at `close`, if it never knew them all).
    """

    def __init__(self, out: TextIO = sys.stderr, every_seconds: float = 5.0, every_fraction: float = 0.1,
                 prefix: str = "", unit: str = "written", *, tasks=(), label: str = "total",
                 each: bool | None = None, summary: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.out, self.every_seconds, self.every_fraction = out, every_seconds, every_fraction
        self.unit, self.label = unit, label
        self.prefix = prefix  # `[process 3] ` when several processes share a log
        self.each, self.summary = each, summary
        self.clock = clock
        self.tally = Tally(tasks)
        self._started = clock()
        self._last: dict[str, tuple[float, float]] = {}
        self._summed = (float("-inf"), -1.0)  # (when, fraction) of the last summary line
        self._closed = False  # the final summary line is printed

    def _each(self) -> bool:
        return self.each if self.each is not None else len(self.tally.totals) <= FEW

    def _summarises(self) -> bool:
        return self.summary if self.summary is not None else not self._each()

    def _print(self, text: str) -> None:
        print(shown(f"{self.prefix}{text}"), file=self.out, flush=True)

    def __call__(self, event) -> None:
        if self.tally.add(event) is None:
            return
        now = self.clock()
        if self._each():
            self._task_line(event, now)
        if not self._summarises() or self._closed:
            return
        if self.tally.all_done and self.tally.known and not self._each():
            if isinstance(event, TaskFinished):  # (a task's last: what it shared is known)
                self.close()
            return
        when, fraction = self._summed
        due = (now - when >= self.every_seconds
               or (self.tally.known and self.tally.fraction - fraction >= self.every_fraction))
        if due and not (self.tally.all_done and self.tally.known):
            self._summed = (now, self.tally.fraction)
            self._print(self.tally.line(self.label, self.unit, now - self._started))

    def _task_line(self, event, now: float) -> None:
        if isinstance(event, TaskFinished):  # a clone's: what it wrote, and what shares the base's blocks
            self._print(f"{event.task}: done, {written_and_shared(event.total, event.shared, event.shared_how, unit=self.unit)}")
        elif isinstance(event, TaskProgressed):
            when, fraction = self._last.get(event.task, (0.0, -1.0))
            due = now - when >= self.every_seconds or event.fraction - fraction >= self.every_fraction
            if due and event.done < event.total:
                self._last[event.task] = (now, event.fraction)
                self._print(f"{event.task}: {event.fraction:.0%} {size(event.done)}/{size(event.total)} {self.unit}")

    def close(self) -> None:
        """The last summary line (once), when summarising in place of each task's lines."""
        if self._closed or self._each() or not self._summarises() or not self.tally.totals:
            return
        self._closed = True
        self._print(self.tally.line(self.label, self.unit, self.clock() - self._started, final=True))


class BarReporter:
    """Live bars redrawn in place, for terminals: one per task while they are few; once many, one
    per task in progress (as many as fit the terminal), a line for the others and the total.

    Each redraw moves the cursor up by the number of lines drawn last time, so the block is never
    taller than the terminal (it could not go back above its top) and no line is wider (a wrapped
    line would take two rows)."""

    WIDTH, MIN_BAR = 30, 8  # a bar's cells: at most, and at least on a narrow terminal

    def __init__(self, out: TextIO = sys.stderr, refresh: float = 0.1, tasks=(), unit: str = "written", *,
                 clock: Callable[[], float] = time.monotonic,
                 terminal: Callable[[], tuple[int, int]] = shutil.get_terminal_size):
        self.out, self.refresh, self.unit = out, refresh, unit
        self.clock, self.terminal = clock, terminal  # terminal(): (columns, lines), as shutil's
        # Tasks known up front get their bar at once, so every rank shows before it starts.
        self.tally = Tally(tasks)
        self._width = max((len(name) for name in self.tally.totals), default=0)
        self._drawn = 0
        self._last = float("-inf")
        self._started = clock()
        self._columns = 80  # the terminal's, as of the last draw

    def __call__(self, event) -> None:
        name = self.tally.add(event)
        if name is not None:
            self._width = max(self._width, len(name))
        now = self.clock()
        # few: every finish is shown at once; many: at most every `refresh`, and the end
        due = isinstance(event, TaskFinished) and (len(self.tally.totals) <= FEW or self.tally.all_done)
        if now - self._last >= self.refresh or due:
            self._last = now
            self.draw()

    def _line(self, label: str, done: int, total: int, width: int, suffix: str = "") -> str:
        """`label ████░░ 41%  1.2 GiB/2.9 GiB{suffix}`, its bar narrowed (down to MIN_BAR) to fit the
        terminal's columns."""
        fraction = min(1.0, done / total) if total else 1.0
        text = f" {fraction:>4.0%}  {size(done)}/{size(total)}{suffix}"
        bar_width = max(self.MIN_BAR, min(self.WIDTH, self._columns - 2 - width - len(text)))
        filled = int(fraction * bar_width)
        return f"{label:<{width}} {'█' * filled}{'░' * (bar_width - filled)}{text}"

    def _speed(self) -> str:
        rate, eta = throughput(self.tally.bytes_done, self.tally.bytes_total, self.clock() - self._started)
        return f"{size(int(rate))}/s  ETA {eta:.0f}s"

    def _total(self, width: int, speed: bool = True) -> str:
        t = self.tally
        return self._line("total", t.bytes_done, t.bytes_total, width,
                          f" {self.unit}" + (f"  {self._speed()}" if speed else ""))

    def _few(self) -> list[str]:
        """Today's block for a handful of tasks: every task's bar, then the total."""
        t, width = self.tally, max(self._width, len("total"))
        return [*(self._line(name, t.done[name], total, width) for name, total in t.totals.items()), self._total(width)]

    def _many(self, columns: int, rows: int) -> list[str]:
        """The tasks in progress that fit in `rows - 2` (a row for the cursor, one to spare), a line
        for the rest with the throughput (the total's line would not fit 80 columns with it), the
        total; each line cut to the terminal's width."""
        t, width = self.tally, max(self._width, len("total"))
        room = max(1, rows - 2)
        if room < 2:
            lines = [self._total(width)]
        else:
            drawn = list(islice(t.running, room - 2))
            lines = [self._line(name, t.done[name], t.totals[name], width) for name in drawn]
            more = len(t.running) - len(drawn)
            lines.append(f"… {t.finished} done, " + (f"{more} more in progress, " if more else "")
                         + f"{t.waiting} waiting  {self._speed()}")
            lines.append(self._total(width, speed=False))
        return lines

    def draw(self) -> None:
        if not self.tally.totals:
            return
        columns, rows = self.terminal()
        self._columns = columns
        lines = self._few() if len(self.tally.totals) <= FEW else self._many(columns, rows)
        # no line as wide as the terminal (a wrapped line takes two rows: the next redraw would go up too
        # few and leave stale lines); what was below a shrunk block goes
        lines = [shown(line)[:max(1, columns - 1)] for line in lines]
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines) + "\x1b[J")
        self.out.flush()
        self._drawn = len(lines)

    def close(self) -> None:
        self.draw()


def reporter_for(stream: TextIO, mode: str = "auto", tasks=(), unit: str = "written"):
    """Bars on a terminal (or when asked), lines otherwise; `tasks` is [(name, total bytes)]."""
    if mode == "bars" or (mode == "auto" and stream.isatty()):
        return BarReporter(stream, tasks=tasks, unit=unit)
    return LineReporter(stream, unit=unit, tasks=tasks)
