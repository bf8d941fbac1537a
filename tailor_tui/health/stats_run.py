"""Health statistics of a scanned run: which rank files to read, the cache, adding ranks up.

Checkpoints are read newest first (the decision is usually about the newest ones), each
rank in a worker process (`stats_rank`). Each rank's sums, and each checkpoint's cells (its
ranks' sums added up), are cached outside the run (`cache.cache_dir()`), keyed by the identity
of every file read: a second look at the same run reads nothing. `CellsComputed` events carry
each checkpoint's cells as soon as all its ranks are in, so front ends fill in progressively.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from tailor_tui.checked.crc import BLOCK
from tailor_tui.checked.files import PlannedFiles
from tailor_tui.checkpoints import file_facts
from tailor_tui.checkpoints.cache import entry, identity_key, read_json, write_json
from tailor_tui.checkpoints.checkpoint import Checkpoint, distinct_names
from tailor_tui.events import Emit, TaskOptions
from tailor_tui.health.healing import Cell, Health, rms, training_log
from tailor_tui.health.stats_job import RankStats, RankStatsRead, RowSums, SlotTable, StatsJob
from tailor_tui.team.members import SOLO, Team
from tailor_tui.team.transaction import Declaration, Task, TeamWork, run_as_team

# of the cached sums and cells: bump when what they mean changes (4: a multimodal model's rows per stack; 5: the
# ranks' block CRC-32s are recorded beside them, `file_facts`: sums cached before are read once more to record them;
# 6: the rows found finite are recorded beside the blocks; 7: every state the optimizer keeps per element is counted,
# `v max` is of its second moment or momentum, whatever the optimizer: `ds_format.health_state`)
FORMAT = 7
MAX_CACHED = 16 << 20  # a cache file larger than this is not one of ours
STATS_WORKER = 64 << 20  # interpreter, numpy, two 1 MiB buffers and a chunk's float64 copies


@dataclass(frozen=True)
class StatsPlanned:
    """What computing statistics will read: `to_read` bytes of `ranks` files (`files`: what they are) not cached."""

    checkpoints: int
    ranks: int
    cached_ranks: int
    to_read: int
    files: str = "rank file(s)"


@dataclass(frozen=True)
class CellsComputed:
    """Every cell of checkpoint `column` is known (emitted as each checkpoint completes)."""

    column: int
    name: str  # the checkpoint's folder name
    cells: dict  # {row: Cell}


def previous_holders(checkpoints: tuple[Checkpoint, ...], column: int) -> dict[str, int]:
    """{row: the nearest earlier checkpoint holding it with the same layout} for `column`."""
    ckpt, found = checkpoints[column], {}
    same: dict[int, bool] = {}  # layouts compared once per checkpoint, not per row
    for row in ckpt.rows:
        if row.tied or not ckpt.holds(row.name):
            continue
        for j in reversed(range(column)):
            other = checkpoints[j]
            if not other.holds(row.name):
                continue
            if j not in same:
                same[j] = other.layout == ckpt.layout
            if same[j]:
                found[row.name] = j
                break
    return found


def stats_jobs(checkpoints: tuple[Checkpoint, ...], column: int, rows: list[str] | None = None,
               known: dict | None = None, *, crc_block: int = BLOCK) -> list[StatsJob]:
    """One job per rank of checkpoint `column`: the rows it holds (of `rows`, default all), and
    their previous checkpoints. The cache key names what is read (the identity of every file,
    the rank, the rows); the slices to read are worked out in the worker, so a run whose
    statistics are cached costs a stat() per file. `known` memoises identities and layouts
    across calls. `crc_block`: the size of the blocks whose CRC-32s are recorded (`file_facts`)."""
    known = {} if known is None else known
    ckpt = checkpoints[column]
    prev = previous_holders(checkpoints, column)
    owner = ckpt.param_to_row()
    held = frozenset(r.name for r in ckpt.rows
                     if not r.tied and ckpt.holds(r.name) and (rows is None or r.name in rows))
    frozen = tuple((owner[name], name) for name, _ in ckpt.layout.frozen if owner.get(name) in held)
    elements = row_elements(ckpt, owner, known)
    table = SlotTable.of(ckpt.layout, owner, held)  # shared by every rank's job
    if "labels" not in known:
        known["labels"] = distinct_names([c.path for c in checkpoints])
    label = known["labels"][column]
    jobs = []
    for rank, files in enumerate(ckpt.ranks):
        mine = {row: n for row, n in elements[rank].items() if row in held}
        prev_files = tuple((row, checkpoints[prev[row]].ranks[rank]) for row in sorted(mine) if row in prev)
        read = ckpt.sizes.get(files.state_file, 0)  # whole records are read whole
        if not files.whole_records:  # slices: the share of the rows file that the rows read
            read = read * sum(mine.values()) // (sum(n for row, n in elements[rank].items() if ckpt.holds(row)) or 1)
        read += sum(mine[row] * 4 for row, _ in prev_files)
        by_source: dict[int, list[str]] = {}  # previous checkpoint -> its rows read
        for row, _ in prev_files:
            by_source.setdefault(prev[row], []).append(row)
        previous: dict[str, list[str]] = {}  # a previous file's identity -> its rows read
        for j, names in by_source.items():
            f = checkpoints[j].ranks[rank]
            previous.setdefault(_identity(f.state_file, known), []).extend(names)
        key = hashlib.sha256(json.dumps([FORMAT, rank, [_identity(p, known) for p in files.existing()],
                                         sorted(held), sorted(previous.items())]).encode()).hexdigest()
        jobs.append(StatsJob(key, column, label, rank, files, ckpt.layout, owner, held, frozen, prev_files, read,
                             table, crc_block))
    return jobs


def cached_cells(checkpoints: tuple[Checkpoint, ...], column: int, cache: Path | None) -> dict[str, Cell] | None:
    """Checkpoint `column`'s cells (every row) as the statistics of `checkpoints` cached them, no rank
    file read (a stat() per file: the keys name every file's identity); None where not cached whole."""
    return _cached_cells(cache, stats_jobs(checkpoints, column))


def _identity(path: Path, known: dict) -> str:
    if ("file", path) not in known:
        known["file", path] = identity_key(path, known.setdefault("folders", {}))
    return known["file", path]


def row_elements(ckpt: Checkpoint, owner: dict, known: dict) -> list[dict[str, int]]:
    """Per rank, {row: its trainable elements on that rank} (padding excluded; shared, read-only)."""
    key = ("layout", ckpt.layout)  # every checkpoint of a run has an equal one: worked out once
    if key not in known:
        layout, held, per_rank = ckpt.layout, {}, []
        for rank in range(layout.world_size):  # ranks holding the same elements share one count
            group = layout.same_holdings(rank)
            if group not in held:
                counts: dict[str, int] = {}
                for s in layout.slots:
                    if (n := s.valid(rank)) and (row := owner.get(s.name)) is not None:
                        counts[row] = counts.get(row, 0) + n
                held[group] = counts
            per_rank.append(held[group])
        known[key] = per_rank
    return known[key]


def compute_health(checkpoints: tuple[Checkpoint, ...], *, workers: int | None = None, emit: Emit = lambda e: None,
                   cancel: threading.Event | None = None, cache: Path | None = None,
                   options: TaskOptions = TaskOptions(), columns: list[int] | None = None,
                   rows: list[str] | None = None, team: Team = SOLO, crc_block: int = BLOCK) -> Health:
    """Every cell of `columns` (default: all) of `checkpoints` (of `rows`, default all), newest first, from the cache
    where it holds them; `emit` gets progress and one CellsComputed per checkpoint. A cache
    that cannot be written is skipped (statistics still come out). With a `team` of several
    processes (`--stats` under torchrun or srun), each reads its share of the rank files and
    process 0 adds them all up: only its Health holds every cell. The CRC-32 of every `crc_block` bytes
    of each record read is cached too (`file_facts`; tests make the blocks smaller than their records)."""
    work = ReadingStatistics(checkpoints, workers=workers, cache=cache, columns=columns, rows=rows,
                             crc_block=crc_block)
    run_as_team(work, team=team, emit=emit, cancel=cancel, options=options)
    return work.health


class ReadingStatistics(TeamWork[Health]):
    """Statistics' stages (`transaction`): every process lists the rank files to read and looks
    them up in its cache; process 0's cache decides what is read (another's may have filled
    meanwhile); each process reads its share; process 0 adds every checkpoint's ranks up."""

    what = "run"
    cancelled = "statistics cancelled"

    def __init__(self, checkpoints: tuple[Checkpoint, ...], *, workers: int | None, cache: Path | None,
                 columns: list[int] | None, rows: list[str] | None, crc_block: int = BLOCK):
        self.health = Health(tuple(checkpoints), logs={i: training_log(c) for i, c in enumerate(checkpoints)})
        self.cache, self.rows, self.workers_asked, self.crc_block = cache, rows, workers, crc_block
        self.columns = sorted(range(len(checkpoints)) if columns is None else columns, reverse=True)
        self.jobs: dict[int, list[StatsJob]] = {}  # per column, one per rank (`begin`)
        self.every: dict[str, StatsJob] = {}
        self.added_up: dict[int, dict | None] = {}  # a checkpoint's cells, where the cache holds them whole
        self.found: dict[str, RankStats] = {}  # each rank's sums, cached or read
        self.pending: dict[int, set[str]] = {}  # per column, the ranks still to read
        self.reading: dict[str, StatsJob] = {}  # the jobs read by this job's processes
        self.known: dict = {}  # the files' identities (and layouts) as planning saw them, before any read

    def begin(self) -> Declaration:
        cache, rows = self.cache, self.rows
        known = self.known
        self.jobs = {c: stats_jobs(self.health.checkpoints, c, rows, known, crc_block=self.crc_block)
                     for c in self.columns}
        self.every = {j.key: j for c in self.columns for j in self.jobs[c]}
        self.added_up = {c: _cached_cells(cache, self.jobs[c]) for c in self.columns}
        for c in (c for c in self.columns if self.added_up[c] is None):
            ranks = _cached_ranks(cache, self.health.checkpoints[c])
            self.found.update((j.key, ranks[j.key]) for j in self.jobs[c] if j.key in ranks)
        self.pending = {c: set() if self.added_up[c] is not None else {j.key for j in self.jobs[c]} - self.found.keys()
                        for c in self.columns}
        every = sorted(self.every)
        return Declaration(digest=lambda: hashlib.sha256(json.dumps(every).encode()).hexdigest(),
                           workers=self.workers_asked, worker_memory=STATS_WORKER)

    def prepare(self, cancel: threading.Event) -> str:
        todo = [j.key for c in self.columns if self.added_up[c] is None for j in self.jobs[c] if j.key not in self.found]
        return json.dumps(todo)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        todo = [self.every[k] for k in json.loads(shared)]
        self.reading = {j.key: j for j in todo}
        whole = sum(len(self.jobs[c]) for c in self.columns if self.added_up[c] is not None)
        emit(StatsPlanned(len(self.columns), len(self.every), whole + len(self.found),
                          sum(j.total_bytes for j in todo)))
        for c in self.columns:
            if not self.pending[c]:
                self._finish(c, emit)
        if not todo:
            return []
        known = {f: i for c in self.health.checkpoints for f, i in c.identities.items()}
        return [Task(read_rank, j, ({f: known[f] for f in j.files_read() if f in known},))
                for j in todo]  # numpy is loaded where ranks are read, not here

    def observe(self, event, emit: Emit) -> bool:
        if not isinstance(event, RankStatsRead):
            return False
        self._collect(event.key, event.stats, emit)
        return True

    def report(self, mine: list[Task], results: list, lead: bool) -> dict:
        if lead:  # process 0 adds every checkpoint up: what it read itself, it holds
            return {}
        jobs = [cast(StatsJob, t.job) for t in mine]  # the tasks `tasks` made
        return {j.key: _stats_json(self.found[j.key]) for j in jobs}

    def gathered(self, reports: list, lead: bool, emit: Emit) -> None:
        if lead:  # the others' ranks: process 0 adds every checkpoint up
            for theirs in reports[1:]:
                for key, value in theirs.items():
                    self._collect(key, _stats_from_json(value), emit)

    def publish(self) -> Health:
        return self.health

    def _collect(self, key: str, stats: RankStats, emit: Emit) -> None:
        job = self.reading.get(key)
        if job is None or key in self.found:
            return
        self.found[key] = stats
        self.pending[job.checkpoint].discard(key)
        if not self.pending[job.checkpoint]:
            self._finish(job.checkpoint, emit)

    def _finish(self, column: int, emit: Emit) -> None:
        cells = self.added_up[column]
        if cells is None:
            ranks = [self.found[j.key] for j in self.jobs[column]]
            cells = reduce(self.health.checkpoints[column], ranks, self.rows)
            if not any(r.error for r in ranks):
                _store_ranks(self.cache, self.health.checkpoints[column], {j.key: self.found[j.key]
                                                                           for j in self.jobs[column]})
                _store_cells(self.cache, self.jobs[column], cells)
                self._store_facts(column)
        self.health.add(column, cells)
        emit(CellsComputed(column, self.health.checkpoints[column].name, cells))

    def _store_facts(self, column: int) -> None:
        """Cache what the statistics established of the rank files of `column` read now (`file_facts`: each
        record's block CRC-32s, the rows found whole and finite), under each file's identity as planning
        saw it before reading it (a file changed since has another: its facts are never taken for it);
        those cached before of its files not read again are kept."""
        by_folder: dict[str, tuple[dict, set]] = {}
        for j in self.jobs[column]:
            main = j.files.state_file
            read, current = by_folder.setdefault(file_facts.folder_key(main), ({}, set()))
            ident = _identity(main, self.known)
            current.add(ident)
            if j.key in self.reading:
                read[ident] = _facts(self.found[j.key], main, j.files.existing(), self.known)
        for folder, (read, current) in by_folder.items():
            if read:
                file_facts.store(self.cache, folder=folder, read=read, current=current)


def _facts(stats: RankStats, main: Path, files: tuple[Path, ...], known: dict) -> file_facts.FileFacts:
    """What a rank's statistics establish of its file `main`: the block CRC-32s of its records, and the rows
    they found whole and finite, which hold while the rank's other `files` (beside it) keep their identity."""
    others = [f for f in files if f != main]
    if stats.error or any(f.parent != main.parent for f in others):
        return file_facts.FileFacts(stats.blocks, frozenset())
    finite = frozenset(row for row, s in stats.rows.items() if s.nonfinite == 0 and s.crc_ok)
    return file_facts.FileFacts(stats.blocks, finite, tuple((f.name, _identity(f, known)) for f in others))


def _stats_json(stats: RankStats) -> dict:
    return {"rows": {row: s.to_json() for row, s in stats.rows.items()}, "error": stats.error,
            "blocks": file_facts.blocks_to_json(stats.blocks)}


def _stats_from_json(value: dict) -> RankStats:
    try:
        blocks = file_facts.blocks_from_json(value.get("blocks", {}))
    except (ValueError, TypeError):
        blocks = {}  # not recorded: a composition reads those records whole
    return RankStats({row: RowSums.from_json(v) for row, v in value["rows"].items()}, value["error"], blocks)


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


def _ranks_key(ckpt: Checkpoint) -> str:
    """A checkpoint's ranks' sums are one cache entry (O(checkpoints) entries, not O(rank files)),
    found by its folder; each rank's sums in it are taken only under that rank's own key (the
    identity of every file it read), so a changed rank file is read again, the others not."""
    return hashlib.sha256(json.dumps([FORMAT, "ranks", os.path.realpath(ckpt.path)]).encode()).hexdigest()


def _cached_ranks(cache: Path | None, ckpt: Checkpoint) -> dict[str, RankStats]:
    key = _ranks_key(ckpt)
    data = read_json(entry(cache, "ranks", key), MAX_CACHED)
    try:
        if data.get("format") != FORMAT or data.get("key") != key:
            return {}
        return {k: RankStats({row: RowSums.from_json(v) for row, v in rows.items()})
                for k, rows in data["ranks"].items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}  # not cached, or not ours: computed again


def _store_ranks(cache: Path | None, ckpt: Checkpoint, ranks: dict[str, RankStats]) -> None:
    # a read-only or full cache is skipped: statistics are computed again next time
    key = _ranks_key(ckpt)
    write_json(entry(cache, "ranks", key), {"format": FORMAT, "key": key, "ranks": {
        k: {row: s.to_json() for row, s in stats.rows.items()} for k, stats in ranks.items()}})


def _cells_key(jobs: list[StatsJob]) -> str:
    """A checkpoint's cells are its ranks' sums added up: keyed by what every rank read."""
    return hashlib.sha256(json.dumps([FORMAT, [j.key for j in jobs]]).encode()).hexdigest()


def _cached_cells(cache: Path | None, jobs: list[StatsJob]) -> dict[str, Cell] | None:
    key = _cells_key(jobs)
    data = read_json(entry(cache, "cells", key), MAX_CACHED)
    try:
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        held = frozenset().union(*(j.rows for j in jobs))
        cells = {row: Cell.from_json(v) for row, v in data["cells"].items()}
        return cells if cells.keys() <= held else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # not cached, or not ours: added up again


def _store_cells(cache: Path | None, jobs: list[StatsJob], cells: dict[str, Cell]) -> None:
    key = _cells_key(jobs)
    write_json(entry(cache, "cells", key), {"format": FORMAT, "key": key,
                                            "cells": {row: c.to_json() for row, c in cells.items()}})


def read_rank(job: StatsJob, identities: dict, emit: Emit, cancelled, options: TaskOptions = TaskOptions()) -> RankStats:
    """A statistics task: `stats_rank.rank_stats`, imported where the task runs (the process that plans the
    tasks and starts the workers does without numpy, its 60 ms, so they can be forked), reading only the
    files the scan recorded (`identities`: each file's identity when its checkpoint was opened, compared by
    fstat before and after the task reads, `checked.files.PlannedFiles`): sums of a checkpoint that training
    saved again meanwhile are refused in one line (exit 4), never cached under its old identity."""
    from tailor_tui.health.stats_rank import rank_stats

    with PlannedFiles(identities, "since the run was scanned"):
        return rank_stats(job, emit, cancelled, options)
