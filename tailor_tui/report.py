"""Headless progress: live bars on a terminal, plain periodic lines in logs.

Slurm and CI logs are not terminals; there, each task prints a line like
`rank 3: 41% 1.2 GiB/2.9 GiB written` every few seconds or 10%, whichever comes first.
Each counts one thing, and says which: bytes written (composing, exporting), or compared (verifying).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tailor_tui.events import TaskFinished, TaskProgressed
from tailor_tui.units import size, throughput


class LineReporter:
    """Plain lines, for logs."""

    def __init__(self, out: TextIO = sys.stderr, every_seconds: float = 5.0, every_fraction: float = 0.1,
                 prefix: str = "", unit: str = "written"):
        self.out, self.every_seconds, self.every_fraction = out, every_seconds, every_fraction
        self.unit = unit
        self.prefix = prefix  # `[process 3] ` when several processes share a log
        self._last: dict[str, tuple[float, float]] = {}

    def __call__(self, event) -> None:
        if isinstance(event, TaskFinished):
            print(f"{self.prefix}{event.task}: done, {size(event.total)} {self.unit}", file=self.out, flush=True)
        elif isinstance(event, TaskProgressed):
            now = time.monotonic()
            when, fraction = self._last.get(event.task, (0.0, -1.0))
            due = now - when >= self.every_seconds or event.fraction - fraction >= self.every_fraction
            if due and event.done < event.total:
                self._last[event.task] = (now, event.fraction)
                print(
                    f"{self.prefix}{event.task}: {event.fraction:.0%} {size(event.done)}/{size(event.total)} {self.unit}",
                    file=self.out,
                    flush=True,
                )


class BarReporter:
    """One live bar per task, redrawn in place, for terminals."""

    WIDTH = 30

    def __init__(self, out: TextIO = sys.stderr, refresh: float = 0.1, tasks=(), unit: str = "written"):
        self.out, self.refresh, self.unit = out, refresh, unit
        # Tasks known up front get their bar at once, so every rank shows before it starts.
        self._tasks: dict[str, TaskProgressed] = {name: TaskProgressed(name, 0, total) for name, total in tasks}
        self._drawn = 0
        self._last = 0.0
        self._started = time.monotonic()

    def __call__(self, event) -> None:
        if isinstance(event, (TaskProgressed, TaskFinished)):
            done = event.total if isinstance(event, TaskFinished) else event.done
            self._tasks[event.task] = TaskProgressed(event.task, done, event.total)
        now = time.monotonic()
        if now - self._last >= self.refresh or isinstance(event, TaskFinished):
            self._last = now
            self.draw()

    def _line(self, label: str, done: int, total: int, width: int) -> str:
        fraction = min(1.0, done / total) if total else 1.0
        filled = int(fraction * self.WIDTH)
        bar = "█" * filled + "░" * (self.WIDTH - filled)
        return f"{label:<{width}} {bar} {fraction:>4.0%}  {size(done)}/{size(total)}"

    def draw(self) -> None:
        if not self._tasks:
            return
        width = max(len(t) for t in self._tasks) if self._tasks else 6
        width = max(width, len("total"))
        lines = [self._line(t.task, t.done, t.total, width) for t in self._tasks.values()]
        done = sum(t.done for t in self._tasks.values())
        total = sum(t.total for t in self._tasks.values())
        rate, eta = throughput(done, total, time.monotonic() - self._started)
        lines.append(self._line("total", done, total, width) + f" {self.unit}  {size(int(rate))}/s  ETA {eta:.0f}s")
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
        self.out.flush()
        self._drawn = len(lines)

    def close(self) -> None:
        self.draw()


def reporter_for(stream: TextIO, mode: str = "auto", tasks=(), unit: str = "written"):
    """Bars on a terminal (or when asked), lines otherwise; `tasks` is [(name, total bytes)]."""
    if mode == "bars" or (mode == "auto" and stream.isatty()):
        return BarReporter(stream, tasks=tasks, unit=unit)
    return LineReporter(stream, unit=unit)
