"""The messages the composer's workers post to it: plain data, as dataclasses (Textual's Message
initialises itself in `__post_init__`; `eq=False` keeps them hashable, by identity). Widgets are
touched only by their handlers, on the event loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from textual.message import Message

from tailor_tui.checkpoints.scan import ScanResult
from tailor_tui.events import TaskProgressed
from tailor_tui.health.healing import TrainingCurve, TrainingLog
from tailor_tui.planning.dcp_plan import DcpComposePlan
from tailor_tui.planning.plan import ComposePlan

if TYPE_CHECKING:
    from tailor_tui.compose.compose_run import Composed
    from tailor_tui.compose.dcp_compose import DcpComposed
    from tailor_tui.export.dcp_to_hf import DcpHfExport
    from tailor_tui.export.export_plan import Export
    from tailor_tui.export.export_run import ExportResult
    from tailor_tui.planning.recipe import Recipe

    # what the progress screen's run gives: a composition (of ZeRO-3 or DCP checkpoints) or an export
    Outcome = Composed | DcpComposed | ExportResult


@dataclass(eq=False)
class ScanProgressed(Message):
    """`done` of `total` folders opened, the last `path` (a newer one replaces one still queued:
    thousands of folders are not thousands of redraws)."""

    done: int
    total: int
    path: Path

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ScanProgressed)


@dataclass(eq=False)
class ScanComplete(Message):
    """The scan's result, with what the worker read of the training logs: each checkpoint's loss
    (`logs`, by column) and the run's curve."""

    result: ScanResult
    logs: dict[int, TrainingLog]
    curve: TrainingCurve


@dataclass(eq=False)
class ScanFailed(Message):
    message: str


@dataclass(eq=False)
class HealthProgressed(Message):
    """Statistics: `done` of `total` bytes read (a newer one replaces one still queued)."""

    done: int
    total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, HealthProgressed)


@dataclass(eq=False)
class CellsArrived(Message):
    column: int
    cells: dict


@dataclass(eq=False)
class HealthEnded(Message):
    problem: str | None = None


@dataclass(eq=False)
class PlanReady(Message):
    plan: ComposePlan | DcpComposePlan
    nonfinite: dict[str, int] = field(default_factory=dict)  # row -> NaN/Inf it would take (`health.guard`)


@dataclass(eq=False)
class ExportReady(Message):
    export: Export | DcpHfExport
    config: Path | None  # the model's config.json or its folder (as --config)
    nonfinite: dict[str, int] = field(default_factory=dict)  # row -> NaN/Inf it would take (`health.guard`)


@dataclass(eq=False)
class ExportFailed(Message):
    message: str


@dataclass(eq=False)
class PlanFailed(Message):
    """`replaceable`: the output is an earlier tailor-tui output the user may choose to replace
    (what --force does headlessly), with `recipe` to plan again."""

    message: str
    replaceable: Path | None = None
    recipe: Recipe | None = None


@dataclass(eq=False)
class ComposeProgressed(Message):
    """A task of the composition (or export) moved (a newer one of the same task replaces one still queued)."""

    event: TaskProgressed

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ComposeProgressed) and message.event.task == self.event.task


@dataclass(eq=False)
class ComposeFinished(Message):
    result: Outcome


@dataclass(eq=False)
class ComposeFailed(Message):
    message: str
    cancelled: bool
