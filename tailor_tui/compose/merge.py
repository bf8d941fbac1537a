"""The merger: composes one checkpoint from a MergePlan.

Each rank's files are composed by `rank_task.merge_rank` (in a worker process when there
are several workers, `workers`): the base's optim_states with the fp32 master weights, exp_avg and
exp_avg_sq of every row picked from another checkpoint replaced slice by slice, and
padding slots zeroed. Everything else in the rank files (optimizer `step` of every
sub-group, loss scaler, counters, scheduler) is the base's.

The output is built in a temporary folder beside the destination, checked, and
renamed into place only when complete: an interrupted merge leaves nothing at the
output path. Sources are only ever opened for reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui import __version__
from tailor_tui.compose.bin_files import merge_bin_file
from tailor_tui.checkpoints.checkpoint import MODEL_FILE_INDEX, PROVENANCE, Checkpoint
from tailor_tui.errors import Cancelled, OutputError
from tailor_tui.events import Emit, TaskFinished, TaskOptions, TaskProgressed
from tailor_tui.fileio import copy_file, fsync_dir, output_error, write_file
from tailor_tui.health.guard import nonfinite_error
from tailor_tui.planning.jobs import BinFileJob
from tailor_tui.compose.model_files import merge_model_file
from tailor_tui.planning.output import OUTPUT_FILES, hidden_folder, output_lock, publish, signals_held, written_files
from tailor_tui.planning.plan import MergePlan
from tailor_tui.checkpoints.checkpoint import tied_partner
from tailor_tui.formats.ptfile import check_crcs
from tailor_tui.compose.rank_reshard import reshard_rank
from tailor_tui.compose.rank_task import merge_rank
from tailor_tui.resharding.skeleton import write_skeletons
from tailor_tui.team.team import SOLO, Team
from tailor_tui.team.progress import relay
from tailor_tui.team.workers import default_workers, run_calls

# --- the task list -------------------------------------------------------------------------


def planned_tasks(plan: MergePlan) -> list[tuple[str, int]]:
    """(task name, total bytes) of every task a merge will report, in order."""
    ranks = [(f"rank {job.rank}", job.total_bytes) for job in plan.rank_jobs()]
    return ranks + [(job.task, job.total_bytes) for job in plan.model_file_jobs()]


# --- the whole merge --------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeResult:
    output: Path
    seconds: float
    bytes_written: int
    peak_rss: int  # bytes: the largest peak resident memory of any process that merged a task
    nonfinite: dict = field(default_factory=dict)  # row -> NaN/Inf values it holds (--allow-nonfinite)


def run_merge(
    plan: MergePlan,
    workers: int | None = None,
    emit: Emit = lambda event: None,
    cancel: threading.Event | None = None,
    options: TaskOptions = TaskOptions(),
    allow_nonfinite: bool = False,
    team: Team = SOLO,
) -> MergeResult:
    """Write the composed checkpoint described by `plan`; atomic, cancellable; fsynced
    before it is renamed into place unless `options.durable` is False (`--no-fsync`).
    An output that would hold NaN/Inf values is refused (NonFiniteError, nothing written)
    unless `allow_nonfinite`; the result says how many it holds either way. With a `team`
    of several processes (`--apply` under torchrun or srun), each writes its share of the
    rank files and model files into the one hidden folder process 0 made, and process 0
    checks the whole and renames it into place; a failure anywhere fails every process."""
    cancel = cancel or threading.Event()
    with team.working(cancel):
        emit, halt = relay(team, emit, planned_tasks(plan))
        try:
            team.agree("plan", plan_digest(plan))
            return _compose(plan, workers, emit, cancel, options, allow_nonfinite, team)
        finally:
            halt()


def plan_digest(plan: MergePlan) -> str:
    """What every process of a job must agree on: the recipe, the output, every checkpoint's
    files (sizes, times) and what is taken from where."""
    record = provenance(plan)
    del record["created"]
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _compose(plan: MergePlan, workers: int | None, emit: Emit, cancel: threading.Event,
             options: TaskOptions, allow_nonfinite: bool, team: Team) -> MergeResult:
    durable = options.durable
    started = time.monotonic()
    out = plan.output
    peaks = [0]

    def emit_and_watch(event) -> None:
        if isinstance(event, TaskFinished):
            peaks[0] = max(peaks[0], event.peak_rss)
        if isinstance(event, (TaskProgressed, TaskFinished)):
            team.progressing()
        emit(event)

    if team.lead:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(exc, out.parent) from None
    with output_lock(out) if team.lead else contextlib.nullcontext():
        tmp = Path(team.share("tmp", str(_prepare(plan, cancel, durable)) if team.lead else None))
        published = False
        try:
            tag_dir = tmp / plan.base.tag
            rank_call = reshard_rank if plan.reshard is not None else merge_rank
            jobs = [*((rank_call, (job, tag_dir), job.total_bytes) for job in plan.rank_jobs()),
                    *((_weight_writer(job), (job, tmp), job.total_bytes) for job in plan.model_file_jobs())]
            mine = [jobs[i] for i in team.mine([size for _fn, _args, size in jobs])]
            calls = [(fn, args) for fn, args, _size in mine]
            ranks = [args[0].rank for fn, args, _size in mine if fn is rank_call]
            team.progressing()  # a hung worker (no progress for the peer timeout) fails the job
            with _skeletons(plan, tag_dir, cancel, ranks, team.rank):  # resharding: while the workers check sources
                results = run_calls(calls, workers if workers is not None else default_workers(plan),
                                    emit_and_watch, cancel, options)
            team.progressing(False)
            if cancel.is_set():
                raise team.error() if team.failure is not None else Cancelled()
            nonfinite = sum((Counter(r) for r in results if r), Counter())
            names = plan.output_rank_files()
            files = [f"{plan.base.tag}/{name}" for fn, args, _size in mine if fn is rank_call
                     for name in names[args[0].rank]]
            files += [args[0].name for fn, args, _size in mine if fn is not rank_call]
            done = team.gather("written", {"nonfinite": dict(nonfinite), "peak": peaks[0],
                                           "files": {f: _size_of(tmp / f) for f in files}})
            nonfinite = sum((Counter(d["nonfinite"]) for d in done), Counter())
            peaks[0] = max(d["peak"] for d in done)
            if team.lead:
                _confirm_sizes(tmp, done)
                if nonfinite and not allow_nonfinite:
                    raise nonfinite_error(plan, nonfinite)
                verify_output(plan, tmp)
                record = provenance(plan) | {OUTPUT_FILES: written_files(tmp)}
                write_file(tmp / PROVENANCE, json.dumps(record, indent=2) + "\n", durable)
                fsync_dir(tag_dir, durable)
                fsync_dir(tmp, durable)
                with signals_held():  # a cancel now waits until the output is whole at its path
                    publish(tmp, out, plan.force, durable, options.exchange)
                    published = True
            team.gather("published", True)
        except KeyboardInterrupt:
            if published:
                raise Cancelled(f"cancelled as the merge finished: {out} is complete and holds the new "
                                     "composition (check it with --verify)") from None
            cancel.set()
            if team.lead:
                shutil.rmtree(tmp, ignore_errors=True)
            raise Cancelled() from None
        except BaseException:
            if not published and (team.lead or team.lead_lost()):  # with process 0 gone, a survivor cleans up
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    # what the plan counted (bytes_to_write): every file but the provenance record written last
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f != out / PROVENANCE)
    return MergeResult(out, time.monotonic() - started, written, peaks[0], dict(nonfinite))


def _weight_writer(job):
    """The writer of a weight file's job: torch's format or safetensors."""
    return merge_bin_file if isinstance(job, BinFileJob) else merge_model_file


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise output_error(exc, path) from None


def _confirm_sizes(tmp: Path, done: list[dict]) -> None:
    """Every file each process wrote has, seen from here, the size it had there: on a shared
    file system that lost or has not yet shown a write, the job fails instead of publishing."""
    for process, record in enumerate(done):
        for rel, size in record["files"].items():
            seen = (tmp / rel).stat().st_size if (tmp / rel).is_file() else None
            if seen != size:
                raise OutputError(f"{tmp / rel}: process {process} wrote {size} bytes, process 0 sees "
                                  f"{'no file' if seen is None else f'{seen} bytes'}; the shared file system "
                                  "does not show every process the same files: compose on one that does")


def _prepare(plan: MergePlan, cancel: threading.Event, durable: bool) -> Path:
    """The hidden folder the output is composed in, with the base's other files, `latest` and
    the model-file index in it (process 0 of a job makes it; the others write into it)."""
    tmp = hidden_folder(plan.output, plan.force)
    try:
        (tmp / plan.base.tag).mkdir()
        _copy_other_files(plan, tmp, cancel, durable)
        if plan.base.kind == "deepspeed" or plan.base.partial:  # an HF base's is among its files
            write_file(tmp / "latest", plan.base.tag, durable)
        layout = plan.model_layout()
        if plan.base.partial and layout is not None and layout.index is not None:
            write_file(tmp / MODEL_FILE_INDEX, layout.index, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


@contextlib.contextmanager
def _skeletons(plan: MergePlan, tag_dir: Path, cancel: threading.Event, ranks: list[int], process: int):
    """When resharding: the structure of the output rank files in `ranks` (`reshard_skeleton`),
    written in a thread while the workers read and check their sources; the workers wait for
    each file. Its failure cancels the workers and is what the merge raises."""
    if plan.reshard is None:
        yield
        return
    failed: list[BaseException] = []
    stop = threading.Event()  # the workers failed: no more skeletons

    def write() -> None:
        try:
            write_skeletons(plan.base, plan.sources, plan.buffer_sources(), plan.reshard, tag_dir,
                            lambda: stop.is_set() or cancel.is_set(), ranks=ranks, staging=f".skeletons-{process}")
        except BaseException as exc:  # noqa: BLE001 - handed to the merge's thread below
            failed.append(exc)
            cancel.set()  # the workers waiting for their files stop

    thread = threading.Thread(target=write, name="reshard-skeletons", daemon=True)
    thread.start()
    try:
        yield
    except Cancelled:
        if not failed:
            raise
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _copy_other_files(plan: MergePlan, tmp: Path, cancel: threading.Event, durable: bool) -> None:
    root = plan.other_files_root()
    for rel, to in plan.other_files():
        if cancel.is_set():
            raise Cancelled()
        dst = tmp / to
        dst.parent.mkdir(parents=True, exist_ok=True)
        check_crcs(root / rel)  # scheduler.pt, rng_state_*.pth, training_args.bin: torch zip archives
        try:
            copy_file(root / rel, dst, durable=durable)
        except OSError as exc:
            raise output_error(exc, dst) from None


def verify_output(plan: MergePlan, root: Path) -> None:
    """Check the composed folder before it is moved into place: every file there and whole."""
    tag_dir = root / plan.base.tag
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    if latest != plan.base.tag:
        raise OutputError(f"{root}/latest names '{latest}', expected '{plan.base.tag}' (internal error)")
    for names in plan.output_rank_files():
        for name in names:
            out = tag_dir / name
            if not out.is_file() or not zipfile.is_zipfile(out):
                raise OutputError(f"{out}: missing or incomplete after the merge (internal error)")
    for job in plan.model_file_jobs():
        if not (root / job.name).is_file():
            raise OutputError(f"{root / job.name}: missing after the merge (internal error)")


def _identity(ckpt: Checkpoint) -> dict:
    files = {}
    for f, size in sorted(ckpt.sizes.items()):
        st = f.stat()
        files[os.path.relpath(f, ckpt.path)] = {"bytes": size, "mtime": st.st_mtime}
    return {
        "path": str(ckpt.path.resolve()),
        "kind": ckpt.kind,
        "tag": ckpt.tag,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "dtype": ckpt.dtype,
        "deepspeed_version": ckpt.ds_version,
        "files": files,
    }


def provenance(plan: MergePlan) -> dict:
    rows = {}
    for row in plan.base.rows:
        if row.tied:
            rows[row.name] = f"tied to {tied_partner(plan.base, row)}"
        else:
            rows[row.name] = str(plan.sources[plan.picks[row.name]].path.resolve())
    return {
        "tool": f"tailor-tui {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": plan.recipe.to_yaml(),
        "recipe_file": str(plan.recipe.source_file.resolve()) if plan.recipe.source_file else None,
        "rows": rows,
        "base": _identity(plan.base),
        "sources": [_identity(s) for s in plan.sources[1:]],
        **({"world_size": plan.world_size, "resharded": plan.reshard.describe(plan.base)} if plan.reshard else {}),
    }

