"""Re-check a finished output against its recipe and sources, row by row, byte for byte.

Every comparison is of bytes, not values: -0.0 is not 0.0, a NaN equals the same NaN
(so a row that holds NaNs verifies when it was copied exactly). For every rank, each
row's fp32 master weights, exp_avg and exp_avg_sq in the output equal its chosen
source's and padding is zero bytes; everything else in the optimizer state (param
groups, loss scaler, sub-group steps, counters) and in model_states equals the base's,
but frozen fragments and buffers, which follow their row; the weight files have the
header tailor-tui writes and each tensor of the chosen source (`weights`); every other
file equals the base's. Every record of every torch file read, the output's and the
sources', is checked against its stored CRC-32 on the way, every slice of a partial checkpoint
against the CRC-32 its save recorded. Sources are only read, never modified.

What the output must hold, byte range by byte range, is worked out from the plan's picks and each
checkpoint's layout (`zero_ranks`, `resharded`, `weights`), none of the writers' lookups used, so a
bug there is caught here, not repeated; every file is read once, streamed (`rank_claims`,
`streamed`), the ranks' claims some at a time (`MAX_CLAIMS`), shares of a wide run's ranks in worker processes
(`verify_ranks`: a rank's claims are its own).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.checkpoint import (
    ARCHIVES,
    COPIED,
    MODEL_FILE_INDEX,
    PROVENANCE,
    TAKEN,
    TAKEN_WEIGHTS,
    WEIGHT_HEADERS,
    Checkpoint,
    open_checkpoint,
    read_latest,
)
from tailor_tui.checkpoints.side_files import MAX_RECORD, read_small
from tailor_tui.errors import CheckpointError
from tailor_tui.events import Emit, TaskOptions
from tailor_tui.formats.ptfile import zip_records
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.planning.provenance import changed_since, read_record
from tailor_tui.team.workers import STREAMING_WORKER, run_calls, workers_for
from tailor_tui.verifying.rank_claims import RankClaims, Tag
from tailor_tui.verifying.recorded import (
    Archives,
    recorded,
    recorded_crcs,
    recorded_weights,
)
from tailor_tui.verifying.resharded import ReshardedRanks
from tailor_tui.verifying.rows_files import RowsFiles
from tailor_tui.verifying.weights import WeightRecord, claim_weight_file
from tailor_tui.verifying.zero_ranks import ZeroRanks

COPIED_LABEL = "run-level files"  # the progress of reading the files copied from the base

# claims held at once (a wide run's ranks are tens of thousands each): past it, those made are run, then the next
# ranks' made (a source file several output ranks take from may then be read once per batch)
MAX_CLAIMS = 20_000
# ranks a worker process takes at the least: fewer, and they are verified in this process. A rank of a wide run costs
# ~12 ms of reading its files' structures (per record, not per byte); a process, its start and a first full read of
# each file layout it meets
RANKS_PER_PROCESS = 16


@dataclass
class VerifyReport:
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # row -> problems
    other: list[str] = field(default_factory=list)  # problems not tied to a row
    # sources that changed since the composition (its provenance record tells them), a line each: the
    # output's rows are proven against the CRC-32s of what was taken instead (`taken`)
    changed: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)  # what was not compared, as it comes from those
    by_record: set[str] = field(default_factory=set)  # rows proven against the record alone (on some rank)

    @property
    def ok(self) -> bool:
        return not self.other and not any(self.problems.values()) and not self.changed and not self.unproven

    @property
    def output_ok(self) -> bool:
        """Nothing found wrong with the output (its sources may have changed since: `changed`)."""
        return not self.other and not any(self.problems.values())

    def add(self, row: str | None, problem: str) -> None:
        (self.other if row is None else self.problems[row]).append(problem)

    def changed_in_place(self, line: str) -> None:
        if line not in self.changed:
            self.changed.append(line)

    def merge(self, other: VerifyReport) -> None:
        """`other`'s findings (some ranks', found in a worker process) after this one's."""
        for row, problems in other.problems.items():
            self.problems[row].extend(problems)
        self.other.extend(other.other)
        for line in other.changed:
            self.changed_in_place(line)
        self.unproven += [line for line in other.unproven if line not in self.unproven]
        self.by_record |= other.by_record


@dataclass(frozen=True, kw_only=True)
class RanksVerifying:
    """What the claims on any of the output's ranks need, picklable: given each worker process once
    (`team.workers.run_calls`' `common`), apart from the shares of ranks it takes. `changed`: the plan's sources
    found changed since the composition (not read: the record proves their rows); `taken`, `listings`: what the
    provenance record holds (`recorded`)."""

    plan: ComposePlan
    composed: Checkpoint
    changed: frozenset[int]
    taken: dict | None
    listings: dict[str, int] | None
    threads: int  # reading threads


