"""What the composer screen's parts (`navigation`, `recipe_actions`, `export_actions`) need of the screen they are
mixed into, declared once (`ComposerHost`).

Each part's methods take `self: ComposerHost`: a type checker holds every part to what is
declared here and `ComposerScreen` to providing it (tests/test_structure.py checks, without
one, that the parts use nothing more and nothing less).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from tailor_tui.events import TaskOptions
from tailor_tui.team.sbatch import LARGE

if TYPE_CHECKING:
    from textual.app import App
    from textual.message import Message
    from textual.notifications import SeverityLevel
    from textual.widget import Widget
    from textual.worker import Worker

    from tailor_tui.compose.composition import Composition
    from tailor_tui.planning.recipe import Recipe
    from tailor_tui.ui.messages import ExportReady, Outcome

    W = TypeVar("W", bound=Widget)

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


class ComposerHost(Protocol):
    """The composer screen, as its parts see it."""

    # --- of Textual's screen ---------------------------------------------------------------

    @property
    def app(self) -> App[Any]: ...

    def notify(self, message: str, *, title: str = ..., severity: SeverityLevel = ...,
               timeout: float | None = ...) -> None: ...

    def query_one(self, selector: type[W]) -> W: ...

    def post_message(self, message: Message) -> bool: ...

    # --- the session's state (`ComposerScreen.__init__`) ------------------------------------

    options: ComposerOptions
    composition: Composition | None
    composing: bool  # a composition or an export runs on the progress screen

    # --- the screen's own ---------------------------------------------------------------------

    @property
    def active_composition(self) -> Composition:
        """`composition`, for what runs only once there is one (`editable`, a dialog it opened)."""
        ...

    def rel(self, path: Path | None) -> str: ...

    def update_title(self) -> None: ...

    def refresh_view(self) -> None: ...

    def editable(self) -> bool: ...

    def plan_worker(self, recipe: Recipe, force: bool = False) -> Worker[None]: ...

    def compose_finished(self, result: Outcome) -> None: ...

    def compose_closed(self, _result: object = None) -> None: ...

    # --- the parts' own, that their methods call through the screen -----------------------

    def action_save_recipe(self, then: Saved | None = None) -> None: ...

    def action_save_recipe_as(self, then: Saved | None = None) -> None: ...

    def save_to(self, path: Path, confirmed: bool = False, then: Saved | None = None) -> None: ...

    def adopt_recipe(self, path: Path) -> None: ...

    def export_worker(self, recipe: Recipe, config: Path | None) -> Worker[None]: ...

    def export_failed(self, message: str) -> None: ...

    def start_export(self, message: ExportReady) -> None: ...
