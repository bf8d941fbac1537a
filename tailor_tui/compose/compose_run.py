"""The compose step: composes one checkpoint from a ComposePlan.

Each rank's files are composed by `rank_task.compose_rank` (in a worker process when there
are several workers, `workers`): the base's optim_states with the fp32 master weights, exp_avg and
exp_avg_sq of every row picked from another checkpoint replaced slice by slice, and
padding slots zeroed. Everything else in the rank files (optimizer `step` of every
sub-group, loss scaler, counters, scheduler) is the base's.

The output is built in a temporary folder beside the destination, checked, and
renamed into place only when complete: an interrupted composition leaves nothing at the
output path. Sources are only ever opened for reading.
"""

from __future__ import annotations

import os
import threading
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, cast

from tailor_tui.checked.files import FileIdentity, changed_error, open_regular, read_as_planned
from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.checkpoint import (
    ARCHIVES,
    COPIED,
    PROVENANCE,
    TAKEN,
    TAKEN_WEIGHTS,
    WEIGHT_HEADERS,
    read_latest,
)
from tailor_tui.compose.model_files import compose_model_file
from tailor_tui.compose.rank_task import compose_rank
from tailor_tui.compose.taken import FileComposed, RankComposed
from tailor_tui.errors import Cancelled, NonFiniteError, OutputError
from tailor_tui.events import Emit, TaskFinished, TaskOptions, progress_of, written_and_shared
from tailor_tui.fileio import copy_file, fsync_dir, output_error, write_file
from tailor_tui.formats.side_pickles import check_side_file
from tailor_tui.held import HeldFolder, HeldPath
from tailor_tui.planning.jobs import BinFileJob, RankJob, WeightJob
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.planning.provenance import plan_digest, provenance
from tailor_tui.planning.reads import jobs_to_run
from tailor_tui.resharding.partition import ReshardJob
from tailor_tui.resharding.skeleton import Skeleton, skeleton
from tailor_tui.team.members import SOLO, Team
from tailor_tui.team.transaction import Declaration, PublishingWork, Task, run_as_team
from tailor_tui.team.workers import worker_memory
from tailor_tui.units import size

# --- the task list -------------------------------------------------------------------------


def planned_tasks(plan: ComposePlan) -> list[tuple[str, int]]:
    """(task name, bytes it writes) of every task a composition will report, in order."""
    return progress_of((*plan.rank_jobs(), *plan.model_file_jobs()))


# --- the whole composition --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Composed:
    """What a composition wrote: its output folder, how long it took, what it wrote and shared, and what it
    relied on the run's statistics for (the writer's result, as the log and the composer tell it)."""

    output: Path
    seconds: float
    bytes_written: int
    peak_rss: int  # bytes: the largest peak resident memory of any process that composed a task
    nonfinite: dict = field(default_factory=dict)  # row -> NaN/Inf values it holds (--allow-nonfinite)
    bytes_shared: int = 0  # of bytes_written: bytes that share the base's blocks, not written (`cloning`)
    shared_how: str = ""  # how they share them ("reflink", "server-side copy"); "" where none do
    # the rows kept from the base in shared blocks were read and checked against their CRC-32s, their NaN/Inf
    # not counted again: the run's statistics had counted those very bytes (`RankJob.vouched`)
    kept_checked: bool = False
    # bytes of the sources' records the output takes from that were not read: only the blocks holding what
    # it takes were, each checked against the CRC-32 the run's statistics recorded (`source_blocks`)
    sources_unread: int = 0
    # the rows taken from the sources were found finite by the run's statistics: their NaN/Inf not counted again
    taken_checked: bool = False

    def amount(self) -> str:
        """What the output cost, as the log and the composer say it: its bytes written, or shared."""
        return written_and_shared(self.bytes_written, self.bytes_shared, self.shared_how)

    def unread(self) -> list[str]:
        """What this composition did not read or count again, the run's statistics having done it, a
        sentence each, as the log and the composer say it (none where it did all of it itself)."""
        said = []
        if self.kept_checked:
            said.append("the rows kept were read and checked against their CRC-32s, their NaN/Inf not counted "
                        "again: the run's statistics found those bytes finite")
        if self.taken_checked:
            said.append("the rows taken were found whole and finite by the run's statistics: their bytes checked "
                        "against their CRC-32s, their NaN/Inf not counted again")
        if self.sources_unread:
            said.append(f"reading only the sources' blocks the output takes from: {size(self.sources_unread)} of "
                        "their records not read, so not checked (the blocks read were checked against the CRC-32s "
                        "the run's statistics recorded)")
        return said


