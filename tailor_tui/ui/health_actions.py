"""The composer's view of the run's health: the statistics worker, the heatmap metric and healing.

A mixin of the composer's screen (it uses the screen's composition, grid and dialogs); the statistics come from
the headless core (`stats_run`). The training curve is its own widget (`loss_curve`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from textual import work

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint
from tailor_tui.errors import Cancelled, TailorError
from tailor_tui.events import TaskFinished, TaskOptions, TaskProgressed
from tailor_tui.health.dcp_stats import dcp_health
from tailor_tui.health.healing import heal
from tailor_tui.health.stats_run import CellsComputed, StatsPlanned, compute_health
from tailor_tui.ui.describe import LABEL, next_metric
from tailor_tui.ui.dialogs import Answer, Confirm
from tailor_tui.ui.messages import CellsArrived, HealthEnded, HealthProgressed

if TYPE_CHECKING:
    from tailor_tui.checkpoints.checkpoint import Checkpoint
    from tailor_tui.ui.host import ComposerHost


class HealthActions:
    """Statistics of every cell, the heatmap metric (m) and healing (h)."""

    # The screen's (`ComposerHost`), declared here too: a type checker takes an assignment to
    # `self.health_status` in this class's methods as declaring it on this class.
    health_status: str | None

    @work(thread=True, exclusive=True, group="stats")
    def stats_worker(self: ComposerHost, checkpoints: tuple[Checkpoint, ...]) -> None:
        """Statistics of every cell, newest checkpoint first, from the cache where it has them;
        the grid stays usable throughout (it only gets messages)."""
        progress: dict[str, Any] = {"total": 0, "tasks": {}, "last": 0.0}

        def emit(event: object) -> None:
            if isinstance(event, CellsComputed):
                self.post_message(CellsArrived(event.column, event.cells))
            elif isinstance(event, StatsPlanned):
                progress["total"] = event.to_read
            elif isinstance(event, (TaskProgressed, TaskFinished)):
                progress["tasks"][event.task] = event.done if isinstance(event, TaskProgressed) else event.total
                now = time.monotonic()
                if now - progress["last"] > 0.2:
                    progress["last"] = now
                    self.post_message(HealthProgressed(sum(progress["tasks"].values()), progress["total"]))

        try:
            if isinstance(checkpoints[0], DcpCheckpoint):  # an FSDP2 run: one process
                dcp_health(checkpoints, emit=emit, cancelled=self.stats_cancel.is_set, cache=cache_dir())
            else:
                compute_health(checkpoints, workers=self.options.workers, emit=emit, cancel=self.stats_cancel,
                               cache=cache_dir(), options=TaskOptions())
        except Cancelled:
            return
        except TailorError as exc:
            self.post_message(HealthEnded(str(exc)))
        except Exception as exc:  # a bug: the grid goes on without statistics
            self.post_message(HealthEnded(f"internal error: {type(exc).__name__}: {exc}"))
        else:
            self.post_message(HealthEnded())

    def on_health_progressed(self: ComposerHost, message: HealthProgressed) -> None:
        if self.health_status is not None and message.total:
            self.health_status = f"statistics {message.done / message.total:.0%}"
            self.update_title()

    def on_cells_arrived(self: ComposerHost, message: CellsArrived) -> None:
        if self.health is None:
            return
        self.health.add(message.column, message.cells)
        if not self.redraw_due:  # many checkpoints arrive in a burst: one redraw for them
            self.redraw_due = True
            self.set_timer(0.25, self.redraw_health)

    def redraw_health(self: ComposerHost) -> None:
        self.redraw_due = False
        self.health_version += 1
        self.refresh_view()

    def on_health_ended(self: ComposerHost, message: HealthEnded) -> None:
        self.health_status = None
        self.health_version += 1
        if message.problem:
            self.notify(message.problem, title="No row statistics", severity="warning", timeout=8)
        self.refresh_view()

    def action_cycle_metric(self: ComposerHost) -> None:
        if self.editable():
            self.metric = next_metric(self.metric)
            self.notify(f"heatmap: {LABEL[self.metric]}", timeout=2)
            self.refresh_view()

    def action_heal(self: ComposerHost) -> None:
        """Every row from the newest checkpoint where it is healthy; shown first, one undo step."""
        if not self.editable() or self.health is None:
            return
        if self.health_status is not None:
            self.notify("row statistics are still being computed; heal when they are complete",
                        severity="warning", timeout=4)
            return
        comp = self.active_composition
        healing = heal(self.health, comp.healable_rows(), usable=comp.combines_with)
        changes = [f"{row} ← {comp.checkpoints[col].name}" + (f"  ({healing.reasons[row]})" if row in healing.reasons
                                                              else "")
                   for row, col in healing.picks.items() if comp.source_of(row) != col]
        hopeless = [f"{row}: no healthy checkpoint" for row in healing.hopeless]
        if not changes:
            self.notify("nothing to heal: every row already comes from its newest healthy checkpoint"
                        + (f"; {len(hopeless)} row(s) have none" if hopeless else ""), timeout=5)
            return

        def answer(yes: Answer) -> None:
            if yes:
                self.edit(lambda: comp.apply_healing(healing.picks))

        body = "\n".join([*changes, *hopeless])
        self.app.push_screen(Confirm(f"Heal {len(changes)} row(s)?", body, accept="Heal", decline="Back"), answer)
