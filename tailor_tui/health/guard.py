"""Where a row refused for its NaN/Inf is finite: the newest checkpoint of the base's run that holds it
whole and finite, from the health statistics (cached, or computed for that row alone).

The writers count each row's non-finite values while they read the data anyway (for the CRC checks,
`nonfinite.Census`) and refuse an output that would hold some in one line
(`compose.compose_run.nonfinite_error`); the front ends (`--apply`, the composer, the selective saves'
composition) give it `newest_finite` to name in that line where each such row is finite.
"""

from __future__ import annotations

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.checkpoint import incompatibility
from tailor_tui.checkpoints.lineage import Lineage
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError
from tailor_tui.planning.plan import ComposePlan


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
