"""The interactive composer: scan a run directory, pick each row's source, merge.

`make_app` is the one way to build the app: the CLI, the pilot tests and the snapshot
tests all use it. Slow work (scanning, planning, merging) runs in thread workers that
post messages; widgets are only touched on the event loop.
"""

from __future__ import annotations

import ast
import asyncio
import os
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar, Static
from textual.worker import get_current_worker

from tailor_tui.checkpoints.scan import ScanResult, scan
from tailor_tui.compose.composition import Composition
from tailor_tui.errors import OutputError, TailorError
from tailor_tui.events import TaskOptions
from tailor_tui.export.folder import ExportResult
from tailor_tui.health.healing import Health, training_log, why_unhealthy
from tailor_tui.planning.output import not_replaceable
from tailor_tui.planning.build import build_plan
from tailor_tui.team.sbatch import LARGE, offer_batch
from tailor_tui.units import size
from tailor_tui.team.workers import prepare_worker_processes
from tailor_tui.ui.details import details_lines
from tailor_tui.ui.export_actions import ExportActions
from tailor_tui.ui.dialogs import Confirm, ErrorDialog, HelpScreen, PathPrompt, PlanDialog
from tailor_tui.ui.grid import CheckpointGrid
from tailor_tui.ui.health_actions import HealthActions
from tailor_tui.ui.merge_screen import MergeScreen
from tailor_tui.ui.messages import (
    PlanFailed,
    PlanReady,
    ScanComplete,
    ScanFailed,
    ScanProgressed,
)
from tailor_tui.ui.navigation import Navigation
from tailor_tui.ui.recipe_actions import RecipeActions


