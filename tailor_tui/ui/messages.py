"""The messages the composer's workers post to it (plain data; widgets are touched only by
their handlers, on the event loop)."""

from __future__ import annotations

from pathlib import Path

from textual.message import Message

from tailor_tui.checkpoints.scan import ScanResult
from tailor_tui.planning.plan import MergePlan


class ScanProgressed(Message):
    def __init__(self, done: int, total: int, path: Path) -> None:
        super().__init__()
        self.done, self.total, self.path = done, total, path


class ScanComplete(Message):
    def __init__(self, result: ScanResult) -> None:
        super().__init__()
        self.result = result


class ScanFailed(Message):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


class HealthProgressed(Message):
    """Statistics: `done` of `total` bytes read (a newer one replaces one still queued)."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__()
        self.done, self.total = done, total

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, HealthProgressed)


class CellsArrived(Message):
    def __init__(self, column: int, cells: dict) -> None:
        super().__init__()
        self.column, self.cells = column, cells


class HealthEnded(Message):
    def __init__(self, problem: str | None = None) -> None:
        super().__init__()
        self.problem = problem


class PlanReady(Message):
    def __init__(self, plan: MergePlan) -> None:
        super().__init__()
        self.plan = plan


class ExportReady(Message):
    def __init__(self, export, config) -> None:
        super().__init__()
        self.export = export  # export_plan.Export
        self.config = config  # the model's config.json or its folder (as --config), or None


class PlanFailed(Message):
    """`replaceable`: the output is an earlier tailor-tui output the user may choose to replace
    (what --force does headlessly), with `recipe` to plan again."""

    def __init__(self, message: str, replaceable: Path | None = None, recipe=None) -> None:
        super().__init__()
        self.message, self.replaceable, self.recipe = message, replaceable, recipe