def run_compose(
    plan: ComposePlan,
    *,
    workers: int | None = None,
    emit: Emit = lambda event: None,
    cancel: threading.Event | None = None,
    options: TaskOptions = TaskOptions(),
    allow_nonfinite: bool = False,
    team: Team = SOLO,
    newest_finite: Callable[[ComposePlan, list[str]], dict[str, str]] | None = None,
) -> Composed:
    """Write the composed checkpoint described by `plan`; atomic, cancellable; fsynced
    before it is renamed into place unless `options.durable` is False (`--no-fsync`).
    An output that would hold NaN/Inf values is refused (NonFiniteError, nothing written)
    unless `allow_nonfinite`; the result says how many it holds either way. With a `team`
    of several processes (`--apply` under torchrun or srun), each writes its share of the
    rank files and model files into the one hidden folder process 0 made, and process 0
    checks the whole and renames it into place; a failure anywhere fails every process. `newest_finite`
    (`health.guard.newest_finite`, given by the front ends) names in a refusal where each row is finite.
    What each rank's task reads is decided once, before any starts (`planning.reads`)."""
    started = time.monotonic()
    jobs = jobs_to_run(plan, clone=options.clone, cache=cache_dir())
    work = Composing(plan, workers, options, allow_nonfinite, jobs, newest_finite)
    run_as_team(work, team=team, emit=emit, cancel=cancel, options=options)
    # what the plan counted (bytes_to_write): every file but the provenance record written last
    out = plan.output
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f != out / PROVENANCE)
    shared = bool(work.shared)
    vouched = [j.vouched for j in jobs if isinstance(j, RankJob)]
    return Composed(output=out, seconds=time.monotonic() - started, bytes_written=written, peak_rss=work.peak,
                    nonfinite=dict(work.nonfinite), bytes_shared=work.shared, shared_how=work.shared_how,
                    kept_checked=shared and any(0 in v for v in vouched), sources_unread=work.sources_unread,
                    taken_checked=shared and any(v - {0} for v in vouched))


MAX_NAMED = 8  # rows a refusal of non-finite values names in its one line; the rest are counted


def nonfinite_error(plan: ComposePlan, counts: Counter,
                    newest_finite: Callable[[ComposePlan, list[str]], dict[str, str]] | None, *,
                    doing: str = "compose") -> NonFiniteError:
    """The refusal of `plan`, whose output would hold `counts` non-finite values per row; `newest_finite`
    ({row: the newest checkpoint where it is finite}, from the run's statistics: `health.guard`) names
    where each such row is finite, where the caller has it; `doing`: "compose" or "export", what the advice
    says to do anyway."""
    suggestions = newest_finite(plan, list(counts)) if newest_finite is not None else None
    parts = []
    for row in list(counts)[:MAX_NAMED]:
        source = plan.sources[plan.picks[row]]
        hint = ""
        if suggestions is not None:
            found = suggestions.get(row)
            hint = f"; newest finite: {found}" if found else "; no finite checkpoint found"
        parts.append(f"{row} from {source.name} ({counts[row]:,} NaN/Inf{hint})")
    more = f" and {len(counts) - MAX_NAMED} more row(s)" if len(counts) > MAX_NAMED else ""
    return NonFiniteError(
        f"the output {plan.output} would hold non-finite values: {'; '.join(parts)}{more}; pick those "
        f"checkpoints (tailor-tui --heal RUN_DIR --recipe R.yaml does) or {doing} anyway with --allow-nonfinite")


def files_read(plan: ComposePlan, job) -> dict[Path, FileIdentity]:
    """The identity the plan recorded of each source file `job` reads (its checkpoints' when opened)."""
    if isinstance(job, (RankJob, ReshardJob)):
        paths = [f for files in job.files.values() for f in files.existing()]
    else:
        paths = [*(() if job.base_file is None else (job.base_file,)), *job.source_paths()]
    return plan.identities_of(paths)


