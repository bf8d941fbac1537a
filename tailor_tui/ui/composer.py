"""The composer's screen: the grid of rows and checkpoints, its details panel and the run's loss
curve beside it, and what the user does there (pick, heal, save and load recipes, plan and compose,
export).

The screen owns the session's state (the recipe being made, `draft`; the scan) and binds the composer's keys
(`actions`); the widgets own theirs: the grid its cursor, folding and block selection, the side panel
(`health_pane.HealthPane`) the row statistics, their metric and the training curve, which the screen watches. Its
actions only wire: what a pick, a heal or a plan decides is the backend's (`planning.recipe_draft`, `health.guard`,
`planning`, `export`). Slow work (scanning, planning, statistics) runs in thread workers that post messages; widgets
are touched only by handlers.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar, Static
from textual.worker import get_current_worker

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint, is_dcp
from tailor_tui.checkpoints.scan import ScanResult, scan_run
from tailor_tui.errors import OutputError, TailorError
from tailor_tui.events import TaskOptions
from tailor_tui.export.dcp_to_hf import DcpHfExport, plan_dcp_hf
from tailor_tui.export.export_plan import plan_export
from tailor_tui.export.export_run import ExportResult, config_file, config_source
from tailor_tui.formats.safetensors_out import parse_size
from tailor_tui.health.guard import nonfinite_lines, planned_health, planned_nonfinite
from tailor_tui.health.healing import heal, training_curve, training_log
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.dcp_plan import plan_dcp
from tailor_tui.planning.output import not_replaceable
from tailor_tui.planning.recipe_draft import RecipeDraft
from tailor_tui.planning.recipe_file import converted_path, load_recipe
from tailor_tui.team.sbatch import LARGE, offer_batch, write_sbatch
from tailor_tui.ui.actions import DETAILS, HOME, bindings
from tailor_tui.ui.describe import LABEL, details_lines, fit_title
from tailor_tui.ui.dialogs import Answer, Confirm, ErrorDialog, PathPrompt, PlanDialog
from tailor_tui.ui.grid import CheckpointGrid
from tailor_tui.ui.health_pane import HealthPane
from tailor_tui.ui.loss_curve import LossCurve
from tailor_tui.ui.messages import (
    ExportFailed,
    ExportReady,
    PlanFailed,
    PlanReady,
    ScanComplete,
    ScanFailed,
    ScanProgressed,
)
from tailor_tui.ui.plain import plain, plain_lines
from tailor_tui.ui.progress_screen import ProgressScreen
from tailor_tui.units import WHOLE_NUMBER, clipped, shown, size, whole_number

if TYPE_CHECKING:
    from tailor_tui.checkpoints.checkpoint import Checkpoint
    from tailor_tui.health.healing import Cell
    from tailor_tui.planning.recipe import Recipe
    from tailor_tui.ui.messages import Outcome


SCAN_REDRAW = 0.05  # seconds between redraws of the scan's progress
FEW_NAMED = 3  # folders a notice of skipped ones names
SIDE_WIDTH = 46  # columns of the side panel beside the grid, at least (tailor.tcss: #side)
EXPORT_SHARD = "5GB"  # the largest safetensors file of an export for evaluation

Saved = Callable[[Path], None]  # told where a recipe was saved (`then` of the save actions)


@dataclass(frozen=True)
class ComposerOptions:
    """What the composer is started with (`make_app`)."""

    run_dir: Path
    recipe: Path | None = None  # loaded at start; a recipe that does not exist yet is where ctrl+s saves
    workers: int | None = None  # worker processes of a composition or statistics (None: as many as fit)
    clock: Callable[[], float] = time.monotonic  # the progress screen's (snapshot tests fix it)
    compose_options: TaskOptions = TaskOptions()
    batch_threshold: int = LARGE  # bytes to write from which a login node offers a batch job


class DetailsPanel(VerticalScroll):
    """The details panel: its text whole (the Static `#details` inside), scrolled. Tab from the grid
    focuses it; the arrows, pgup/pgdn, home/end scroll it; Esc, tab or Enter go back to the grid.
    The screen's keys work there as on the grid: a pick picks the grid's cell, the one described."""

    BINDINGS = bindings(DETAILS)

    def action_focus_grid(self) -> None:
        self.screen.query_one(CheckpointGrid).focus()


class ComposerScreen(Screen[None]):
    BINDINGS = bindings(HOME)

    def __init__(self, options: ComposerOptions):
        super().__init__()
        self.options = options
        self.draft: RecipeDraft | None = None
        self.scan_result: ScanResult | None = None
        self.details_text = self.title_text = ""  # what the details panel and the title show
        self.details_row: str | None = None  # the row the details describe (another: shown from the top)

    # --- layout ------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="title")
        with Vertical(id="scanning"):
            yield Label(plain(f"Scanning {self.options.run_dir} …"), id="scan-label")
            yield ProgressBar(id="scan-bar", show_eta=False)
        with Horizontal(id="main"):
            yield CheckpointGrid(id="grid")
            # wide: beside the grid, the curve below the details; narrow: below the grid
            with HealthPane(id="side", workers=self.options.workers):
                with DetailsPanel(id="details-panel"):
                    yield Static("", id="details")
                yield LossCurve(id="curve")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#main").display = False
        self.update_title()
        self.watch(self.query_one(CheckpointGrid), "virtual_size", self.fit_side, init=False)
        pane = self.health_pane
        self.watch(pane, "status", lambda _status: self.update_title(), init=False)
        self.watch(pane, "version", lambda _version: self.refresh_view(), init=False)
        self.watch(pane, "metric", lambda _metric: self.refresh_view(), init=False)
        self.scan_worker()

    @property
    def health_pane(self) -> HealthPane:
        """The run's health as shown: the statistics, their progress, the heatmap's metric, the training curve."""
        return self.query_one(HealthPane)

    def fit_side(self) -> None:
        """Wide: the side panel (details, loss curve) takes the columns the grid's checkpoints leave free, at least
        its stylesheet's width and at most three fifths of the screen; narrow: below the grid, the stylesheet's."""
        side = self.query_one("#side")
        if self.has_class("-narrow"):
            side.styles.clear_rule("width")
            return
        grid = self.query_one(CheckpointGrid)
        # (2: the side's border, and a column between)
        free = self.size.width - grid.virtual_size.width - grid.scrollbar_size_vertical - 2
        width = max(SIDE_WIDTH, min(free, self.size.width * 3 // 5))
        if side.styles.width is None or side.styles.width.value != width:
            side.styles.width = width

    def rel(self, path: Path | None) -> str:
        """A path as the user thinks of it: relative to the run directory when inside it."""
        if path is None:
            return "(none)"
        try:
            return str(Path(path).resolve().relative_to(self.options.run_dir.resolve()))
        except ValueError:
            return str(path)

    def update_title(self) -> None:
        """One line, most important first: the unsaved marker and the recipe, the world size, the
        statistics' progress, base and output, then the run's folder. Where the width is short, the
        paths are shortened from the left (`…/new.yaml`, `…/checkpoint-6-tailored`) so that every part
        keeps its name, the run's folder first to go (80 columns keep every other part)."""
        comp = self.draft
        parts: list[tuple[str, str]] = []  # (label, path: shortened from the left when room is short)
        if comp:
            recipe = self.rel(comp.recipe_path) if comp.recipe_path else ""
            parts.append(("" if comp.saved else "* ", recipe or "unsaved recipe"))
            if comp.world_size is not None:
                parts.append((f"{comp.base_checkpoint.world_size} → {comp.world_size} ranks", ""))
            if (status := self.health_pane.status) is not None:
                parts.append((status, ""))
            parts += [(f"base {comp.base_checkpoint.name}", ""), ("output ", self.rel(comp.output))]
        room = self.size.width - 2  # the title's padding
        run = shown(self.options.run_dir.name or self.options.run_dir)  # its full path: the details panel
        title = fit_title([("tailor-tui", ""), *parts], room)
        if len(title) + 3 + len(run) <= room:
            title += " · " + run
        elif room - len(title) - 3 > 8:
            title += " · …" + run[len(run) - (room - len(title) - 4):]
        if title != self.title_text:  # one line, its height fixed: no re-layout of the screen
            self.title_text = title
            self.query_one("#title", Static).update(plain(title), layout=False)

    def on_resize(self) -> None:
        self.update_title()
        self.fit_side()
        self.keep_focus_shown()

    # --- scanning ------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="scan")
    def scan_worker(self) -> None:
        worker = get_current_worker()

        last = 0.0

        def progressed(done: int, total: int, path: Path) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= SCAN_REDRAW or done == total:  # a redraw a tick, not one a folder
                last = now
                self.post_message(ScanProgressed(done, total, path))

        try:  # (each trainer_state.json is read here, not in the UI)
            result = scan_run(self.options.run_dir, on_progress=progressed, cancelled=lambda: worker.is_cancelled)
            logs = {i: training_log(c) for i, c in enumerate(result.checkpoints) if c.step is not None}
            curve = training_curve(result.checkpoints)
        except TailorError as exc:
            self.post_message(ScanFailed(str(exc)))
        else:
            self.post_message(ScanComplete(result, logs, curve))

    def on_scan_progressed(self, message: ScanProgressed) -> None:
        self.query_one("#scan-bar", ProgressBar).update(total=message.total, progress=message.done)
        self.query_one("#scan-label", Label).update(
            plain(f"Scanning {self.options.run_dir} … {message.done}/{message.total} {self.rel(message.path)}"))

    def on_scan_failed(self, message: ScanFailed) -> None:
        self.health_pane.nothing_to_compute()
        self.query_one("#scan-label", Label).update(plain(f"error: {message.message}"))
        self.app.push_screen(ErrorDialog(message.message, title="Cannot scan"))

    def on_scan_complete(self, message: ScanComplete) -> None:
        result = self.scan_result = message.result
        if not result.checkpoints:
            self.health_pane.nothing_to_compute()
            why = [f"  skipped {self.rel(p)}: {w}" for p, w in result.problems]
            self.query_one("#scan-bar", ProgressBar).display = False  # nothing more is coming
            self.query_one("#scan-label", Label).update(
                plain_lines([f"{result.nothing_found(self.options.run_dir)}. q quits.", *why]))
            self.refresh_bindings()  # (nothing to pick, heal or compose: only help and quit)
            return
        self.draft = RecipeDraft.start(list(result.checkpoints))
        self.query_one("#scanning").display = False
        self.query_one("#main").display = True
        self.refresh_bindings()  # (the composer's keys, now that there is something to pick)
        if self.options.recipe is not None:
            if self.options.recipe.exists():
                self.adopt_recipe(self.options.recipe)  # on failure it is not the save target
            else:
                self.draft.recipe_path = self.options.recipe  # a new recipe: ctrl+s creates it
        self.health_pane.start(tuple(result.checkpoints), message.logs, message.curve)
        self.refresh_view()
        self.query_one(CheckpointGrid).focus()
        self.tell_skipped(result.problems)
        self.tell_ignored([log.note for log in message.logs.values() if log.note])

    def tell_skipped(self, problems: tuple[tuple[Path, str], ...]) -> None:
        """One notice for what the scan skipped, however many folders (the details panel lists them)."""
        if len(problems) == 1:
            (path, why), = problems
            self.notify(why, title=f"Skipped {self.rel(path)}", severity="warning", timeout=8)
        elif problems:
            names = ", ".join(self.rel(path) for path, _why in problems[:FEW_NAMED])
            more = f" and {len(problems) - FEW_NAMED:,} more" if len(problems) > FEW_NAMED else ""
            self.notify(f"{names}{more}: they look like checkpoints but cannot be used; the details panel says why",
                        title=f"Skipped {len(problems):,} folders", severity="warning", timeout=8)

    def tell_ignored(self, notes: list[str]) -> None:
        """One notice for what the training logs held that was ignored (a number past 64 bits, a log
        that cannot be read), however many checkpoints'."""
        if notes:
            more = f" (and {len(notes) - 1:,} more such logs)" if len(notes) > 1 else ""
            self.notify(notes[0] + more, title="Training log", severity="warning", timeout=8)

    # --- view ------------------------------------------------------------------------------

    def refresh_view(self) -> None:
        if not self.is_attached or self.draft is None:
            return  # shutting down (a timer of the statistics fired after the screen went), or no run yet
        grid, pane = self.query_one(CheckpointGrid), self.health_pane
        grid.show(self.draft, pane.health, pane.metric, pane.version)
        self.update_title()
        self.update_details()

    def update_curve(self, column: int | None) -> None:
        """The curve, its cursor on the checkpoint of `column` (None: no column under the cursor)."""
        comp = self.draft
        self.health_pane.show_curve(comp.checkpoints[column].step if comp is not None and column is not None else None)

    def on_checkpoint_grid_cursor_moved(self, message: CheckpointGrid.CursorMoved) -> None:
        if message.grid.is_attached:  # may arrive while the app shuts down
            self.update_details()

    def on_checkpoint_grid_selection_changed(self, message: CheckpointGrid.SelectionChanged) -> None:
        if message.grid.is_attached:
            self.refresh_view()

    def on_checkpoint_grid_chosen(self, message: CheckpointGrid.Chosen) -> None:
        self.action_pick()  # Enter and mouse clicks pick, like space

    def update_details(self) -> None:
        comp = self.draft
        if comp is None:
            return
        grid = self.query_one(CheckpointGrid)
        row_name, column = grid.current()
        self.update_curve(column)
        if row_name is None:
            return
        problems = self.scan_result.problems if self.scan_result else ()
        folded = grid.folded_stack()
        pane = self.health_pane
        lines = details_lines(comp, pane.health, row_name, column, metric=pane.metric, computing=pane.status,
                              problems=problems, outputs=self.scan_result.outputs if self.scan_result else (),
                              show=self.rel, stack=folded)
        text = "\n".join(lines)
        if text != self.details_text:
            self.details_text = text
            details = self.query_one("#details", Static)
            details.update(plain_lines(lines), layout=False)
            # the whole text, as tall as it wraps, in a scroll of fixed size: a layout only where that
            # height changes (the scroll's content; the rest keeps its place), not on every move of the cursor
            width = details.content_size.width
            if width and details.get_content_height(details.size, details.size, width) != details.content_size.height:
                details.refresh(layout=True)
        if row_name != self.details_row:  # another row: its details from the top (the same: left where read)
            self.details_row = row_name
            self.query_one(DetailsPanel).scroll_home(animate=False)

    # --- actions --------------------------------------------------------------------------

    def editable(self) -> bool:
        """Picks change only on the grid itself, not under a dialog or the progress screen."""
        return self.draft is not None and self.on_top

    @property
    def active_draft(self) -> RecipeDraft:
        if self.draft is None:
            raise RuntimeError("no composition yet: the scan has not found the run's checkpoints")
        return self.draft

    def edit(self, change: Callable[[], object]) -> None:
        try:
            change()
        except TailorError as exc:
            self.notify(str(exc), severity="error", timeout=6)
        self.refresh_view()

    def action_pick(self) -> None:
        if not self.editable():
            return
        comp, grid = self.active_draft, self.query_one(CheckpointGrid)
        row, column = grid.current()
        rows = grid.block_rows()  # the selected rows, or a folded stack's
        if rows and column is not None:  # a block of rows, one undo step
            grid.clear_selection()
            changed: list[str] = []
            self.edit(lambda: changed.extend(comp.pick_rows(rows, column)))
            self.notify(f"{len(changed)} of {len(rows)} row(s) from {comp.checkpoints[column].name}", timeout=3)
        elif row is not None and column is not None:
            self.edit(lambda: comp.pick(row, column))

    def action_pick_column(self) -> None:
        self._edit_column(lambda column: self.active_draft.pick_column(column))

    def action_set_base(self) -> None:
        self._edit_column(lambda column: self.active_draft.set_base(column))

    def _edit_column(self, change: Callable[[int], None]) -> None:
        """A change to the checkpoint under the cursor (on the grid itself)."""
        if not self.editable():
            return
        _row, column = self.query_one(CheckpointGrid).current()
        if column is not None:
            self.edit(lambda: change(column))

    def action_undo(self) -> None:
        self._step("undo")

    def action_redo(self) -> None:
        self._step("redo")

    def _step(self, way: str) -> None:
        """Undo or redo one change of the picks."""
        if not self.editable():
            return
        if not getattr(self.draft, way)():
            self.notify(f"nothing to {way}")
        self.refresh_view()

    def action_set_output(self) -> None:
        if not self.editable():
            return
        comp = self.active_draft

        def done(value: str | None) -> None:
            if value:
                self.edit(lambda: comp.set_output(Path(os.path.expanduser(value))))

        self.app.push_screen(PathPrompt("Output folder for the composed checkpoint", str(comp.output)), done)

    def action_run_compose(self) -> None:
        if self.editable():
            self.active_draft.renew_default_output()  # an output nobody named is never an existing path
            self.plan_worker(self.active_draft.to_recipe())

    @work(thread=True, exclusive=True, group="plan")
    def plan_worker(self, recipe: Recipe, force: bool = False) -> None:
        try:
            if is_dcp(recipe.base):  # a PyTorch Distributed Checkpoint's: what it takes is known from the grid's cells
                self.post_message(PlanReady(plan_dcp(recipe, force=force)))
                return
            plan = build_plan(recipe, force=force)
            # the rows it would take NaN/Inf from, by their checkpoints' statistics (computed here if absent)
            self.post_message(PlanReady(plan, dict(planned_nonfinite(plan, cache=cache_dir()))))
        except OutputError as exc:
            out = Path(recipe.output) if recipe.output else None
            earlier = (not force and out is not None and out.is_dir() and not out.is_symlink()
                       and any(out.iterdir()) and not_replaceable(out) is None)
            self.post_message(PlanFailed(str(exc), out if earlier else None, recipe))
        except TailorError as exc:
            self.post_message(PlanFailed(str(exc)))

    def on_plan_failed(self, message: PlanFailed) -> None:
        if message.replaceable is None:
            self.app.push_screen(ErrorDialog(message.message, title="Cannot compose"))
            return

        def answer(yes: Answer) -> None:
            if yes:
                self.plan_worker(message.recipe, force=True)

        self.app.push_screen(Confirm(f"Replace {self.rel(message.replaceable)}?",
                                 f"{shown(message.replaceable)} holds an earlier composition by tailor-tui. It is replaced "
                                 "only once the new one is complete; until then it stays as it is.",
                                 accept="Replace", decline="Back"), answer)

    def on_plan_ready(self, message: PlanReady) -> None:
        plan = message.plan
        body = "\n".join(map(shown, plan.describe(show=self.rel, every_file=False)))  # a line per line
        # Rows the statistics already know to be non-finite or damaged in their source: the
        # --apply would refuse them, so the user decides here ("Compose anyway" allows them).
        verdict = planned_health(plan, self.cell_of, message.nonfinite)
        broken, bad = verdict.broken, nonfinite_lines(plan, verdict.nonfinite)
        if broken:
            self.app.push_screen(ErrorDialog("\n".join([
                "These rows cannot be composed from the checkpoints picked for them (their files are damaged):",
                *map(shown, broken), "Pick another checkpoint for each (h heals: the newest healthy one)."]),
                title="Cannot compose"))
            return
        if bad:
            body = "\n".join(["✗ the output would hold unhealthy rows:", *map(shown, bad),
                              "Enter goes back (h heals them); ! composes anyway, as --apply --allow-nonfinite does",
                              "", body])

        batch = offer_batch(plan.bytes_to_write(), self.options.batch_threshold)
        if batch:
            body = "\n".join([f"This writes {size(plan.bytes_to_write())}: on this login node, "
                              "s writes an sbatch script that composes it over several nodes instead.", "", body])

        def confirmed(answer: Answer) -> None:
            if answer == "world_size":
                self.action_set_world_size(then_plan=True)
            elif answer == "sbatch":
                self.action_write_batch_job(plan.bytes_to_write())
            elif answer:
                self.app.push_screen(ProgressScreen(plan, self.options.workers, clock=self.options.clock,
                                             options=self.options.compose_options, allow_nonfinite=bool(bad),
                                             title=f"Composing {self.rel(plan.output)}",
                                             finished=self.compose_finished),
                                 self.compose_closed)

        accept = "Compose anyway" if bad else "Compose"
        self.app.push_screen(PlanDialog("Compose this checkpoint?", body, accept=accept, decline="Back", batch=batch,
                                        risky=bool(bad)), confirmed)

    def cell_of(self, row: str, checkpoint: Checkpoint | DcpCheckpoint) -> Cell | None:
        health = self.health_pane.health
        if health is None:
            return None
        for i, c in enumerate(health.checkpoints):
            if c.path == checkpoint.path:
                return health.cell(row, i)
        return None

    def action_cycle_metric(self) -> None:
        if self.editable():
            self.notify(f"heatmap: {LABEL[self.health_pane.next_metric()]}", timeout=2)

    def action_heal(self) -> None:
        """Every row from the newest checkpoint where it is healthy; shown first, one undo step."""
        health = self.health_pane.health
        if not self.editable() or health is None:
            return
        if self.health_pane.status is not None:
            self.notify("row statistics are still being computed; heal when they are complete",
                        severity="warning", timeout=4)
            return
        comp = self.active_draft
        healing = heal(health, comp.healable_rows(), usable=comp.combines_with)
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

    def compose_finished(self, result: Outcome) -> None:
        self.notify(f"{'exported' if isinstance(result, ExportResult) else 'composed'} {result.output}")

    def compose_closed(self, _result: object = None) -> None:
        self.refresh_view()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Under a dialog or the progress screen the grid's keys do nothing, nor with no checkpoint to pick from
        # (scanning, or a folder of none): the footer hides them.
        return self.on_top and self.draft is not None and (action != "focus_details" or self.details_shown)

    @property
    def on_top(self) -> bool:
        """Whether the user is on the grid itself (no dialog, no progress screen over it)."""
        return self.app.screen is self

    @property
    def details_shown(self) -> bool:
        """Whether the details panel is on the screen (narrow, `c` puts the curve in its place)."""
        return not (self.has_class("-narrow") and self.query_one("#side").has_class("curve-toggled"))

    def keep_focus_shown(self) -> None:
        """The details panel shown or hidden (the curve in its place): the footer names tab only where it
        shows (in place of the palette's key at 80 columns: tailor.tcss), and the grid takes the focus from it
        hidden."""
        self.set_class(self.details_shown, "-details-shown")
        self.refresh_bindings()
        if not self.details_shown and self.query_one(DetailsPanel).has_focus:
            self.query_one(CheckpointGrid).focus()

    def action_focus_details(self) -> None:
        """Tab: into the details panel, to scroll it (its Esc, tab or Enter come back)."""
        if self.editable() and self.details_shown:
            self.query_one(DetailsPanel).focus()

    def action_toggle_details(self) -> None:
        if self.editable():
            self.query_one("#side").toggle_class("tall")

    def action_toggle_curve(self) -> None:
        """Wide: hide (or show again) the curve below the details; narrow: the curve in the details' place."""
        if self.editable():
            self.query_one("#side").toggle_class("curve-toggled")
            self.keep_focus_shown()

    def stop_statistics(self) -> None:
        """The statistics' workers stop between chunks (quitting: they are not waited for)."""
        self.health_pane.cancel.set()

    # --- moving around the grid -------------------------------------------------------------
    # (the screen's keys, not the grid's: they work from the details panel too)

    def action_select_rows(self) -> None:
        """Start (or drop) a block selection at the cursor's row; moving up or down extends it."""
        if self.editable():
            self.query_one(CheckpointGrid).toggle_selection()

    def action_extend_selection(self, step: int) -> None:
        if self.editable():
            self.query_one(CheckpointGrid).extend_selection(step)

    def action_clear_selection(self) -> None:
        self.query_one(CheckpointGrid).clear_selection()

    def action_fold(self) -> None:
        """Fold the stack under the cursor (a multimodal model's vision encoder, language model…)
        into its header line, or unfold it."""
        if not self.editable():
            return
        if self.query_one(CheckpointGrid).toggle_fold() is None:
            self.notify("this model has one stack: nothing to fold", timeout=3)
        self.refresh_view()

    def action_first_row(self) -> None:
        if self.editable():
            self.query_one(CheckpointGrid).move_cursor(row=0)

    def action_last_row(self) -> None:
        if self.editable():
            grid = self.query_one(CheckpointGrid)
            grid.move_cursor(row=grid.row_count - 1)

    def action_jump(self) -> None:
        """Go to the first row whose name starts with (else contains) what is typed."""
        if not self.editable():
            return

        def done(value: str | None) -> None:
            text = (value or "").strip()
            if text and not self.query_one(CheckpointGrid).jump(text):
                self.notify(f"no row named like '{text}'", severity="warning")

        self.app.push_screen(PathPrompt("Jump to row (e.g. layers.40)", ""), done)

    # --- recipes: ctrl+s, S (save as), ctrl+o; a recipe that failed to load is never the save target ------------

    def action_set_world_size(self, then_plan: bool = False) -> None:
        """Ask for the data-parallel world size to compose for (empty: the base's; in the recipe too); from the plan
        dialog (`then_plan`), show the plan again with it."""
        comp = self.draft
        if comp is None or (not then_plan and not self.editable()):
            return
        if isinstance(comp.base_checkpoint, DcpCheckpoint):
            self.notify("a PyTorch Distributed Checkpoint loads at any world size: there is none to choose", timeout=5)
            return

        def done(value: str | None) -> None:
            if value is None:  # Esc: nothing changes
                return
            text = value.strip()
            size = whole_number(text)
            if text and not (size is not None and size >= 1):
                self.app.push_screen(ErrorDialog(f"world size '{clipped(text)}': a whole number of at least 1 (the "
                                                 f"data-parallel ranks to compose for, in {WHOLE_NUMBER}), or "
                                                 "empty for the base's"))
                return
            dropped = comp.set_world_size(size if text else None)
            if dropped:
                self.notify(f"{', '.join(dropped)}: back to the base (their checkpoints have another world size)",
                            severity="warning", timeout=8)
            self.refresh_view()
            if then_plan:
                self.plan_worker(comp.to_recipe())

        base = comp.base_checkpoint.world_size
        self.app.push_screen(PathPrompt(f"World size to compose for (the base: {base} ranks; empty keeps it)",
                                        str(comp.world_size or "")), done)

    def action_save_recipe(self, then: Saved | None = None) -> None:
        """Save the picks (asking where, the first time); `then(path)` once they are saved."""
        comp = self.draft
        if comp is None:
            return
        if comp.recipe_path is not None:
            self.save_to(comp.recipe_path, then=then)
        else:
            self.action_save_recipe_as(then=then)

    def action_save_recipe_as(self, then: Saved | None = None) -> None:
        comp = self.draft
        if comp is None:
            return

        def done(value: str | None) -> None:
            if value:
                self.save_to(Path(os.path.expanduser(value)), then=then)

        if comp.recipe_path is None and comp.read_from is not None:
            try:
                default = converted_path(comp.read_from)
            except TailorError:
                default = comp.read_from.with_name("recipe.yaml")
            title = f"Save the picks as a tailor-tui recipe ({self.rel(comp.read_from)}, LLMTailor's, stays as it is)"
        else:
            default, title = comp.recipe_path or self.options.recipe or Path("recipe.yaml"), "Save the recipe as"
        self.app.push_screen(PathPrompt(title, str(default)), done)

    def action_write_batch_job(self, bytes_to_write: int) -> None:
        """Save the recipe, then write the sbatch script that composes it over several nodes."""
        def write(recipe: Path) -> None:
            try:
                script = write_sbatch(recipe, bytes_to_write)
            except TailorError as exc:
                self.app.push_screen(ErrorDialog(str(exc)))
                return
            self.notify(f"wrote {self.rel(script)}; submit it with: sbatch {self.rel(script)}", timeout=15)

        self.action_save_recipe(then=write)

    def save_to(self, path: Path, confirmed: bool = False, then: Saved | None = None) -> None:
        """Save there; a file the composer did not load or save is replaced only when confirmed;
        `then(path)` once saved."""
        comp = self.active_draft  # the save actions return before this without one
        if path.is_dir():  # a folder is no recipe file: say so, never "Replace .?" then "Is a directory"
            self.app.push_screen(ErrorDialog(f"{path} is a folder: name the recipe file to save, e.g. "
                                             f"{path / 'fix.yaml'}", title="Cannot save the recipe"))
            return

        def replace(yes: Answer) -> None:
            if yes:
                self.save_to(path, confirmed=True, then=then)

        if not confirmed and _same_file(path, comp.read_from):
            self.app.push_screen(Confirm(f"Replace the LLMTailor recipe {self.rel(path)}?",
                                         f"{path} is the LLMTailor recipe these picks were read from. Replacing it "
                                         "writes a tailor-tui recipe in its place: its slices become one pick per "
                                         "row, and LLMTailor cannot read it any more. Back keeps it; save to "
                                         "another name with S.", accept="Replace", decline="Back"), replace)
            return
        if not confirmed and path.exists() and not _same_file(path, comp.recipe_path):
            self.app.push_screen(Confirm(f"Replace {self.rel(path)}?",
                                         f"{path} exists and was not loaded into this composer: its contents would "
                                         "be replaced by these picks.", accept="Replace", decline="Back"), replace)
            return
        try:
            saved = comp.save(path)
        except TailorError as exc:
            self.app.push_screen(ErrorDialog(str(exc)))
            return
        self.notify(f"recipe saved to {saved}; run it with: tailor-tui --apply {saved}")
        self.update_title()
        if then is not None:
            then(Path(saved))

    def action_load_recipe(self) -> None:
        if not self.editable():
            return
        comp = self.active_draft

        def done(value: str | None) -> None:
            if value:
                self.adopt_recipe(Path(os.path.expanduser(value)))
                self.refresh_view()

        def ask_path(yes: Answer = True) -> None:
            if yes:
                self.app.push_screen(PathPrompt("Load a recipe", str(comp.recipe_path or "")), done)

        if comp.saved:
            ask_path()
        else:
            self.app.push_screen(Confirm("Load a recipe?", "The current picks are not saved; loading a recipe "
                                         "replaces them (undo brings them back).", accept="Load", decline="Back"),
                                 ask_path)

    def adopt_recipe(self, path: Path) -> None:
        try:
            recipe = load_recipe(path, run=self.options.run_dir)  # an LLMTailor recipe's paths: in this run
            self.active_draft.load(recipe)
        except TailorError as exc:
            self.app.push_screen(ErrorDialog(str(exc), title="Cannot load the recipe"))
            return
        if recipe.converted_from is not None:  # ctrl+s asks where: never over the LLMTailor file
            self.notify(f"read {self.rel(path)} as an {recipe.converted_from} recipe; ctrl+s saves the picks "
                        "as a tailor-tui recipe beside it, leaving it as it is")

    # --- e: export for evaluation ----------------------------------------------------------------------------------
    # Asks for the folder (beside the output by default), plans the export in a thread, then runs it on the progress
    # screen: the backend of `tailor-tui --export`. A DeepSpeed-layout run records no config.json: the model's config
    # is asked for too (as `--config`); left empty, the folder holds the weights and the notice says how to add one.

    def action_export(self) -> None:
        if not self.editable():
            return
        comp = self.active_draft
        output = comp.output or comp.default_output()

        def chosen(value: str | None) -> None:
            if not value:
                return
            recipe = dataclasses.replace(comp.to_recipe(), output=Path(os.path.expanduser(value)))
            if comp.base_checkpoint.folder.model_config:  # the config comes with the base
                self.export_worker(recipe, None)
                return

            def with_config(config: str | None) -> None:
                if config is not None:  # Esc cancels the export; empty: the weights only
                    self.export_worker(recipe, Path(os.path.expanduser(config)) if config else None)

            self.app.push_screen(PathPrompt("The model's config.json, or a folder with it and its tokenizer "
                                            "(a DeepSpeed-layout or DCP run records none)",
                                            placeholder="empty: export the weights only"), with_config)

        self.app.push_screen(PathPrompt("Export for evaluation (a plain HF model folder) to",
                                        str(output.with_name(output.name + "-hf"))), chosen)

    @work(thread=True, exclusive=True, group="plan")
    def export_worker(self, recipe: Recipe, config: Path | None) -> None:
        try:
            if is_dcp(recipe.base):  # a composition of PyTorch Distributed Checkpoints: its writers refuse NaN/Inf
                found = plan_dcp_hf(plan_dcp(recipe), None, parse_size(EXPORT_SHARD), allow_nonfinite=False)
                self.post_message(ExportReady(found, config_file(config) if config is not None else None))
                return
            export = plan_export(build_plan(recipe), None, parse_size(EXPORT_SHARD))
            config_source(export, config)  # a folder without config.json is said now, not after the weights
            # the rows it would take NaN/Inf from, by their checkpoints' statistics (computed here if absent)
            self.post_message(ExportReady(export, config, dict(planned_nonfinite(export.plan, cache=cache_dir()))))
        except TailorError as exc:
            self.post_message(ExportFailed(str(exc)))

    def on_export_failed(self, message: ExportFailed) -> None:
        self.app.push_screen(ErrorDialog(message.message, title="Cannot export"))

    def on_export_ready(self, message: ExportReady) -> None:
        if not message.nonfinite:
            self.start_export(message)
            return
        body = "\n".join(["✗ the exported model would hold non-finite values:",
                          *map(shown, nonfinite_lines(message.export.plan, message.nonfinite)),
                          "Enter goes back (h heals them); ! exports anyway, as --export --allow-nonfinite does"])

        def answer(yes: Answer) -> None:
            if yes is True:
                self.start_export(message)

        self.app.push_screen(PlanDialog("Export this model?", body, accept="Export anyway", decline="Back",
                                        risky=True), answer)

    def start_export(self, message: ExportReady) -> None:
        """Run the export on the progress screen."""
        export = message.export
        if (message.config if isinstance(export, DcpHfExport) else config_source(export, message.config)) is None:
            self.notify("no config.json for this model: the folder will hold the weights only; export again "
                        "and give its config.json (or tailor-tui --export … --config PATH)", severity="warning",
                        timeout=10)
        self.app.push_screen(ProgressScreen(export.plan, self.options.workers, clock=self.options.clock,
                                            options=self.options.compose_options,
                                            title=f"Exporting {self.rel(export.plan.output)}", export=export,
                                            export_config=message.config, finished=self.compose_finished),
                             self.compose_closed)


def _same_file(path: Path, other: Path | None) -> bool:
    """Whether `path` is the file `other` names (both there: compared by identity)."""
    return other is not None and path.exists() and other.exists() and os.path.samefile(path, other)
