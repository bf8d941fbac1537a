"""The interactive composer's app: the composer's screen, the keys that work on every screen
(help, quit), the command palette, and quitting without leaving anything half-written.

`make_app` is the one way to build the app: the CLI, the pilot tests and the snapshot tests
all use it. The session's state and the grid's keys belong to the composer's screen
(`composer.ComposerScreen`); every action's keys and words come from `actions.ACTIONS`.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.notifications import SeverityLevel
from textual.screen import Screen

from tailor_tui.events import TaskOptions
from tailor_tui.team.sbatch import LARGE
from tailor_tui.team.workers import prepare_worker_processes
from tailor_tui.ui.actions import APP, bindings, palette_actions
from tailor_tui.ui.composer import ComposerOptions, ComposerScreen
from tailor_tui.ui.dialogs import DIALOG_KEYS, Answer, Confirm, HelpScreen
from tailor_tui.ui.plain import notice
from tailor_tui.ui.progress_screen import ProgressScreen

# every screen over the grid, with its keys (from its own bindings): the help lists them, and docs/composer.md
SCREEN_KEYS = (*DIALOG_KEYS, ("While composing or exporting", ProgressScreen.BINDINGS))


class TailorApp(App):
    CSS_PATH = "tailor.tcss"
    TITLE = "tailor-tui"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]  # narrow: details below the grid
    SUSPENDED_SCREEN_CLASS = "-covered"  # the composer's screen under a dialog (tailor.tcss: its footer)
    # The footer shows the keys a session needs at any width (80 columns included); the others
    # are in the help screen and the command palette, which says what each does.
    BINDINGS = bindings(APP)

    def __init__(self, options: ComposerOptions):
        super().__init__()
        prepare_worker_processes()  # before Textual takes over stderr
        self.options = options
        self.crash: BaseException | None = None  # what ended the app, if anything did (cli.crash logs it)

    def _handle_exception(self, error: Exception) -> None:
        # Textual's one door for an exception nothing handled: it ends the app, code 1
        if self.crash is None:
            self.crash = error
        super()._handle_exception(error)

    def _print_error_renderables(self) -> None:
        if self.crash is not None:  # its traceback goes to a log file (cli.crash), not a page of the terminal
            self._exit_renderables.clear()
        super()._print_error_renderables()

    def get_default_screen(self) -> ComposerScreen:
        return ComposerScreen(self.options)

    @property
    def home(self) -> ComposerScreen:
        """The composer's screen (under any dialog or the progress screen)."""
        home = self.screen_stack[0]
        if not isinstance(home, ComposerScreen):  # `get_default_screen`'s: never another
            raise RuntimeError(f"the app's first screen is a {type(home).__name__}, not the composer's")
        return home

    def action_request_quit(self) -> None:
        comp = self.home.draft
        running = isinstance(self.screen, ProgressScreen) and self.screen.running
        if running:
            question = "A composition is running. Cancel it and quit? Nothing new will be left at the output path."
        elif comp is not None and not comp.saved:
            changed = comp.unsaved_changes() or ["the recipe"]
            what = ", ".join(changed[:-1]) + (" and " if len(changed) > 1 else "") + changed[-1]
            question = f"The recipe is not saved: {what} changed since it was. Quit anyway?"
        else:
            self.home.stop_statistics()
            self.exit()
            return

        def answer(yes: Answer) -> None:
            if yes:
                for screen in self.screen_stack:
                    if isinstance(screen, ProgressScreen):
                        screen.cancel.set()  # workers stop; run_compose removes its temp folder
                self.exit_after_composing()

        self.push_screen(Confirm("Quit tailor-tui?", question, accept="Quit", decline="Stay"), answer)

    @work(exclusive=True, group="exit")
    async def exit_after_composing(self) -> None:
        """Exit once a cancelled composition has cleaned up (seconds), so nothing is left behind."""
        for screen in self.screen_stack:
            if isinstance(screen, ProgressScreen):
                while not screen.finished.is_set():
                    await asyncio.sleep(0.05)
        self.exit()

    async def action_quit(self) -> None:
        self.action_request_quit()  # ctrl+q asks too

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # ctrl+s: from any screen, once there are picks to save (not while scanning, nor in a folder of no run)
        return action != "save_recipe" or (bool(self.screen_stack) and self.home.draft is not None)

    def action_save_recipe(self) -> None:
        """ctrl+s saves the session's recipe from any screen (a dialog, the progress screen)."""
        self.home.action_save_recipe()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(SCREEN_KEYS))

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:
        """Every notice of every screen, as text: names in it are never markup nor control codes."""
        super().notify(notice(message), title=notice(title), severity=severity, timeout=timeout, markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's own Quit would leave without asking: ours is the one Quit entry
        yield from (c for c in super().get_system_commands(screen) if c.title != "Quit")
        for action in palette_actions():
            target = self if action.owner == APP else self.home
            yield SystemCommand(action.name, f"{action.description} ({action.key_text.split(' / ')[0]})",
                                partial(getattr(target, f"action_{action.method}"), *action.arguments))


def make_app(run_dir: str | Path, *, recipe: str | Path | None = None, workers: int | None = None,
             clock: Callable[[], float] = time.monotonic, compose_options: TaskOptions = TaskOptions(),
             batch_threshold: int = LARGE) -> TailorApp:
    """Build the app (used by the CLI, the pilot tests and the snapshot tests)."""
    return TailorApp(ComposerOptions(Path(run_dir), Path(recipe) if recipe else None, workers, clock, compose_options,
                                     batch_threshold))
