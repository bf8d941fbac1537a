"""One skeleton for every job a team of processes does: compose (and reshard), export, statistics.

    begin    every process works out what to do;
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
import threading
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from tailor_tui.errors import Cancelled
from tailor_tui.events import Emit, Job, TaskFinished, TaskOptions, TaskProgressed
from tailor_tui.team.progress import relay
from tailor_tui.team.team import SOLO, Team
from tailor_tui.team.workers import run_calls

R = TypeVar("R")


@dataclass(frozen=True)
class Task:
    """One job and the top-level function a worker runs it with: `call(job, *args, emit,
    cancelled, options)`; its return value comes back to `TeamWork.report`."""

    call: Callable
    job: Job
    args: tuple = ()


class TeamWork(Generic[R]):
    """What one kind of work does at each stage (every hook but `tasks` and `publish` has a
    default that does nothing). One instance per run: it may keep what it learns between stages."""

    what = "plan"  # what the processes agree on, named when they do not
    cancelled = "cancelled"  # the message of a cancel (Ctrl-C, the UI's cancel)

    def begin(self) -> None:
        """Work out what to do, on every process (a failure here fails every process at once)."""

    def digest(self) -> str:
        """What every process must hold the same of (a hash)."""
        return ""

    def progress_tasks(self) -> list[tuple[str, int]] | None:
        """(task, bytes) whose progress process 0 tells for the whole job; None: each process's own."""
        return None

    def held(self, lead: bool):
        """A context around every stage after agreeing (process 0: the output's lock)."""
        return contextlib.nullcontext()

    def prepare(self, cancel: threading.Event) -> str:
        """Process 0 only: make what the others need; what it returns is shared with them."""
        return ""

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        """Every task of the whole job (the same list on every process), given what process 0 shared."""
        raise NotImplementedError

    def workers(self, mine: list[Task]) -> int:
        """How many worker processes run this process's tasks."""
        return 1

    def around(self, mine: list[Task], cancel: threading.Event):
        """A context around this process's workers (resharding writes skeletons meanwhile; their
        failure sets `cancel`, which stops the workers)."""
        return contextlib.nullcontext()

    def observe(self, event, emit: Emit) -> bool:
        """See every event of the workers first; True: it is a result, not passed on to `emit`."""
        return False

    def report(self, mine: list[Task], results: list) -> object:
        """What this process tells the others it did (JSON)."""
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


def run_as_team(work: TeamWork[R], *, team: Team = SOLO, emit: Emit = lambda event: None,
                cancel: threading.Event | None = None, options: TaskOptions = TaskOptions()) -> R | None:
    """Run `work`'s stages on this process of `team`; process 0 returns what `publish` made,
    the others None."""
    cancel = cancel or threading.Event()
    with team.working(cancel):
        planned = work.progress_tasks()
        emit, halt = relay(team, emit, planned) if planned is not None else (emit, lambda: None)
        try:
            work.begin()
            team.agree(work.what, work.digest())
            with work.held(team.lead):
                shared = None
                try:
                    shared = team.share("prepared", work.prepare(cancel) if team.lead else None)
                    tasks = work.tasks(shared, emit)
                    mine = [tasks[i] for i in team.mine([t.job.total_bytes for t in tasks])]
                    results = _work(work, mine, team, emit, cancel, options)
                    work.gathered(team.gather("done", work.report(mine, results)), team.lead, emit)
                    outcome = work.publish() if team.lead else None
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


def _work(work: TeamWork, mine: list[Task], team: Team, emit: Emit, cancel: threading.Event,
          options: TaskOptions) -> list:
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
        with work.around(mine, cancel):
            results = run_calls([(t.call, (t.job, *t.args)) for t in mine], work.workers(mine), watch, cancel,
                                options)
    finally:
        team.progressing(False)
    if cancel.is_set():
        raise team.error() if team.failure is not None else Cancelled(work.cancelled)
    return results