@dataclass(frozen=True)
class RankShare:
    """Some of the output's ranks to verify, in a worker process or this one; `total_bytes`: their rank files',
    its share of the work (what `team.workers` batches by)."""

    ranks: tuple[int, ...]
    total_bytes: int


@dataclass(frozen=True)
class RanksVerified:
    report: VerifyReport
    failed: tuple[str, ...]  # the output's files whose records are not those the composition wrote (`Archives`)


def verify_ranks(verifying: RanksVerifying, job: RankShare, emit: Emit, cancelled: Callable[[], bool],
                 _options: TaskOptions) -> RanksVerified:
    """The claims on the ranks of `job`, made and run some ranks at a time (`MAX_CLAIMS`), and what they found
    (a `team.workers` call)."""
    plan, report = verifying.plan, VerifyReport()
    archives = Archives(verifying.listings, plan.output, plan.base.tag)
    first = _kind(plan)(plan, report, changed=set(verifying.changed), taken=verifying.taken, archives=archives)
    _claimed_and_checked(first, verifying, job, emit, cancelled)
    return RanksVerified(report, tuple(archives.failed))


def _claimed_and_checked(first: RankClaims, verifying: RanksVerifying, job: RankShare, emit: Emit,
                         cancelled: Callable[[], bool]) -> None:
    """The claims on the ranks of `job`, made into `first` (which may hold others already) and the batches after
    it, each checked once it holds `MAX_CLAIMS`; what they find goes to `first`'s report."""
    ranks, kind = first, type(first)
    with _collected_per_batch() as batch_done:
        for i, rank in enumerate(job.ranks):
            ranks.add(rank, verifying.composed)
            if ranks.held() > MAX_CLAIMS and i + 1 < len(job.ranks):  # memory: the claims of some ranks at a time
                ranks.check(emit, cancelled, verifying.threads)
                batch_done(ranks)
                # (`changed` is shared: a source found changed in place is not read again)
                ranks = kind(first.plan, first.report, changed=first.changed, taken=first.taken,
                             archives=first.archives)
        ranks.check(emit, cancelled, verifying.threads)
        batch_done(ranks)


@contextlib.contextmanager
def _collected_per_batch():
    """Python's cycle collector held back while claims are made, and run once a batch is checked (the function
    yielded: it drops the batch): a wide run's claims are hundreds of thousands of small objects, which it walked
    again and again as they were made (a third of the time)."""
    enabled = gc.isenabled()
    gc.disable()

    def done(batch: RankClaims) -> None:
        batch.drop()  # (its tags' problems refer back to it: freed now, not walked by the collector)
        gc.collect(0)  # (held back, every object made since is in the youngest generation)

    try:
        yield done
    finally:
        if enabled:
            gc.enable()


def _kind(plan: ComposePlan) -> type[RankClaims]:
    return ReshardedRanks if plan.reshard is not None else ZeroRanks


