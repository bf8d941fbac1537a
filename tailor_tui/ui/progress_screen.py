"""The progress screen: one progress bar per rank plus an overall bar with throughput and ETA.

The composition runs in a thread worker (which itself drives worker processes); progress
arrives as backend events wrapped in messages, so no widget is touched off the event loop.

A handful of tasks (up to `report.FEW`) get a bar each. More (512 ranks) get a fixed number of
bar rows, `SLOTS`, each showing a task in progress and passed on to the next when it is done,
a line saying how many are done, in progress and waiting, and the overall bar: the screen stays
as tall at 512 ranks as at 8, and each message costs O(1) (`report.Tally`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar, Static

from tailor_tui.compose.compose_run import planned_tasks, run_compose
from tailor_tui.compose.dcp_compose import run_dcp_compose
from tailor_tui.errors import Cancelled, TailorError
from tailor_tui.events import TaskOptions, TaskProgressed, progress_of
from tailor_tui.export.dcp_rank import export_dcp_rank
from tailor_tui.export.dcp_to_hf import DcpHfExport, run_dcp_hf_export
from tailor_tui.export.export_plan import Export
from tailor_tui.export.export_run import ExportResult, run_export
from tailor_tui.health.guard import newest_finite
from tailor_tui.planning.dcp_plan import DcpComposePlan, DcpFileJob
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.progress_bars import FEW, Tally
from tailor_tui.ui.messages import ComposeFailed, ComposeFinished, ComposeProgressed
from tailor_tui.ui.plain import plain
from tailor_tui.units import size, throughput

if TYPE_CHECKING:
    from tailor_tui.ui.messages import Outcome

SLOTS = FEW  # bar rows for tasks in progress when there are many: they fit at 80x24


class ProgressScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "cancel_or_close", "Cancel / close"),
    ]

    def __init__(self, plan: ComposePlan | DcpComposePlan, workers: int | None, *,
                 clock: Callable[[], float] = time.monotonic,
                 autostart: bool = True, title: str | None = None, options: TaskOptions = TaskOptions(),
                 allow_nonfinite: bool = False, export: Export | DcpHfExport | None = None,
                 export_config: Path | None = None,
                 finished: Callable[[Outcome], None] = lambda result: None):
        super().__init__()
        self.on_finished = finished  # the composer's: told the result
        self.options, self.allow_nonfinite = options, allow_nonfinite
        self.export = export  # an export for evaluation runs here instead of the composition
        self.export_config = export_config  # as --config
        self.autostart = autostart  # snapshot tests feed progress events themselves
        self.title_text = title or f"Composing {plan.output}"
        self.compose_workers, self.clock = workers, clock  # `workers`: Textual's
        self.cancel = threading.Event()
        self.finished = threading.Event()  # set when the composition thread has fully returned
        if export is not None:
            self.tasks, self.unit = [(j.task, j.progress_bytes) for j in export.jobs], "written"
        elif isinstance(plan, DcpComposePlan):  # a PyTorch Distributed Checkpoint's composition: its files' copies
            if allow_nonfinite:  # ("Compose anyway": its copies take the NaN/Inf the plan refused)
                plan = replace(plan, jobs=tuple(replace(job, allow_nonfinite=True) if isinstance(job, DcpFileJob)
                                                else job for job in plan.jobs))
            self.tasks, self.unit = progress_of(plan.jobs), "written"
        else:  # the bars count bytes written, or composed where a clone shares the base's blocks
            self.tasks, self.unit = planned_tasks(plan), plan.progress_unit(clone=options.clone)
        self.plan = plan
        self.tally = Tally(self.tasks)  # every task's bytes done; which are waiting, in progress, done
        self.many = len(self.tasks) > FEW
        self.index = {name: i for i, (name, _) in enumerate(self.tasks)}  # few: a task's bar
        self.slots: list[str | None] = [None] * SLOTS  # many: the task each bar row shows
        self.slot_of: dict[str, int] = {}
        self.started = clock()
        self.running = True

    def compose(self) -> ComposeResult:
        with Vertical(id="compose"):
            yield Label(plain(self.title_text), id="compose-title")
            with VerticalScroll(id="bars"):
                if self.many:
                    for i in range(SLOTS):
                        with Horizontal(classes="bar-row idle", id=f"slot-{i}"):
                            yield Label("", classes="bar-label", id=f"slot-label-{i}")
                            yield ProgressBar(total=1, show_eta=False, id=f"bar-{i}")
                    yield Static(self.counts(), id="compose-tasks")
                else:
                    for i, (name, _total) in enumerate(self.tasks):
                        with Horizontal(classes="bar-row"):
                            yield Label(plain(name), classes="bar-label")
                            yield ProgressBar(total=_total, show_eta=False, id=f"bar-{i}")
                with Horizontal(classes="bar-row overall"):
                    yield Label("overall", classes="bar-label")
                    yield ProgressBar(total=sum(t for _, t in self.tasks), show_eta=False, id="bar-overall")
            yield Static("", id="compose-rate")
            yield Static("Esc cancels: workers stop, and the output path is left as it was.", id="compose-status")
        yield Footer()

    def on_mount(self) -> None:
        # every task's name whole beside its bar (an export's `checkpoint-6 rank 1`), within reason
        width = max(len("overall"), *(len(name) for name, _ in self.tasks[:SLOTS * 64])) + 1
        for label in self.query(".bar-label"):
            label.styles.width = max(14, min(width, 32))
        if self.autostart:
            self.run_compose_worker()
        else:
            self.finished.set()

    @work(thread=True, exclusive=True, group="compose")
    def run_compose_worker(self) -> None:
        def emit(event: object) -> None:
            if isinstance(event, TaskProgressed):
                self.post_message(ComposeProgressed(event))

        result: Outcome
        try:
            if isinstance(self.export, DcpHfExport):
                result = run_dcp_hf_export(self.export, config=self.export_config, workers=self.compose_workers,
                                           emit=emit, cancel=self.cancel, options=self.options)
            elif self.export is not None:
                result = run_export(self.export, config=self.export_config, workers=self.compose_workers, emit=emit,
                                    cancel=self.cancel, options=self.options)
            elif isinstance(self.plan, DcpComposePlan):
                result = run_dcp_compose(self.plan, workers=self.compose_workers, emit=emit, cancel=self.cancel,
                                         options=self.options, write_rows=export_dcp_rank)
            else:
                result = run_compose(self.plan, workers=self.compose_workers, emit=emit, cancel=self.cancel,
                                   options=self.options, allow_nonfinite=self.allow_nonfinite,
                                   newest_finite=newest_finite)
        except Cancelled as exc:
            self.post_message(ComposeFailed(str(exc), cancelled=True))
        except TailorError as exc:
            self.post_message(ComposeFailed(str(exc), cancelled=False))
        except Exception as exc:  # a bug: still say it in plain words, never a traceback on screen
            self.post_message(ComposeFailed(f"internal error: {type(exc).__name__}: {exc}", cancelled=False))
        else:
            self.post_message(ComposeFinished(result))
        finally:
            self.finished.set()

    def on_compose_progressed(self, message: ComposeProgressed) -> None:
        e = message.event
        if e.task not in self.index:
            return
        self.tally.add(e)
        if self.many:
            self.place(e.task)
            self.query_one("#compose-tasks", Static).update(self.counts())
        else:
            self.query_one(f"#bar-{self.index[e.task]}", ProgressBar).update(progress=e.done)
        self.update_overall()

    def counts(self) -> str:
        t = self.tally
        return f"{t.finished} of {len(t.totals)} done · {len(t.running)} in progress · {t.waiting} waiting"

    def place(self, task: str) -> None:
        """Many tasks: a task in progress takes a free bar row; a finished one hands its row to the
        next task in progress without one (in the order they started)."""
        slot = self.slot_of.get(task)
        shown: str | None = task  # what the row shows now
        if task in self.tally.ended:
            if slot is None:
                return
            del self.slot_of[task]
            shown = next((name for name in self.tally.running if name not in self.slot_of), None)
            if shown is not None:
                self.slot_of[shown] = slot
        elif slot is None:
            if None not in self.slots:
                return  # every row is taken: it is counted in progress until one is free
            slot = self.slots.index(None)  # SLOTS rows: O(1) in the number of tasks
            self.slot_of[task] = slot
        self.slots[slot] = shown
        self.show_slot(slot)

    def show_slot(self, slot: int) -> None:
        task = self.slots[slot]
        self.query_one(f"#slot-{slot}").set_class(task is None, "idle")
        self.query_one(f"#slot-label-{slot}", Label).update(plain(task or ""))
        if task is not None:
            bar = self.query_one(f"#bar-{slot}", ProgressBar)
            bar.update(total=self.tally.totals[task], progress=self.tally.done[task])

    def update_overall(self) -> None:
        done, total = self.tally.bytes_done, self.tally.bytes_total
        self.query_one("#bar-overall", ProgressBar).update(total=total, progress=done)
        rate, eta = throughput(done, total, self.clock() - self.started)
        self.query_one("#compose-rate", Static).update(
            f"{size(done)} of {size(total)} {self.unit} · {size(rate)}/s · ETA {eta:.0f}s"
        )

    def on_compose_finished(self, message: ComposeFinished) -> None:
        self.running = False
        self.tally.finish_all()
        if self.many:
            self.slot_of.clear()
            self.slots = [None] * SLOTS
            for slot in range(SLOTS):
                self.show_slot(slot)
            self.query_one("#compose-tasks", Static).update(self.counts())
        else:
            for i, (_, total) in enumerate(self.tasks):
                self.query_one(f"#bar-{i}", ProgressBar).update(progress=total)
        self.update_overall()
        r = message.result
        unread = "" if isinstance(r, ExportResult) else "".join(f" {line[0].upper()}{line[1:]}." for line in r.unread())
        self.query_one("#compose-status", Static).update(plain(
            f"Done: {r.output} ({f'{size(r.bytes_written)} written' if isinstance(r, ExportResult) else r.amount()} "
            f"in {r.seconds:.1f}s).{unread} "
            "ctrl+s saves the recipe; Esc returns to the grid."))
        self.add_class("finished")
        self.on_finished(r)

    def on_compose_failed(self, message: ComposeFailed) -> None:
        self.running = False
        self.add_class("failed")
        # what is at the output path now: an earlier output that was to be replaced stays as it was
        left = (f"{self.plan.output.name} is the earlier output, as it was; nothing new was written"
                if os.path.lexists(self.plan.output) else "nothing was left at the output path")
        if message.cancelled:
            self.query_one("#compose-status", Static).update(plain(f"Cancelled: {left}. Esc returns to the grid."))
        else:
            from tailor_tui.ui.dialogs import ErrorDialog

            self.query_one("#compose-status", Static).update(plain(f"Failed: {left}."))
            self.app.push_screen(ErrorDialog(message.message, title="The composition failed"))

    def action_cancel_or_close(self) -> None:
        if self.running:
            self.cancel.set()
            self.query_one("#compose-status", Static).update("Cancelling…")
        else:
            self.dismiss()