class TailorApp(ExportActions, HealthActions, Navigation, RecipeActions, App):
    CSS_PATH = "tailor.tcss"
    TITLE = "tailor-tui"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]  # narrow: details below the grid
    # The footer shows the keys a session needs at any width (80 columns included); the others
    # are in the help screen and the command palette, which says what each does.
    BINDINGS = [
        Binding("space", "pick", "Pick"),
        Binding("v", "select_rows", "Select rows", show=False),
        Binding("shift+down", "extend_selection(1)", "Select down", show=False),
        Binding("shift+up", "extend_selection(-1)", "Select up", show=False),
        Binding("escape", "clear_selection", "Drop selection", show=False),
        Binding("slash", "jump", "Jump to row", show=False),
        Binding("g", "first_row", "First row", show=False),
        Binding("G", "last_row", "Last row", show=False),
        Binding("a", "pick_column", "Pick column", show=False),
        Binding("b", "set_base", "Make base", show=False),
        Binding("h", "heal", "Heal"),
        Binding("m", "cycle_metric", "Metric", show=False),
        Binding("d", "toggle_details", "Details", show=False),
        Binding("o", "set_output", "Output", show=False),
        Binding("w", "set_world_size", "World size", show=False),
        Binding("e", "export", "Export", show=False),
        Binding("u,ctrl+z", "undo", "Undo", show=False),
        Binding("ctrl+y,ctrl+shift+z", "redo", "Redo", show=False),
        Binding("ctrl+s", "save_recipe", "Save"),
        Binding("S", "save_recipe_as", "Save as", show=False),
        Binding("ctrl+o", "load_recipe", "Load", show=False),
        Binding("ctrl+r", "run_merge", "Merge"),
        Binding("question_mark,f1", "help", "Help"),
        Binding("q", "request_quit", "Quit"),
    ]
    PALETTE = {  # action -> what the command palette says it does
        "pick": "Pick the cell under the cursor (or the selected rows) from its checkpoint",
        "select_rows": "Select a block of rows (arrows extend it, space picks it, Esc drops it)",
        "extend_selection": "Extend the selected rows",
        "clear_selection": "Drop the row selection",
        "jump": "Jump to a row by name",
        "first_row": "Go to the first row",
        "last_row": "Go to the last row",
        "pick_column": "Pick every row from the checkpoint under the cursor",
        "set_base": "Make the checkpoint under the cursor the base",
        "heal": "Heal: every row from the newest checkpoint where it is healthy",
        "cycle_metric": "Colour the grid by the next health metric",
        "toggle_details": "Give the details panel more room (on a narrow terminal it sits below the grid)",
        "set_output": "Set the output folder",
        "set_world_size": "Set the world size to compose for (reshard for another number of ranks)",
        "export": "Export for evaluation: the composition as a plain HF model folder (from_pretrained loads it)",
        "undo": "Undo the last change",
        "redo": "Redo the change undone last",
        "save_recipe": "Save the picks as a recipe",
        "save_recipe_as": "Save the picks as a recipe under another name",
        "load_recipe": "Load a recipe's picks",
        "run_merge": "Review the plan and merge",
        "help": "Help: what each mark means, the keys",
        "request_quit": "Quit tailor-tui (asks first if picks are unsaved or a merge runs)",
    }

    def __init__(self, run_dir: Path, recipe: Path | None = None, workers: int | None = None,
                 clock: Callable[[], float] = time.monotonic, merge_options: TaskOptions = TaskOptions(),
                 batch_threshold: int = LARGE):
        super().__init__()
        prepare_worker_processes()  # before Textual takes over stderr
        self.run_dir, self.recipe_arg = Path(run_dir), recipe
        self.merge_workers, self.merge_clock = workers, clock  # `workers` is Textual's worker manager
        self.merge_options = merge_options
        self.batch_threshold = batch_threshold  # bytes to write from which a login node offers a batch job
        self.composition: Composition | None = None
        self.scan_result: ScanResult | None = None
        self.merging = False
        # Row health: filled in by the statistics worker, newest checkpoint first
        self.health: Health | None = None
        self.health_version = 0  # bumped as cells arrive: the grid redraws rows then
        self.health_status: str | None = "statistics: starting"  # None once complete
        self.metric = "rel_change"
        self.stats_cancel = threading.Event()
        self._redraw_due = False
        self.anchor: int | None = None  # the row a block selection (v) started at
        self._details_text = self._title_text = ""

    # --- layout ------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="title")
        with Vertical(id="scanning"):
            yield Label(f"Scanning {self.run_dir} …", id="scan-label")
            yield ProgressBar(id="scan-bar", show_eta=False)
        with Horizontal(id="main"):
            yield CheckpointGrid(id="grid")
            yield Static("", id="details", markup=False)
        yield Footer()

    @property
    def home(self) -> Screen:
        """The screen with the grid: App.query_one would search whatever screen is on top
        (a dialog, the merge screen), so the grid's own widgets are looked up here."""
        return self.screen_stack[0]

    def on_mount(self) -> None:
        self.home.query_one("#main").display = False
        self.update_title()
        self.scan_worker()

    def rel(self, path: Path | None) -> str:
        """A path as the user thinks of it: relative to the run directory when inside it."""
        if path is None:
            return "(none)"
        try:
            return str(Path(path).resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path)

    def update_title(self) -> None:
        comp = self.composition
        parts = [f"tailor-tui · {self.run_dir.name or self.run_dir}"]
        if comp:
            parts.append(f"base {comp.base_checkpoint.name}")
            parts.append(f"output {self.rel(comp.output)}")
            if comp.world_size is not None:
                parts.append(f"{comp.base_checkpoint.world_size} → {comp.world_size} ranks")
            recipe = self.rel(comp.recipe_path) if comp.recipe_path else "unsaved recipe"
            parts.append(recipe + ("" if comp.saved else " *"))
            if self.health_status:
                parts.append(self.health_status)
        title = " · ".join(parts)
        if title != self._title_text:  # one line, its height fixed: no re-layout of the screen
            self._title_text = title
            self.home.query_one("#title", Static).update(title, layout=False)

    # --- scanning ------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="scan")
    def scan_worker(self) -> None:
        worker = get_current_worker()
        try:
            result = scan(
                self.run_dir,
                on_progress=lambda done, total, path: self.post_message(ScanProgressed(done, total, path)),
                cancelled=lambda: worker.is_cancelled,
            )
        except TailorError as exc:
            self.post_message(ScanFailed(str(exc)))
        else:
            self.post_message(ScanComplete(result))

    def on_scan_progressed(self, message: ScanProgressed) -> None:
        self.home.query_one("#scan-bar", ProgressBar).update(total=message.total, progress=message.done)
        self.home.query_one("#scan-label", Label).update(
            f"Scanning {self.run_dir} … {message.done}/{message.total} {self.rel(message.path)}"
        )

    def on_scan_failed(self, message: ScanFailed) -> None:
        self.health_status = None
        self.home.query_one("#scan-label", Label).update(f"error: {message.message}")
        self.push_screen(ErrorDialog(message.message, title="Cannot scan"))

    def on_scan_complete(self, message: ScanComplete) -> None:
        result = self.scan_result = message.result
        if not result.checkpoints:
            self.health_status = None
            why = "\n".join(f"  skipped {self.rel(p)}: {w}" for p, w in result.problems)
            self.home.query_one("#scan-bar", ProgressBar).display = False  # nothing more is coming
            self.home.query_one("#scan-label", Label).update(
                f"No usable ZeRO-3 checkpoints under {self.run_dir}: looked for HF checkpoint-N folders "
                "(trainer_state.json and a `latest` file), DeepSpeed tag folders (zero_pp_rank_*_model_states.pt) "
                "and partial saves (tailor_partial.json). q quits." + (f"\n{why}" if why else "")
            )
            return
        self.composition = Composition.start(list(result.checkpoints))
        self.home.query_one("#scanning").display = False
        self.home.query_one("#main").display = True
        if self.recipe_arg is not None:
            if self.recipe_arg.exists():
                self.adopt_recipe(self.recipe_arg)  # on failure it is not the save target
            else:
                self.composition.recipe_path = self.recipe_arg  # a new recipe: ctrl+s creates it
        self.health = Health(tuple(result.checkpoints), logs={i: training_log(c)
                                                              for i, c in enumerate(result.checkpoints)})
        self.refresh_view()
        self.home.query_one(CheckpointGrid).focus()
        for path, why in result.problems:
            self.notify(why, title=f"Skipped {self.rel(path)}", severity="warning", timeout=8)
        self.stats_worker(tuple(result.checkpoints))

    # --- view ------------------------------------------------------------------------------

    def refresh_view(self) -> None:
        if not self.screen_stack or self.composition is None:
            return  # shutting down (a timer of the statistics fired after the screens went), or no run yet
        grid = self.home.query_one(CheckpointGrid)
        grid.show(self.composition, self.health, self.metric, self.health_version)
        self.update_title()
        self.update_details()

    def on_checkpoint_grid_cursor_moved(self, message: CheckpointGrid.CursorMoved) -> None:
        if message.grid.is_attached:  # may arrive while the app shuts down
            self._follow_selection()
            self.update_details()

    def on_checkpoint_grid_chosen(self, message: CheckpointGrid.Chosen) -> None:
        self.action_pick()  # Enter and mouse clicks pick, like space

    def update_details(self) -> None:
        comp = self.composition
        if comp is None:
            return
        row_name, column = self.home.query_one(CheckpointGrid).current()
        if row_name is None:
            return
        problems = self.scan_result.problems if self.scan_result else ()
        lines = details_lines(comp, self.health, row_name, column, metric=self.metric, computing=self.health_status,
                              problems=problems, show=self.rel)
        text = "\n".join(lines)
        details = self.home.query_one("#details", Static)
        if text != self._details_text:  # its size is fixed by the layout: no re-layout of the screen
            self._details_text = text
            details.update(text, layout=False)

    # --- actions --------------------------------------------------------------------------

    def _editable(self) -> bool:
        """Picks change only on the grid itself, not under a dialog or the merge screen."""
        return self.composition is not None and len(self.screen_stack) == 1

    def _edit(self, change: Callable[[], None]) -> None:
        try:
            change()
        except TailorError as exc:
            self.notify(str(exc), severity="error", timeout=6)
        self.refresh_view()

    def action_pick(self) -> None:
        if not self._editable():
            return
        grid = self.home.query_one(CheckpointGrid)
        row, column = grid.current()
        if grid.selection is not None and column is not None:  # a block of rows, one undo step
            rows = grid.selected_rows()
            grid.selection = self.anchor = None
            changed = []
            self._edit(lambda: changed.extend(self.composition.pick_rows(rows, column)))
            self.notify(f"{len(changed)} of {len(rows)} row(s) from {self.composition.checkpoints[column].name}",
                        timeout=3)
        elif row is not None and column is not None:
            self._edit(lambda: self.composition.pick(row, column))

    def action_pick_column(self) -> None:
        if not self._editable():
            return
        _row, column = self.home.query_one(CheckpointGrid).current()
        if column is not None:
            self._edit(lambda: self.composition.pick_column(column))

    def action_set_base(self) -> None:
        if not self._editable():
            return
        _row, column = self.home.query_one(CheckpointGrid).current()
        if column is not None:
            self._edit(lambda: self.composition.set_base(column))

    def action_undo(self) -> None:
        if not self._editable():
            return
        if not self.composition.undo():
            self.notify("nothing to undo")
        self.refresh_view()

    def action_redo(self) -> None:
        if not self._editable():
            return
        if not self.composition.redo():
            self.notify("nothing to redo")
        self.refresh_view()

    def action_set_output(self) -> None:
        if not self._editable():
            return

        def done(value: str | None) -> None:
            if value:
                self._edit(lambda: self.composition.set_output(Path(os.path.expanduser(value))))

        self.push_screen(PathPrompt("Output folder for the composed checkpoint", str(self.composition.output)), done)

    def action_run_merge(self) -> None:
        if self._editable():
            self.plan_worker(self.composition.to_recipe())

    @work(thread=True, exclusive=True, group="plan")
    def plan_worker(self, recipe, force: bool = False) -> None:
        try:
            self.post_message(PlanReady(build_plan(recipe, force=force)))
        except OutputError as exc:
            out = Path(recipe.output) if recipe.output else None
            earlier = (not force and out is not None and out.is_dir() and not out.is_symlink()
                       and any(out.iterdir()) and not_replaceable(out) is None)
            self.post_message(PlanFailed(str(exc), out if earlier else None, recipe))
        except TailorError as exc:
            self.post_message(PlanFailed(str(exc)))

    def on_plan_failed(self, message: PlanFailed) -> None:
        if message.replaceable is None:
            self.push_screen(ErrorDialog(message.message, title="Cannot merge"))
            return

        def answer(yes: bool | None) -> None:
            if yes:
                self.plan_worker(message.recipe, force=True)

        self.push_screen(Confirm(f"Replace {self.rel(message.replaceable)}?",
                                 f"{message.replaceable} holds an earlier composition by tailor-tui. It is replaced "
                                 "only once the new one is complete; until then it stays as it is.",
                                 accept="Replace", decline="Back"), answer)

    def on_plan_ready(self, message: PlanReady) -> None:
        plan = message.plan
        body = "\n".join(plan.describe(show=self.rel, every_file=False))
        # Rows the statistics already know to be non-finite or damaged in their source: the
        # merge would refuse them, so the user decides here ("Merge anyway" allows them).
        bad = [f"{row} from {plan.sources[s].name}: {why_unhealthy(cell)}" for row, s in plan.picks.items()
               if (cell := self._cell_of(row, plan.sources[s])) is not None and not cell.healthy]
        if bad:
            body = "\n".join(["✗ the output would hold unhealthy rows:", *bad, "(h heals them)", "", body])

        batch = offer_batch(plan.bytes_to_write(), self.batch_threshold)
        if batch:
            body = "\n".join([f"This writes {size(plan.bytes_to_write())}: on this login node, "
                              "s writes an sbatch script that composes it over several nodes instead.", "", body])

        def confirmed(answer: bool | str | None) -> None:
            if answer == "world_size":
                self.action_set_world_size(then_plan=True)
            elif answer == "sbatch":
                self.action_write_batch_job(plan.bytes_to_write())
            elif answer:
                self.merging = True
                self.push_screen(MergeScreen(plan, self.merge_workers, clock=self.merge_clock,
                                             options=self.merge_options, allow_nonfinite=bool(bad),
                                             title=f"Composing {self.rel(plan.output)}"), self.merge_closed)

        accept = "Merge anyway" if bad else "Merge"
        self.push_screen(PlanDialog("Compose this checkpoint?", body, accept=accept, decline="Back", batch=batch),
                         confirmed)

    def _cell_of(self, row: str, checkpoint):
        if self.health is None:
            return None
        for i, c in enumerate(self.health.checkpoints):
            if c.path == checkpoint.path:
                return self.health.cell(row, i)
        return None

    def merge_finished(self, result) -> None:
        self.merging = False
        self.notify(f"{'exported' if isinstance(result, ExportResult) else 'composed'} {result.output}")

    def merge_closed(self, _result=None) -> None:
        self.merging = False
        self.refresh_view()

    def on_unmount(self) -> None:
        self.stats_cancel.set()  # statistics workers stop between chunks

    def action_request_quit(self) -> None:
        comp = self.composition
        running = isinstance(self.screen, MergeScreen) and self.screen.running
        if running:
            question = "A merge is running. Cancel it and quit? Nothing will be left at the output path."
        elif comp is not None and not comp.saved:
            question = "The picks are not saved as a recipe. Quit anyway?"
        else:
            self.stats_cancel.set()
            self.exit()
            return

        def answer(yes: bool | None) -> None:
            if yes:
                for screen in self.screen_stack:
                    if isinstance(screen, MergeScreen):
                        screen.cancel.set()  # workers stop; run_merge removes its temp folder
                self.exit_after_merge()

        self.push_screen(Confirm("Quit tailor-tui?", question, accept="Quit", decline="Stay"), answer)

    @work(exclusive=True, group="exit")
    async def exit_after_merge(self) -> None:
        """Exit once a cancelled merge has cleaned up (seconds), so nothing is left behind."""
        for screen in self.screen_stack:
            if isinstance(screen, MergeScreen):
                while not screen.finished.is_set():
                    await asyncio.sleep(0.05)
        self.exit()

    async def action_quit(self) -> None:
        self.action_request_quit()  # ctrl+q asks too

    GRID_ACTIONS = {"pick", "pick_column", "set_base", "set_output", "undo", "redo", "load_recipe", "run_merge",
                    "heal", "cycle_metric", "save_recipe_as", "select_rows", "extend_selection", "jump",
                    "first_row", "last_row", "toggle_details"}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Grid actions belong to the grid: hidden from the footer under dialogs and the merge screen.
        if action in self.GRID_ACTIONS and len(self.screen_stack) > 1:
            return False
        return True

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's own Quit would leave without asking: ours is the one Quit entry
        yield from (c for c in super().get_system_commands(screen) if c.title != "Quit")
        for binding in self.BINDINGS:
            name, _, arguments = binding.action.partition("(")  # `extend_selection(1)`
            args = ast.literal_eval(f"({arguments[:-1]},)") if arguments else ()
            key = binding.key.split(",")[0].replace("question_mark", "?")
            yield SystemCommand(binding.description, f"{self.PALETTE[name]} ({key})",
                                partial(getattr(self, f"action_{name}"), *args))

    def action_toggle_details(self) -> None:
        if self._editable():
            self.home.query_one("#details").toggle_class("tall")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


def make_app(run_dir: str | Path, recipe: str | Path | None = None, workers: int | None = None,
             clock: Callable[[], float] = time.monotonic, merge_options: TaskOptions = TaskOptions(),
             batch_threshold: int = LARGE) -> TailorApp:
    """Build the app (used by the CLI, the pilot tests and the snapshot tests)."""
    return TailorApp(Path(run_dir), Path(recipe) if recipe else None, workers, clock, merge_options, batch_threshold)