class Composing(PublishingWork):
    """A composition's stages (`transaction`): process 0 makes the hidden folder with the
    base's other files; each process writes its share of the rank files and weight files
    into it; process 0 checks the whole, writes the provenance record and renames it into place."""

    cancelled = Cancelled().args[0]
    finished = ("cancelled as the composition finished: {output} is complete and holds the new composition "
                "(check it with --verify)")

    def __init__(self, plan: ComposePlan, workers: int | None, options: TaskOptions, allow_nonfinite: bool,
                 jobs: tuple, newest_finite=None):
        super().__init__(plan.output, plan.force, options)
        self.plan, self.allow_nonfinite, self.workers_asked = plan, allow_nonfinite, workers
        self.jobs = jobs  # the rank jobs as their tasks run them (`planning.reads.jobs_to_run`)
        self.newest_finite = newest_finite  # where a refused row is finite (`nonfinite_error`), or None
        self.rank_call: Callable[..., RankComposed]
        if plan.reshard is not None:  # (its module imported only where it is used, as bin_files' below)
            from tailor_tui.compose.rank_reshard import reshard_rank

            self.rank_call = reshard_rank
        else:
            self.rank_call = compose_rank
        self.peak, self.shared, self.shared_how, self.sources_unread = 0, 0, "", 0
        self.nonfinite: Counter = Counter()
        self.taken: dict[str, dict] = {}  # rank -> what its files took (`compose.taken`), as gathered
        self.weights: dict[str, dict] = {}  # model file -> what it took (`compose.taken`), as gathered
        self.copied: dict[str, int] = {}  # the base's files copied (process 0's): output path -> CRC-32
        # rank file or torch-format weight file (output path) -> its records' listing's CRC-32, as gathered
        self.archives: dict[str, int] = {}
        self.headers: dict[str, int] = {}  # safetensors weight file -> its header's CRC-32, as gathered
        self.reports: list[dict] = []  # every process's, as gathered

    def begin(self) -> Declaration:
        plan = self.plan
        return Declaration(digest=lambda: plan_digest(plan), progress=planned_tasks(plan),
                           workers=self.workers_asked, worker_memory=worker_memory(plan))

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        self.copied = _fill(self.plan, tmp, cancel, self.durable)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        held = self.folder(shared)
        tag_dir = held / self.plan.base.tag
        rank_args: tuple[HeldPath] | tuple[HeldPath, Skeleton] = (tag_dir,)
        if self.plan.reshard is not None:  # the structure every output rank file shares: made once, here
            rank_args = (tag_dir, skeleton(self.plan.base, self.plan.sources, self.plan.buffer_sources(),
                                           self.plan.reshard, self.plan.keys))
        planned = self.plan
        return [*(Task(read_as_planned, job, (self.rank_call, files_read(planned, job), *rank_args))
                  for job in self.jobs),
                *(Task(read_as_planned, job, (_weight_writer(job), files_read(planned, job), held))
                  for job in planned.model_file_jobs())]

    def observe(self, event, emit: Emit) -> bool:
        if isinstance(event, TaskFinished):
            self.peak = max(self.peak, event.peak_rss)
            self.shared += event.shared
            self.shared_how = self.shared_how or event.shared_how
            self.sources_unread += event.sources_unread
        return False

    def report(self, mine: list[Task], results: list, lead: bool) -> dict:
        nonfinite = sum((r.nonfinite for r in results if isinstance(r, RankComposed)), Counter())
        taken = {str(r.rank): r.taken for r in results if isinstance(r, RankComposed)}
        archives = {f"{self.plan.base.tag}/{name}": crcs for r in results if isinstance(r, RankComposed)
                    for name, crcs in r.archives.items()}
        weights = {r.name: r.taken for r in results if isinstance(r, FileComposed)}
        headers = {r.name: r.header for r in results if isinstance(r, FileComposed) and r.header is not None}
        archives |= {r.name: r.archive for r in results if isinstance(r, FileComposed) and r.archive is not None}
        names, tmp = self.plan.output_rank_files(), self.tmp
        assert tmp is not None, "folder() named it before any task ran"
        ranks = [t.job for t in mine if isinstance(t.job, (RankJob, ReshardJob))]
        files = [f"{self.plan.base.tag}/{name}" for job in ranks for name in names[job.rank]]
        files += [cast(WeightJob, t.job).name for t in mine if not isinstance(t.job, (RankJob, ReshardJob))]
        return {"nonfinite": dict(nonfinite), "peak": self.peak, "shared": self.shared, "how": self.shared_how,
                "unread": self.sources_unread, "files": {f: _size_of(tmp / f) for f in files}, "taken": taken,
                "weights": weights, "headers": headers, "archives": archives}

    def gathered(self, reports: list, lead: bool, emit: Emit) -> None:
        self.nonfinite = sum((Counter(d["nonfinite"]) for d in reports), Counter())
        self.peak = max(d["peak"] for d in reports)
        self.shared = sum(d["shared"] for d in reports)
        self.shared_how = next((d["how"] for d in reports if d["how"]), "")
        self.sources_unread = sum(d["unread"] for d in reports)
        self.taken = {rank: rows for d in reports for rank, rows in d["taken"].items()}
        self.weights = {name: crcs for d in reports for name, crcs in d["weights"].items()}
        self.archives = {name: crcs for d in reports for name, crcs in d["archives"].items()}
        self.headers = {name: crc for d in reports for name, crc in d["headers"].items()}
        self.reports = reports

    def publish(self) -> None:
        plan, tmp, held = self.plan, self.tmp, self.hidden
        assert tmp is not None and held is not None, "folder() named it before any task ran"
        _confirm_sizes(tmp, self.reports)
        if self.nonfinite and not self.allow_nonfinite:
            raise nonfinite_error(plan, self.nonfinite, self.newest_finite)
        verify_output(plan, tmp)
        fsync_dir(held / plan.base.tag, self.durable)
        self.publish_folder(provenance(plan) | {TAKEN: dict(sorted(self.taken.items(), key=lambda kv: int(kv[0]))),
                                                TAKEN_WEIGHTS: dict(sorted(self.weights.items())),
                                                COPIED: dict(sorted(self.copied.items())),
                                                ARCHIVES: dict(sorted(self.archives.items())),
                                                WEIGHT_HEADERS: dict(sorted(self.headers.items()))})


