"""One skeleton for every job a team of processes does: compose (and reshard), export, statistics.

    begin    every process works out what to do, and declares it (`Declaration`: what to agree on,
             whose progress to tell, how many workers);
    agree    every process holds the same work (a digest of it), or the job fails;
    prepare  process 0 makes what the others need (the hidden output folder, the ranks left
             to read) and shares it;
    work     each process runs its share of the jobs (divided by bytes) in its workers;
    gather   each process tells every other what it did;
    publish  process 0 checks the whole and makes it visible; the others wait until it has.

A kind of work plugs into the stages by subclassing `TeamWork`; `run_as_team` runs them in
order inside `Team.working`, so a failure at any stage of any process fails every process,
and a job whose workers stop moving fails as a hung one. One process (`SOLO`) runs the same
stages, each team call immediate.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

from tailor_tui.checkpoints.checkpoint import OUTPUT_FILES, PROVENANCE
from tailor_tui.errors import Cancelled, OutputError
from tailor_tui.events import Emit, Job, TaskFinished, TaskOptions, TaskProgressed
from tailor_tui.fileio import fsync_dir, output_error, write_file
from tailor_tui.held import HeldFolder
from tailor_tui.interrupts import signals_held
from tailor_tui.planning.output import (
    check_made,
    check_published,
    hidden_folder,
    output_lock,
    publish,
    remove_made,
)
from tailor_tui.planning.replaceable import written_files
from tailor_tui.team.members import SOLO, Team
from tailor_tui.team.progress import relay
from tailor_tui.team.workers import STREAMING_WORKER, run_calls, workers_for

R = TypeVar("R")


@dataclass(frozen=True)
class Task:
    """One job and the top-level function a worker runs it with: `call(job, *args, emit,
    cancelled, options)`; its return value comes back to `TeamWork.report`."""

    call: Callable
    job: Job
    args: tuple = ()


def _nothing_to_agree_on() -> str:
    return ""


@dataclass(frozen=True)
class Declaration:
    """What a job is, as its planning decided (no I/O of the team's yet): every process declares
    the same (`TeamWork.begin`), and the skeleton runs the stages by it."""

    # What every process must hold the same of (a hash), worked out only where there are several
    # processes (a wide run's plan digest stats every rank file).
    digest: Callable[[], str] = _nothing_to_agree_on
    # (task, bytes) whose progress process 0 tells for the whole job; None: each process its own.
    progress: list[tuple[str, int]] | None = None
    # Worker processes for this process's tasks; None: as many as there are tasks, cores and
    # memory for `worker_memory` bytes each (`workers.workers_for`).
    workers: int | None = None
    worker_memory: int = STREAMING_WORKER


class TeamWork(Generic[R]):
    """What one kind of work does at each stage (every hook but `begin`, `tasks` and `publish` has a
    default that does nothing). One instance per run: it may keep what it learns between stages."""

    what = "plan"  # what the processes agree on, named when they do not
    cancelled = "cancelled"  # the message of a cancel (Ctrl-C, the UI's cancel)

    def begin(self) -> Declaration:
        """Work out what to do, on every process (a failure here fails every process at once)."""
        raise NotImplementedError

    def held(self, lead: bool):
        """A context around every stage after agreeing (process 0: the output's lock)."""
        return contextlib.nullcontext()

    def prepare(self, cancel: threading.Event) -> str:
        """Process 0 only: make what the others need; what it returns is shared with them."""
        return ""

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        """Every task of the whole job (the same list on every process), given what process 0 shared."""
        raise NotImplementedError

    def observe(self, event, emit: Emit) -> bool:
        """See every event of the workers first; True: it is a result, not passed on to `emit`."""
        return False

    def report(self, mine: list[Task], results: list, lead: bool) -> object:
        """What this process (`lead`: process 0) tells the others it did (JSON)."""
        return None

    def gathered(self, reports: list, lead: bool, emit: Emit) -> None:
        """Every process's report, in process order (on every process)."""

    def publish(self) -> R:
        """Process 0 only: check the whole and make it visible."""
        raise NotImplementedError

    def abandon(self, shared: str | None, exc: BaseException, cleans: bool) -> BaseException | None:
        """The job failed at `exc`; `cleans`: this process removes what was prepared (process 0,
        or a survivor when process 0 is gone). Returns the exception to raise instead, if any:
        by default a Ctrl-C is this work's cancel."""
        return Cancelled(self.cancelled) if isinstance(exc, KeyboardInterrupt) else None


class PublishingWork(TeamWork[None]):
    """Work whose result is a folder at `output` (a composition, an export): process 0, holding
    the output's lock, makes it hidden beside `output` and fills it (`fill`); each process writes
    its share into it (`folder`); process 0 writes the provenance record and puts the whole in
    place (`publish_folder`). A failure or a Ctrl-C before that removes the folder; a Ctrl-C
    after says the output is complete (`finished`)."""

    finished = "cancelled as it finished: {output} is complete"

    def __init__(self, output: Path, force: bool, options: TaskOptions):
        self.output, self.force = output, force
        self.durable = options.durable
        self.made: Path | None = None  # process 0's hidden folder, from the moment it exists
        self.made_as: tuple[int, int] | None = None  # its identity: what is at its path is checked to be it
        self.tmp: Path | None = None  # the folder every process writes into (read back by its path)
        self.hidden: HeldFolder | None = None  # that folder held open: what is written goes in by its descriptor
        self.published = False

    def held(self, lead: bool):
        return output_lock(self.output) if lead else contextlib.nullcontext()

    def prepare(self, cancel: threading.Event) -> str:
        with signals_held():  # a Ctrl-C waits until `abandon` knows the folder it must remove
            held = hidden_folder(self.output, self.force)
            self.made, self.made_as, self.hidden = held.path, held.identity, held
        self.fill(held, cancel)
        return str(self.made)

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        """Process 0: what the folder holds before the workers write into it."""

    def folder(self, shared: str) -> HeldFolder:
        """The folder process 0 shared, held open: on process 0 the one it made; on the others a folder
        of this user's (not a link) found at that path now, which their workers check they write into."""
        if self.hidden is None or str(self.hidden.path) != shared:
            self.hidden = HeldFolder(Path(shared))
            try:
                self.hidden.fd()
            except OSError as exc:
                raise output_error(exc, self.hidden.path) from None
        self.tmp = self.hidden.path
        return self.hidden

    def publish_folder(self, record: dict) -> None:
        """Process 0: `record`, with every file the folder holds, as its provenance record; then
        the folder in place at `output`."""
        tmp, held = self.tmp, self.hidden
        assert tmp is not None and held is not None, "folder() named it before any task ran"
        check_made(tmp, self.made_as)
        write_file(held / PROVENANCE, json.dumps(record | {OUTPUT_FILES: written_files(tmp)}, indent=2) + "\n",
                   self.durable)
        fsync_dir(held, self.durable)
        with signals_held():  # a cancel now waits until the output is whole at its path
            check_made(tmp, self.made_as)
            publish(held, self.output, self.force, self.durable)
            check_published(self.output, self.made_as)
            self.published = True

    def abandon(self, shared: str | None, exc: BaseException, cleans: bool) -> BaseException | None:
        if self.published:
            return Cancelled(self.finished.format(output=self.output)) if isinstance(exc, KeyboardInterrupt) else None
        folder = self.made or (Path(shared) if shared is not None else None)  # process 0's, or the one it shared
        swapped = None
        if self.made is not None:  # what failed may be the folder put in its place: then that is the error
            try:
                check_made(self.made, self.made_as)
            except OutputError as error:
                swapped = error
        if folder is not None and cleans:
            remove_made(folder, self.made_as)
        return swapped or super().abandon(shared, exc, cleans)


def run_as_team(work: TeamWork[R], *, team: Team = SOLO, emit: Emit = lambda event: None,
                cancel: threading.Event | None = None, options: TaskOptions = TaskOptions()) -> R | None:
    """Run `work`'s stages on this process of `team`; process 0 returns what `publish` made,
    the others None."""
    cancel = cancel or threading.Event()
    with team.working(cancel):
        halt: Callable[[], None] = _nothing_to_halt
        try:
            declared = work.begin()
            if declared.progress is not None:
                emit, halt = relay(team, emit, declared.progress)
            team.agree(work.what, declared.digest)
            with work.held(team.lead):
                shared = None
                try:
                    shared = team.share("prepared", _watched(team, lambda: work.prepare(cancel)) if team.lead else None)
                    tasks = work.tasks(shared, emit)
                    mine = [tasks[i] for i in team.mine([t.job.total_bytes for t in tasks])]
                    results = _work(work, declared, mine, team, emit, cancel, options)
                    work.gathered(team.gather("done", work.report(mine, results, team.lead)), team.lead, emit)
                    outcome = _watched(team, work.publish) if team.lead else None
                    team.gather("published", True)
                    return outcome
                except BaseException as exc:
                    if isinstance(exc, KeyboardInterrupt):
                        cancel.set()  # whatever still runs stops
                    instead = work.abandon(shared, exc, cleans=team.lead or team.lead_lost())
                    if instead is not None:
                        raise instead from None
                    raise
        finally:
            halt()


def _watched(team: Team, step: Callable[[], R]) -> R:
    """Process 0's `step` that every other process waits for (preparing, publishing): watched as the
    work is, so that one stuck (a file system that stopped answering) fails the job after the peer
    timeout instead of holding every process without end."""
    team.progressing()
    try:
        return step()
    finally:
        team.progressing(False)


def _nothing_to_halt() -> None:
    pass


def _work(work: TeamWork, declared: Declaration, mine: list[Task], team: Team, emit: Emit,
          cancel: threading.Event, options: TaskOptions) -> list:
    """This process's tasks, in its workers; a worker whose progress stops for the team's
    timeout fails the job (a stuck file system)."""
    if not mine:
        return []

    def watch(event) -> None:
        if isinstance(event, (TaskProgressed, TaskFinished)):
            team.progressing()
        if not work.observe(event, emit):
            emit(event)

    team.progressing()
    try:
        workers = declared.workers or workers_for(len(mine), declared.worker_memory)
        results = run_calls([(t.call, (t.job, *t.args)) for t in mine], workers, watch, cancel, options)
    finally:
        team.progressing(False)
    if cancel.is_set():
        raise team.error() if team.failure is not None else Cancelled(work.cancelled)
    return results
