"""The side panel beside the grid (`HealthPane`): it owns the run's health as the composer shows it, the row
statistics (computed by its thread worker, newest checkpoint first, from the cache where it has them), their
progress, the heatmap's metric and the training curve, and holds the details panel and the curve's widget.

The screen watches what it shows (`version`: new cells arrived or the statistics ended; `status`; `metric`) and
redraws the grid, the title and the details from it; the statistics themselves come from the headless core
(`stats_run`, `dcp_stats`), the curve's points from the scan's worker (`healing.training_curve`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from textual import work
from textual.containers import Vertical
from textual.reactive import var

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint
from tailor_tui.errors import Cancelled, TailorError
from tailor_tui.events import TaskFinished, TaskOptions, TaskProgressed
from tailor_tui.health.dcp_stats import dcp_health
from tailor_tui.health.healing import Health, TrainingCurve, TrainingLog
from tailor_tui.health.stats_run import CellsComputed, StatsPlanned, compute_health
from tailor_tui.ui.describe import next_metric
from tailor_tui.ui.loss_curve import LossCurve
from tailor_tui.ui.messages import CellsArrived, HealthEnded, HealthProgressed

if TYPE_CHECKING:
    from tailor_tui.checkpoints.checkpoint import Checkpoint

REDRAW_AFTER = 0.25  # seconds: checkpoints' cells arrive in bursts, redrawn once for a burst
PROGRESS_EVERY = 0.2  # seconds between two progress messages of the statistics worker


class HealthPane(Vertical):
    """The run's row statistics, their progress (`status`: None once complete), the heatmap's `metric` and the
    training curve; `version` moves on whenever the statistics shown change."""

    version: var[int] = var(0)
    status: var[str | None] = var("statistics: starting")
    metric: var[str] = var("rel_change")

    def __init__(self, *children, workers: int | None = None, id: str | None = None) -> None:
        super().__init__(*children, id=id)
        self.processes = workers  # processes of the statistics (None: as many as fit)
        self.health: Health | None = None
        self.curve: TrainingCurve | None = None
        self.cancel = threading.Event()  # the statistics' workers stop between chunks once set
        self._redraw_due = False

    def start(self, checkpoints: tuple[Checkpoint, ...], logs: dict[int, TrainingLog], curve: TrainingCurve) -> None:
        """The scan found `checkpoints` (their training `logs`, the run's `curve`): their statistics computed now."""
        self.health = Health(checkpoints, logs=logs)
        self.curve = curve
        self._statistics(checkpoints)

    def nothing_to_compute(self) -> None:
        """The scan failed or found no checkpoint: no statistics to wait for."""
        self.status = None

    def show_curve(self, step: int | None) -> None:
        """The curve, its cursor on `step` (None: no checkpoint under the grid's cursor)."""
        self.query_one(LossCurve).show(self.curve, step)

    def next_metric(self) -> str:
        self.metric = next_metric(self.metric)
        return self.metric

    @work(thread=True, exclusive=True, group="stats")
    def _statistics(self, checkpoints: tuple[Checkpoint, ...]) -> None:
        """Statistics of every cell, newest checkpoint first; the grid stays usable throughout (this pane only gets
        messages)."""
        progress: dict[str, Any] = {"total": 0, "tasks": {}, "last": 0.0}

        def emit(event: object) -> None:
            if isinstance(event, CellsComputed):
                self.post_message(CellsArrived(event.column, event.cells))
            elif isinstance(event, StatsPlanned):
                progress["total"] = event.to_read
            elif isinstance(event, (TaskProgressed, TaskFinished)):
                progress["tasks"][event.task] = event.done if isinstance(event, TaskProgressed) else event.total
                now = time.monotonic()
                if now - progress["last"] > PROGRESS_EVERY:
                    progress["last"] = now
                    self.post_message(HealthProgressed(sum(progress["tasks"].values()), progress["total"]))

        try:
            if isinstance(checkpoints[0], DcpCheckpoint):  # an FSDP2 run: one process
                dcp_health(checkpoints, emit=emit, cancelled=self.cancel.is_set, cache=cache_dir())
            else:
                compute_health(checkpoints, workers=self.processes, emit=emit, cancel=self.cancel, cache=cache_dir(),
                               options=TaskOptions())
        except Cancelled:
            return
        except TailorError as exc:
            self.post_message(HealthEnded(str(exc)))
        except Exception as exc:  # a bug: the grid goes on without statistics
            self.post_message(HealthEnded(f"internal error: {type(exc).__name__}: {exc}"))
        else:
            self.post_message(HealthEnded())

    def on_health_progressed(self, message: HealthProgressed) -> None:
        message.stop()
        if self.status is not None and message.total:
            self.status = f"statistics {message.done / message.total:.0%}"

    def on_cells_arrived(self, message: CellsArrived) -> None:
        message.stop()
        if self.health is None:
            return
        self.health.add(message.column, message.cells)
        if not self._redraw_due:
            self._redraw_due = True
            self.set_timer(REDRAW_AFTER, self._redraw)

    def _redraw(self) -> None:
        self._redraw_due = False
        self.version += 1

    def on_health_ended(self, message: HealthEnded) -> None:
        message.stop()
        self.status = None
        self.version += 1
        if message.problem:
            self.notify(message.problem, title="No row statistics", severity="warning", timeout=8)

    def on_unmount(self) -> None:
        self.cancel.set()