def _weight_writer(job):
    """The writer of a weight file's job: torch's format or safetensors (torch's writer imported only
    where a composition has such a file: ~5 ms of every start otherwise)."""
    if isinstance(job, BinFileJob):
        from tailor_tui.compose.bin_files import compose_bin_file

        return compose_bin_file
    return compose_model_file


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise output_error(exc, path) from None


def _confirm_sizes(tmp: Path, done: list[dict]) -> None:
    """Every file each process wrote has, seen from here, the size it had there: on a shared
    file system that lost or has not yet shown a write, the job fails instead of publishing."""
    for process, record in enumerate(done):
        for rel, length in record["files"].items():
            seen = (tmp / rel).stat().st_size if (tmp / rel).is_file() else None
            if seen != length:
                raise OutputError(f"{tmp / rel}: process {process} wrote {length} bytes, process 0 sees "
                                  f"{'no file' if seen is None else f'{seen} bytes'}; the shared file system "
                                  "does not show every process the same files: compose on one that does")


def _fill(plan: ComposePlan, tmp: HeldFolder, cancel: threading.Event, durable: bool) -> dict[str, int]:
    """The hidden folder the output is composed in gets the base's other files, `latest` and
    the model-file index (process 0 of a job fills it; the others write into it). Returns the CRC-32
    of each file copied from the base, by its path in the output."""
    (tmp / plan.base.tag).mkdir()
    copied = _copy_other_files(plan, tmp, cancel, durable)
    for name, text in plan.own_files().items():
        write_file(tmp / name, text, durable)
    return copied


def _copy_other_files(plan: ComposePlan, tmp: HeldFolder, cancel: threading.Event, durable: bool) -> dict[str, int]:
    root, copied = plan.other_files_root(), {}
    for rel, to in plan.other_files():
        if cancel.is_set():
            raise Cancelled()
        dst = tmp / to
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(exc, dst.parent) from None
        copied[str(to)] = copy_run_file(root / rel, dst, plan.base.path.parent, durable)
    return copied


def copy_run_file(src: Path, dst: HeldPath, run: Path, durable: bool) -> int:
    """A run-level file of the base copied into the output, checked as torch reads it (scheduler.pt,
    rng_state_*.pth, training_args.bin: `side_pickles`) through the one descriptor the copy reads, the
    file's identity the same (fstat) from before the check to after the copy: the bytes checked are the
    bytes copied. Returns their CRC-32."""
    fd = open_regular(src, within=run)  # (no link out of the run; NotRegular: a FIFO or a device)
    try:
        before = FileIdentity.of(os.fstat(fd))
        check_side_file(src, fd=fd)
        try:
            value = copy_file(src, dst, durable=durable, crc=True, opened=fd)
        except OSError as exc:
            raise output_error(exc, dst) from None
        now = FileIdentity.of(os.fstat(fd))
        if now != before:
            raise changed_error(src, before, now, "while it was checked and copied")
    finally:
        os.close(fd)
    assert value is not None, "copy_file(crc=True) returns the CRC-32"
    return value


def verify_output(plan: ComposePlan, root: Path) -> None:
    """Check the composed folder before it is moved into place: every file there and whole."""
    tag_dir = root / plan.base.tag
    latest = read_latest(root)
    if latest != plan.base.tag:
        raise OutputError(f"{root}/latest names '{latest}', expected '{plan.base.tag}' (internal error)")
    for names in plan.output_rank_files():
        for name in names:
            out = tag_dir / name
            if not out.is_file() or not zipfile.is_zipfile(out):
                raise OutputError(f"{out}: missing or incomplete after the composition (internal error)")
    for job in plan.model_file_jobs():
        if not (root / job.name).is_file():
            raise OutputError(f"{root / job.name}: missing after the composition (internal error)")
