"""Health statistics of a scanned run: which rank files to read, the cache, adding ranks up.

Checkpoints are read newest first (the decision is usually about the newest ones), each
rank in a worker process (`stats_rank`), and each rank's sums are cached outside the run
(`cache_dir()`), keyed by the identity of every file read: a second look at the same run
reads nothing. `CellsComputed` events carry each checkpoint's cells as soon as all its
ranks are in, so front ends fill in progressively.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint
from .errors import MergeCancelled
from .events import Emit, TaskOptions
from .health import Cell, Health, rms, training_log
from .stats_rank import (
    RankStats,
    RankStatsRead,
    RowSums,
    StatsJob,
    file_identity,
    rank_stats,
)
from .workers import run_calls, workers_for

FORMAT = 1  # of the cached sums: bump when what they mean changes
MAX_CACHED = 16 << 20  # a cache file larger than this is not one of ours
STATS_WORKER = 64 << 20  # interpreter, numpy, two 1 MiB buffers and a chunk's float64 copies


@dataclass(frozen=True)
class StatsPlanned:
    """What computing statistics will read: `to_read` bytes of `ranks` rank files not cached."""

    checkpoints: int
    ranks: int
    cached_ranks: int
    to_read: int


@dataclass(frozen=True)
class CellsComputed:
    """Every cell of checkpoint `column` is known (emitted as each checkpoint completes)."""

    column: int
    name: str  # the checkpoint's folder name
    cells: dict  # {row: Cell}


def cache_dir() -> Path:
    """Where statistics are cached: $TAILOR_TUI_CACHE, else $XDG_CACHE_HOME/tailor-tui, else
    ~/.cache/tailor-tui (never inside a run: sources stay read-only)."""
    if os.environ.get("TAILOR_TUI_CACHE"):
        return Path(os.environ["TAILOR_TUI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tailor-tui"


def previous_holders(checkpoints: tuple[Checkpoint, ...], column: int) -> dict[str, int]:
    """{row: the nearest earlier checkpoint holding it with the same layout} for `column`."""
    ckpt, found = checkpoints[column], {}
    for row in ckpt.rows:
        if row.tied or not ckpt.holds(row.name):
            continue
        for j in reversed(range(column)):
            other = checkpoints[j]
            if other.holds(row.name) and other.layout == ckpt.layout:
                found[row.name] = j
                break
    return found


def stats_jobs(checkpoints: tuple[Checkpoint, ...], column: int, rows: list[str] | None = None,
               known: dict | None = None) -> list[StatsJob]:
    """One job per rank of checkpoint `column`: the rows it holds (of `rows`, default all), and
    their previous checkpoints. The cache key names what is read (the identity of every file,
    the rank, the rows); the slices to read are worked out in the worker, so a run whose
    statistics are cached costs a stat() per file. `known` memoises identities and layouts
    across calls."""
    known = {} if known is None else known
    ckpt = checkpoints[column]
    prev = previous_holders(checkpoints, column)
    owner = ckpt.param_to_row()
    held = frozenset(r.name for r in ckpt.rows
                     if not r.tied and ckpt.holds(r.name) and (rows is None or r.name in rows))
    frozen = tuple((owner[name], name) for name, _ in ckpt.layout.frozen if owner.get(name) in held)
    elements = _row_elements(ckpt, owner, known)
    jobs = []
    for rank, files in enumerate(ckpt.ranks):
        mine = {row: n for row, n in elements[rank].items() if row in held}
        prev_files = tuple((row, checkpoints[prev[row]].ranks[rank]) for row in sorted(mine) if row in prev)
        read = (sum(n * 12 for n in mine.values()) if files.rows is not None
                else ckpt.sizes.get(files.optim_states, 0)) + sum(mine[row] * 4 for row, _ in prev_files)
        previous = {}
        for row, f in prev_files:
            previous.setdefault(_identity(f.rows or f.optim_states, known), []).append(row)
        key = hashlib.sha256(json.dumps([FORMAT, rank, [_identity(p, known) for p in files.existing()],
                                         sorted(held), sorted(previous.items())]).encode()).hexdigest()
        jobs.append(StatsJob(key, column, rank, files, ckpt.layout, owner, held, frozen, prev_files, read))
    return jobs


def _identity(path: Path, known: dict) -> str:
    if ("file", path) not in known:
        known["file", path] = json.dumps(file_identity(path))
    return known["file", path]


def _row_elements(ckpt: Checkpoint, owner: dict, known: dict) -> list[dict[str, int]]:
    """Per rank, {row: its trainable elements on that rank} (padding excluded)."""
    key = ("layout", ckpt.layout)  # every checkpoint of a run has an equal one: worked out once
    if key not in known:
        per_rank = []
        for rank in range(ckpt.layout.world_size):
            counts: dict[str, int] = {}
            for s in ckpt.layout.slots:
                if (n := s.valid(rank)) and s.name in owner:
                    counts[owner[s.name]] = counts.get(owner[s.name], 0) + n
            per_rank.append(counts)
        known[key] = per_rank
    return known[key]


def compute_health(checkpoints: tuple[Checkpoint, ...], *, workers: int | None = None, emit: Emit = lambda e: None,
                   cancel: threading.Event | None = None, cache: Path | None = None,
                   options: TaskOptions = TaskOptions(), columns: list[int] | None = None,
                   rows: list[str] | None = None) -> Health:
    """Every cell of `columns` (default: all) of `checkpoints` (of `rows`, default all), newest first, from the cache
    where it holds them; `emit` gets progress and one CellsComputed per checkpoint. A cache
    that cannot be written is skipped (statistics still come out)."""
    cancel = cancel or threading.Event()
    health = Health(tuple(checkpoints), logs={i: training_log(c) for i, c in enumerate(checkpoints)})
    columns = sorted(range(len(checkpoints)) if columns is None else columns, reverse=True)
    known: dict = {}
    jobs = {c: stats_jobs(health.checkpoints, c, rows, known) for c in columns}
    found: dict[str, RankStats] = {}
    for job in (j for c in columns for j in jobs[c]):
        cached = _cached(cache, job.key)
        if cached is not None:
            found[job.key] = cached
    pending = {c: {j.key for j in jobs[c]} - found.keys() for c in columns}

    def finish(column: int) -> None:
        cells = reduce(health.checkpoints[column], [found[j.key] for j in jobs[column]], rows)
        health.add(column, cells)
        emit(CellsComputed(column, health.checkpoints[column].name, cells))

    todo = [j for c in columns for j in jobs[c] if j.key not in found]
    emit(StatsPlanned(len(columns), sum(len(j) for j in jobs.values()), len(found),
                      sum(j.bytes_to_read for j in todo)))
    for c in columns:
        if not pending[c]:
            finish(c)

    by_key = {j.key: j for j in todo}

    def emit_and_collect(event) -> None:
        if isinstance(event, RankStatsRead) and event.key in by_key and event.key not in found:
            job = by_key[event.key]
            found[job.key] = event.stats
            if event.stats.error is None:
                _store(cache, job.key, event.stats)
            pending[job.checkpoint].discard(job.key)
            if not pending[job.checkpoint]:
                finish(job.checkpoint)
        else:
            emit(event)

    if todo:  # one pool for all, fed newest first: cells come out checkpoint by checkpoint
        n = workers or workers_for(len(todo), STATS_WORKER)
        run_calls([(rank_stats, (j,)) for j in todo], n, emit_and_collect, cancel, options)
        if cancel.is_set():
            raise MergeCancelled("statistics cancelled")
    return health


def reduce(ckpt: Checkpoint, ranks: list[RankStats], rows: list[str] | None = None) -> dict[str, Cell]:
    """Add the ranks' sums of each row up into its cell."""
    errors = [r.error for r in ranks if r.error]
    if errors:
        held = [r.name for r in ckpt.rows if not r.tied and ckpt.holds(r.name) and (rows is None or r.name in rows)]
        return {row: Cell(0, None, None, None, False, errors[0]) for row in held}
    total: dict[str, RowSums] = {}
    for rank in ranks:
        for row, sums in rank.rows.items():
            total.setdefault(row, RowSums()).add(sums)
    cells = {}
    for row, s in total.items():
        healthy = s.nonfinite == 0
        rel = None
        if healthy and s.has_prev and s.prev_nonfinite == 0 and s.prev_sq > 0:
            rel = math.sqrt(s.diff_sq) / math.sqrt(s.prev_sq)
        cells[row] = Cell(s.nonfinite, rms(s.sumsq, s.count) if healthy else None,
                          s.v_max if healthy else None, rel, s.crc_ok)
    return cells


def _cache_file(cache: Path | None, key: str) -> Path | None:
    return None if cache is None else cache / "stats" / key[:2] / f"{key}.json"


def _cached(cache: Path | None, key: str) -> RankStats | None:
    path = _cache_file(cache, key)
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CACHED + 1)
        if len(text) > MAX_CACHED:
            return None
        data = json.loads(text)
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        return RankStats({row: RowSums.from_json(v) for row, v in data["rows"].items()})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # not cached, or not ours: computed again


def _store(cache: Path | None, key: str, result: RankStats) -> None:
    path = _cache_file(cache, key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "key": key,
                                   "rows": {row: s.to_json() for row, s in result.rows.items()}}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full cache: statistics are computed again next time
