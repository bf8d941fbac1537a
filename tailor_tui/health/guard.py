"""The non-finite guard: a composition whose output would hold NaN/Inf values is refused.

The writers count each row's non-finite values while they read the data anyway (for the
CRC checks, `nonfinite.Census`); this turns those counts into the one-line refusal, with
the newest checkpoint where each such row is finite (from the health statistics, cached
or computed for that row alone).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.checkpoint import incompatibility
from tailor_tui.checkpoints.lineage import Lineage
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError, NonFiniteError
from tailor_tui.planning.output import identity
from tailor_tui.planning.plan import ComposePlan

MAX_NAMED = 8  # rows named in the one line; the rest are counted


def nonfinite_error(plan: ComposePlan, counts: Counter) -> NonFiniteError:
    """The refusal of `plan`, whose output would hold `counts` non-finite values per row."""
    suggestions = newest_finite(plan, list(counts))
    parts = []
    for row in list(counts)[:MAX_NAMED]:
        source = plan.sources[plan.picks[row]]
        found = suggestions.get(row)
        hint = f"newest finite: {found}" if found else "no finite checkpoint found"
        parts.append(f"{row} from {source.name} ({counts[row]:,} NaN/Inf; {hint})")
    more = f" and {len(counts) - MAX_NAMED} more row(s)" if len(counts) > MAX_NAMED else ""
    return NonFiniteError(
        f"the output {plan.output} would hold non-finite values: {'; '.join(parts)}{more}; pick those "
        "checkpoints (tailor-tui --heal RUN_DIR --recipe R.yaml does) or compose anyway with --allow-nonfinite")


def checked_by_statistics(plan: ComposePlan, rows: dict[int, list[str]]) -> frozenset[int]:
    """The checkpoints of the plan (indices into `plan.sources`; 0 is the base) every one of whose `rows`
    the run's cached statistics (`--stats`, the composer) found whole and finite, as its files are now
    (their cache keys name every file's identity): a composition that keeps the base's in shared blocks
    (`cloning`) need not read them again, nor count again the NaN/Inf of what it takes from a source so
    found. Each run folder is scanned once (from the scan cache) and no rank file is read here; a
    checkpoint is left out where its rows are not cached, or one is not healthy (the writers then read
    and count it, and refuse what fails)."""
    from tailor_tui.health.stats_run import cached_cells  # (as newest_finite: only where it is needed)

    scans: dict[Path, tuple | None] = {}
    found = set()
    for source, wanted in rows.items():
        checkpoint = plan.sources[source]
        folder = checkpoint.path.parent
        if folder not in scans:
            try:
                scans[folder] = tuple(scan(folder).checkpoints)
            except CheckpointError:
                scans[folder] = None
        scanned = scans[folder]
        mine = identity(checkpoint.tag_dir)
        same = [i for i, c in enumerate(scanned or ()) if mine is not None and identity(c.tag_dir) == mine]
        if scanned is None or len(same) != 1:
            continue
        cells = cached_cells(scanned, same[0], cache_dir())
        if cells is not None and all(row in cells and cells[row].healthy for row in wanted):
            found.add(source)
    return frozenset(found)


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