def _rank_jobs(plan: ComposePlan, composed: Checkpoint, *, workers: int,
               ranks_per_process: int) -> tuple[list[RankShare], int]:
    """The output's ranks in consecutive shares, and how many processes take them: this one where the ranks are
    too few to be worth a process each (`ranks_per_process`), else two shares per worker process (a share that
    takes longer evens out)."""
    processes = 1 if workers <= 1 else min(workers, workers_for(plan.world_size // max(1, ranks_per_process),
                                                                STREAMING_WORKER))
    shares = 1 if processes <= 1 else min(plan.world_size, 2 * processes)
    cut = [plan.world_size * i // shares for i in range(shares + 1)]
    return [RankShare(tuple(range(a, b)), sum(composed.rank_bytes(rank) for rank in range(a, b)))
            for a, b in zip(cut, cut[1:])], processes


class _Cancel(threading.Event):
    """A caller's cancel test as the flag `team.workers` takes (which a Ctrl-C during the pool sets too)."""

    def __init__(self, asked: Callable[[], bool]):
        super().__init__()
        self._asked = asked

    def is_set(self) -> bool:
        return super().is_set() or self._asked()


def verify_against_recipe(plan: ComposePlan, emit: Emit = lambda e: None,
                          cancelled: Callable[[], bool] = lambda: False, *, workers: int = 2,
                          ranks_per_process: int = RANKS_PER_PROCESS, record: dict | None = None) -> VerifyReport:
    """The output of `plan` checked against its recipe and sources (`workers`: threads reading, and processes
    taking the ranks where each would have at least `ranks_per_process`; `record`: the output's provenance record
    as the caller read it, `planning.provenance.read_record`; None: read here)."""
    report = VerifyReport()
    out = plan.output
    if not (out / plan.base.tag).is_dir():
        report.add(None, f"{out}: no tag folder {plan.base.tag}; is this the output of this recipe?")
        return report
    record = record if record is not None else read_record(out)  # (none readable: said apart, below)
    taken = recorded(record, TAKEN)
    changed = _sources_changed(plan, record)
    if changed and taken is None:  # an older record: nothing to prove the output against but its sources
        for lines in changed.values():
            for line in lines:
                report.add(None, f"{line}: the output is not compared with what it holds now; compose again from "
                                 "the checkpoints as they are, or verify before they change")
        return report
    report.changed.extend(line for lines in changed.values() for line in lines)
    try:
        composed = open_checkpoint(out, record=record)
    except CheckpointError as exc:
        report.add(None, str(exc))
        return report
    expected = plan.reshard.layout if plan.reshard else plan.base.layout
    diff = expected.describe_difference(composed.layout)
    if diff:
        what = f"DeepSpeed's at world size {plan.world_size}" if plan.reshard else "the base's"
        report.add(None, f"{out}: its layout is not {what}: it has {diff}")
        return report
    composed.check_complete()  # a rank file that is no whole archive (or no regular file): exit 4, before torch
    gone = set(changed)  # and those found changed on the way: files that fail the checks the composition passed
    listings = recorded_crcs(record, ARCHIVES)
    archives = Archives(listings, out, plan.base.tag)  # (asked only once one changed)
    ranks = _kind(plan)(plan, report, changed=gone, taken=taken, archives=archives)  # each byte claimed, read once
    partial = RowsFiles()
    weights, headers = recorded_weights(record, TAKEN_WEIGHTS), recorded_crcs(record, WEIGHT_HEADERS)
    for job in plan.model_file_jobs():
        claim_weight_file(ranks, job, partial, changed=frozenset(gone), record=WeightRecord(
            None if weights is None else weights.get(job.name), None if headers is None else headers.get(job.name),
            archives))
    _claim_copied(ranks, recorded_crcs(record, COPIED), base_changed=0 in gone)
    jobs, processes = _rank_jobs(plan, composed, workers=workers, ranks_per_process=ranks_per_process)
    verifying = RanksVerifying(plan=plan, composed=composed, changed=frozenset(gone), taken=taken, listings=listings,
                               threads=max(1, workers // processes))
    in_workers: list[str] = []  # the output's files whose records are not those written, found by the workers
    if processes == 1:  # the ranks' claims beside the model files' and the copied files': each file read once
        _claimed_and_checked(ranks, verifying, jobs[0], emit, cancelled)
    else:  # shares of the ranks in worker processes, once the model files and the copied files are checked here
        if ranks.tags:
            ranks.check(emit, cancelled, workers)
        cancel = _Cancel(cancelled)
        for found in run_calls([(verify_ranks, (job,)) for job in jobs], processes, emit, cancel, TaskOptions(),
                               common=(verifying,)):
            report.merge(found.report)
            in_workers += found.failed
    for line in [*archives.failed, *in_workers]:  # (each file checked by one process: the ranks' files apart)
        report.add(None, line)
    own = plan.own_files()
    if MODEL_FILE_INDEX in own:
        index = out / MODEL_FILE_INDEX
        try:
            written = read_small(index, MAX_RECORD, follow=False).decode(errors="replace")
        except (OSError, ValueError):
            written = None
        if written != own[MODEL_FILE_INDEX]:
            report.add(None, f"{index}: missing or not the index the model files' layout records")
    if "latest" in own and read_latest(out) != own["latest"]:
        report.add(None, f"{out / 'latest'}: names {read_latest(out)!r}, not the tag {plan.base.tag!r} composed; "
                         "DeepSpeed would load another checkpoint")  # (an HF base's `latest` is among its files)
    if not (out / PROVENANCE).is_file():
        report.add(None, f"{out / PROVENANCE}: missing; the output was not written by tailor-tui")
    for extra in _unplanned(plan, out):
        report.add(None, f"{out / extra}: not a file this composition writes (neither composed nor copied "
                         "from the base); it was added to the output afterwards")
    return report


def _claim_copied(ranks: RankClaims, copied: dict | None, *, base_changed: bool) -> None:
    """The run-level files copied from the base: each the base's byte for byte (claimed: read once, as the rank
    files are), a torch file among them read as torch's reader reads it (`_read_as_torch_reads`); or where the base
    changed since the composition, the bytes whose CRC-32 the provenance record holds (`copied`)."""
    plan, report = ranks.plan, ranks.report
    out, root = plan.output, plan.other_files_root()
    for rel, to in plan.other_files():
        if not (out / to).is_file():
            report.add(None, f"{out / to}: missing (the base has {rel})")
            continue
        if base_changed and (copied is None or str(to) not in copied):  # (nothing to compare it with: not read)
            report.unproven.append(f"{out / to}: not compared: the base's {rel} may have changed since the "
                                   "composition, and the output's provenance record holds no CRC-32 of it")
            continue
        f = ranks.claims.file(out / to, label=COPIED_LABEL)
        ranks.outputs.add(f)
        size = ranks.claims.size(f)
        if base_changed:  # what was copied, as recorded
            assert copied is not None
            ranks.claims.evidence(f, 0, size, None, str(to))
            ranks.claim(Tag("taken", -1, None, f"{out / to}: differs from what the composition copied from the "
                                               f"base's {rel} (its provenance record)", expected=copied[str(to)]),
                        f, 0, size)
            continue
        g = ranks.claims.file(root / rel)
        if ranks.claims.size(g) != size:
            report.add(None, f"{out / to}: differs from the base's {root / rel} ({size:,} bytes, the base's "
                             f"{ranks.claims.size(g):,})")
            _read_as_torch_reads(ranks, f, out / to)  # (its records still checked)
            continue
        ranks.claims.evidence(g, 0, size, None, str(rel))
        ranks.copied[f] = root / rel
        for at, length in _read_as_torch_reads(ranks, f, out / to):
            ranks.claim(Tag("copied", -1, None, f"{out / to}: differs from the base's {root / rel}", 0, g), f, at,
                        length, g, at)


def _read_as_torch_reads(ranks: RankClaims, f: int, path: Path) -> list[tuple[int, int]]:
    """The parts of the copied file `path` (the claims' file `f`) its claims cover, tiling it: a zip-format torch
    file's records, each checked against its CRC-32 as the file is read (evidence), and the headers between them;
    one part for any other file. A directory torch's reader would refuse (`formats.ptfile.zip_records`: what miniz
    accepts, torch-free) is a FAIL line, and the file is still compared whole."""
    size = ranks.claims.size(f)
    try:
        records = sorted(zip_records(path).values(), key=lambda r: r.data_offset)
    except CheckpointError as exc:
        why = str(exc).removeprefix(f"{path}: ").split("; ")[0][:200]
        ranks.report.add(None, f"{path}: torch's reader cannot read it ({why})")
        records = []
    parts: list[tuple[int, int, int | None, str]] = []
    at = 0
    for r in records:
        if r.data_offset > at:
            parts.append((at, r.data_offset - at, None, "its headers"))
        parts.append((r.data_offset, r.size, r.crc, r.name))
        at = r.data_offset + r.size
    if size > at or not parts:
        parts.append((at, size - at, None, "its directory" if parts else "its bytes"))
    for at, length, crc_, name in parts:
        ranks.claims.evidence(f, at, length, crc_, name)
    return [(at, length) for at, length, _crc, _name in parts if length]


def _sources_changed(plan: ComposePlan, record: dict | None) -> dict[int, list[str]]:
    """{the plan's index of a source: a line per file of it} of the sources `record` names that changed
    since the composition read them (`provenance.changed_since`); -1 for one the plan does not name."""
    if record is None:
        return {}
    index = {str(src.path.resolve()): s for s, src in enumerate(plan.sources)}
    found: dict[int, list[str]] = {}
    for path, line in changed_since(record):
        found.setdefault(index.get(path, -1), []).append(line)
    return found


def _unplanned(plan: ComposePlan, out: Path) -> list[Path]:
    """Files in the output that the plan accounts for neither as composed nor as copied."""
    expected = {Path(plan.base.tag) / name for names in plan.output_rank_files() for name in names}
    expected |= {Path(job.name) for job in plan.model_file_jobs()}
    expected |= {to for _rel, to in plan.other_files()}
    expected |= {Path("latest"), Path(MODEL_FILE_INDEX), Path(PROVENANCE)}
    return sorted(p.relative_to(out) for p in out.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.relative_to(out) not in expected)
