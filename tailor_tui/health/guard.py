"""The one non-finite rule of every command that writes model values (`--apply`, resharding, `--export`, the
composer's compose and export): which rows an output would take NaN/Inf from, decided before anything is
written from the health statistics of the checkpoint each row is taken from (cached by `--stats`, or
computed for those cells alone: `planned_nonfinite`); and where a row so refused is finite: the newest
checkpoint of the base's run that holds it whole and finite (`newest_finite`).

The front ends refuse such an output in one line (`compose.compose_run.nonfinite_error`, exit 8) before any
byte is written, and `--dry-run` says it; `--allow-nonfinite` (the composer's `!`) is the one way past. The
writers still count each row's non-finite values while they read the data anyway (for the CRC checks,
`nonfinite.Census`) and refuse an output that would hold some before it is published: a file that changed
since the statistics were taken is caught there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.checkpoint import Checkpoint, incompatibility
from tailor_tui.checkpoints.dcp_checkpoint import open_dcp
from tailor_tui.checkpoints.lineage import Lineage
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError
from tailor_tui.events import Emit
from tailor_tui.health.healing import Cell, damage, why_unhealthy
from tailor_tui.kinds.dcp_rows import DcpSave
from tailor_tui.planning.dcp_plan import DcpComposePlan
from tailor_tui.planning.plan import ComposePlan


def planned_nonfinite(plan: ComposePlan, *, cache: Path | None, workers: int | None = None,
                      emit: Emit = lambda event: None, compute: bool = True) -> Counter:
    """{row: its NaN/Inf} of every row the output of `plan` takes from a checkpoint whose statistics find
    non-finite values in it (its fp32 masters, any state its optimizer keeps per element, its frozen
    fragments). Each cell from the statistics of the checkpoint's run as `--stats` cached them, else from those of
    the checkpoint alone (no earlier one read for a change), computed if not cached (`emit`: their progress;
    cached for the next command), before anything is written. A
    checkpoint deleted since (`--verify`'s stand-in) or a cell the statistics could not compute (a damaged
    file: the writers refuse it as they read it) is left to the writers; so is every cell not cached where not
    `compute` (an output to be written whatever it holds: `--allow-nonfinite`)."""
    wanted: dict[int, list[str]] = {}
    for row, s in plan.picks.items():
        if not plan.sources[s].gone:
            wanted.setdefault(s, []).append(row)
    runs: dict[Path, tuple[Checkpoint, ...]] = {}
    counts: Counter = Counter()
    for s, rows in wanted.items():
        counts.update(rows_nonfinite(plan.sources[s], rows, cache=cache, workers=workers, emit=emit, compute=compute,
                                     runs=runs))
    return counts


def rows_nonfinite(source: Checkpoint, rows: list[str], *, cache: Path | None, workers: int | None = None,
                   emit: Emit = lambda event: None, compute: bool = True, runs: dict | None = None) -> Counter:
    """{row: its NaN/Inf} of `rows` of checkpoint `source` where its statistics find some (`planned_nonfinite`'s
    rule for one source; `runs`: the run folders' checkpoints, scanned once by a caller asking of several)."""
    from tailor_tui.health.stats_run import cached_cells, compute_health

    if isinstance(source.saved, DcpSave):  # a PyTorch Distributed Checkpoint's rows: its own statistics
        return _dcp_nonfinite(source.path, rows, cache)
    runs = {} if runs is None else runs
    if source.path.parent not in runs:
        runs[source.path.parent] = _checkpoints_of(source.path.parent)
    run = runs[source.path.parent]
    column = next((i for i, c in enumerate(run) if c.path == source.path), None)
    cells = cached_cells(run, column, cache) if column is not None else None
    if cells is None:  # as computed alone, before (a command of the same recipe)
        cells = cached_cells((source,), 0, cache)
    if cells is None and not compute:
        return Counter()
    if cells is None:  # computed alone: no earlier checkpoint read for a change not asked for; every row (its
        # records are read whole for their CRC-32 anyway), cached for the next command
        health = compute_health((source,), columns=[0], workers=workers, cache=cache, emit=emit)
        cells = {row: cell for row in rows if (cell := health.cell(row, 0)) is not None}
    return Counter({row: cell.nonfinite for row in rows
                    if (cell := cells.get(row)) is not None and cell.error is None and cell.nonfinite})


def _dcp_nonfinite(path: Path, rows: list[str], cache: Path | None) -> Counter:
    """{row: its NaN/Inf} of `rows` of the DCP checkpoint `path` (`dcp_stats`, this checkpoint alone)."""
    from tailor_tui.health.dcp_stats import dcp_health

    health = dcp_health((open_dcp(path),), cache=cache)
    return Counter({row: cell.nonfinite for row in rows
                    if (cell := health.cell(row, 0)) is not None and cell.error is None and cell.nonfinite})


def _checkpoints_of(folder: Path) -> tuple[Checkpoint, ...]:
    try:
        return tuple(scan(folder).checkpoints)
    except CheckpointError:
        return ()


def newest_finite(plan: ComposePlan, rows: list[str]) -> dict[str, str]:
    """{row: name of the newest checkpoint of the base's run where it is finite and whole}."""
    # the statistics' machinery, loaded on a refusal only: every composition imports this module
    # (~15 ms of its start), few are refused
    from tailor_tui.health.stats_run import compute_health

    try:
        scanned = scan(plan.base.path.parent)
    except CheckpointError:
        return {}
    lineage = Lineage()  # the base's run only
    candidates = [c for c in scanned.checkpoints
                  if incompatibility(plan.base, c) is None and lineage.apart(plan.base, c) is None]
    found: dict[str, str] = {}
    for column in reversed(range(len(candidates))):
        wanted = [r for r in rows if r not in found and candidates[column].holds(r)]
        if not wanted:
            continue
        health = compute_health(tuple(candidates), columns=[column], rows=wanted, workers=1, cache=cache_dir())
        for row in wanted:
            cell = health.cell(row, column)
            if cell is not None and cell.healthy:
                found[row] = candidates[column].name
        if len(found) == len(rows):
            break
    return found


@dataclass(frozen=True)
class PlannedHealth:
    """What the composer may compose of a plan, by the statistics it holds of each cell the plan takes a row from:
    `broken`, a line per row whose file fails its CRC-32 checks or cannot be read (never composed: no "anyway");
    `nonfinite`, {row: its NaN/Inf} (composed only where the user allows it, as `--allow-nonfinite`)."""

    broken: tuple[str, ...]
    nonfinite: dict[str, int]


def planned_health(plan: ComposePlan | DcpComposePlan, cell_of: Callable[[str, Any], Cell | None],
                   nonfinite: dict[str, int]) -> PlannedHealth:
    """The composer's compose policy for `plan`: `cell_of(row, checkpoint)`, the statistics known of a row of a
    checkpoint (None: not yet); `nonfinite`, `planned_nonfinite`'s counts. A DCP plan's NaN/Inf are its cells'
    (its writers refuse those the cells do not know yet)."""
    cells = [(row, plan.sources[s].name, cell) for row, s in plan.picks.items()
             if (cell := cell_of(row, plan.sources[s])) is not None and not cell.healthy]
    broken = tuple(f"{row} from {name}: {why_unhealthy(cell)}" for row, name, cell in cells if damage(cell) != "NaN")
    if isinstance(plan, DcpComposePlan):
        nonfinite = {row: cell.nonfinite for row, _name, cell in cells if cell.nonfinite}
    return PlannedHealth(broken, dict(nonfinite))


def nonfinite_lines(plan, counts: dict[str, int]) -> list[str]:
    """A line per row an output would take NaN/Inf from (`counts`: `planned_nonfinite`'s), in the plan's row order:
    `layers.2 from checkpoint-6: 5,120 non-finite value(s)`."""
    return [f"{row} from {plan.sources[s].name}: {counts[row]:,} non-finite value(s)"
            for row, s in plan.picks.items() if counts.get(row)]
