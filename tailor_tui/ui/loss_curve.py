"""The run's training curve (`LossCurve`): the loss over steps (its grad norm too, where logged), each checkpoint's
step marked, the cursor's highlighted. A widget that owns what it shows (`show`: plain data, a TrainingCurve read by
the scan's worker, `healing.training_curve`, and the cursor's step) and draws it in a thread worker."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import work
from textual.app import RenderResult
from textual.message import Message
from textual_plotext import Plot, PlotextPlot

from tailor_tui.health.healing import TrainingCurve
from tailor_tui.ui.describe import curve_title, no_curve

LOSS, GRAD, MARK, CURSOR = "cyan", "gray", "cyan", "orange"  # the curve's colours (Plotext's names)
TICK_ROOM = 8  # columns a step's label on the curve's axis takes, at least
AXES_ROOM = 14  # columns the y axes' labels take, about
FRAME_ROWS = 5  # rows of the figure around its plot: the title, the frame's top and bottom, the steps, the axes' names
MAX_Y_TICKS = 7  # labels on a y axis, at most


def figure(curve: TrainingCurve, cursor: int | None, width: int, height: int, theme: str) -> str:
    """The curve drawn by Plotext (ANSI text), `width` × `height`: each line in as many points as
    the width shows (braille: two a column), every checkpoint's step a tick on the axis (a label
    where there is room) and a ○ on the curve (where they are not too many to tell apart), the
    cursor's checkpoint a line across and a ● (its numbers in the title). Tens of milliseconds
    for a long log: the widget draws it in a thread."""
    plt = Plot()
    # exactly this size, never clipped to the process's terminal (plotext's public `limitsize` sets its module's figure)
    plt._limit_size(False, False)  # type: ignore[attr-defined]
    plt.plotsize(width, height)
    plt.theme(theme)
    marks = checkpoint_marks(curve)
    circles = 0 < len(marks) <= (width - AXES_ROOM) // 3
    plt.title(curve_title(curve, cursor, width, circles))
    plt.xlabel("step")
    plt.ylabel("loss")
    line = curve.thinned(2 * max(1, width - AXES_ROOM))
    if line.grad_norms:
        plt.ylabel("grad norm (grey)", "right")  # positional: the stub names it `xside`
        plt.plot(list(line.grad_steps), list(line.grad_norms), marker="braille", color=GRAD, yside="right")
    plt.plot(list(line.steps), list(line.losses), marker="braille", color=LOSS)
    for values, side in ((line.losses, "left"), (line.grad_norms, "right")):
        if (found := y_ticks(values, height - FRAME_ROWS)) is not None:
            ticks, labels = found
            axes: Any = plt  # (its stub types ylim's and yticks' `yside` as a number)
            axes.ylim(min(values), max(values), yside=side)  # (the ticks' rows: the lowest on the bottom row)
            axes.yticks(ticks, labels, yside=side)
    if marks:
        if circles:
            plt.scatter([s for s, _ in marks], [v for _, v in marks], marker="○", color=MARK)
        ticks = [float(s) for s, _ in marks][:: -(-len(marks) // max(1, (width - AXES_ROOM) // 2))]
        every = -(-len(ticks) // max(1, (width - AXES_ROOM) // TICK_ROOM))
        plt.xticks(ticks, [f"{s:.0f}" if i % every == 0 else "" for i, s in enumerate(ticks)])
    if cursor is not None and (loss := curve.loss_at(cursor)) is not None:
        plt.vline(cursor, CURSOR)
        plt.scatter([cursor], [loss], marker="●", color=CURSOR)
    return plt.build()


def y_ticks(values, rows: int) -> tuple[list[float], list[str]] | None:
    """Ticks of a y axis `rows` text rows tall spanning `values` (their lowest to their highest, the axis' limits),
    each on a row of its own, evenly: on every row where they fit (MAX_Y_TICKS), else every few rows from the lowest;
    labelled with the decimals that tell neighbours apart. None: nothing to span."""
    if rows < 2 or not values or not (hi := max(values)) > (lo := min(values)) or not math.isfinite(hi - lo):
        return None
    fewest = -(-(rows - 1) // (MAX_Y_TICKS - 1))  # rows from one tick to the next, at least
    every = next((e for e in range(fewest, fewest + 3) if (rows - 1) % e == 0), fewest)  # the top labelled too
    per_row = (hi - lo) / (rows - 1)
    ticks = [lo + r * per_row for r in range(0, rows - 1, every)] + ([hi] if (rows - 1) % every == 0 else [])
    decimals = min(4, max(0, 1 - math.floor(math.log10(every * per_row))))
    return ticks, [f"{t:.{decimals}f}" for t in ticks]


def checkpoint_marks(curve: TrainingCurve) -> list[tuple[int, float]]:
    """(step, loss there) of every checkpoint whose step the log reaches."""
    return [(step, loss) for step in sorted(set(curve.checkpoint_steps)) if (loss := curve.loss_at(step)) is not None]


class LossCurve(PlotextPlot):
    """The run's training loss over steps (its grad norm too, on the right axis, where logged), each
    checkpoint's step marked, the cursor's checkpoint highlighted (`figure`). It takes plain data
    (`show`: a TrainingCurve and the cursor's step) and draws in a thread worker, never on the event
    loop: it shows the newest figure drawn until the one asked for is ready. A run with no training
    log: a line saying so."""

    @dataclass(eq=False)
    class Drawn(Message):
        text: Text
        key: tuple

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.curve: TrainingCurve | None = None
        self.cursor_step: int | None = None
        self.figure: Text | None = None
        self.drawn: tuple | None = None  # what `figure` shows: (curve, cursor step, width, height, theme)
        self.drawing: tuple | None = None  # what the worker draws now

    def show(self, curve: TrainingCurve | None, cursor_step: int | None) -> None:
        if curve is not self.curve or cursor_step != self.cursor_step:
            self.curve, self.cursor_step = curve, cursor_step
            self.set_class(curve is not None and not curve.logged, "no-log")  # its height: the line's
            self.refresh()

    @property
    def wanted(self) -> tuple:
        """What the figure should show now."""
        return (self.curve, self.cursor_step, self.size.width, self.size.height,
                self._get_plotext_theme_name(self.app.theme))

    @property
    def up_to_date(self) -> bool:
        """Whether what shows is what was asked for (hidden, nothing is drawn: nothing to wait for)."""
        return (self.curve is None or not self.curve.logged or not self.display or not self.size.area
                or self.drawn == self.wanted)

    @property
    def marks(self) -> list[tuple[int, float]]:
        return checkpoint_marks(self.curve) if self.curve is not None else []

    def render(self) -> RenderResult:
        curve = self.curve
        if curve is None:
            return Text("")
        if not curve.logged:
            return Text(no_curve(curve), style="italic")
        wanted = self.wanted
        if wanted != self.drawn and wanted != self.drawing and self.size.width and self.size.height:
            self.drawing = wanted
            self.draw_worker(wanted)
        return self.figure or Text("drawing the loss curve …", style="italic")

    @work(thread=True, exclusive=True, group="curve")
    def draw_worker(self, key: tuple) -> None:
        curve, cursor, width, height, theme = key
        self.post_message(self.Drawn(Text.from_ansi(figure(curve, cursor, width, height, theme)), key))

    def on_loss_curve_drawn(self, message: Drawn) -> None:
        message.stop()
        if self.drawing == message.key:
            self.drawing = None
        self.figure, self.drawn = message.text, message.key
        self.refresh()
