"""The contract between planners and workers: what a worker is asked to do (a `Job`) and what
it reports while it does it (events: plain data, picklable).

Every kind of work (composing a rank or a weight file, resharding a rank, exporting a rank,
reading a rank's statistics) is planned as jobs: frozen, picklable dataclasses holding all
their worker needs, each with a `task` (the name its progress is reported under) and
`total_bytes` (what it reads and writes: how a team divides the work, what bars count), worked
out by one rule (`JobCost`) from the bytes each says it reads and writes. A worker runs `call(job, ..., emit, cancelled, options)` and emits `TaskProgressed` and one
`TaskFinished`. The backend never draws anything: front ends (the terminal reporter, the
TUI) turn these into bars. Names are past tense: each says what has happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from tailor_tui.errors import Cancelled
from tailor_tui.units import size


@runtime_checkable
class Job(Protocol):
    """What a worker is asked to do, in full (each kind of work has its own frozen dataclass)."""

    @property
    def task(self) -> str: ...  # the name its progress is reported under: `rank 3`, `model file`

    @property
    def total_bytes(self) -> int: ...  # bytes it reads and writes: its cost, by which work is shared

    @property
    def progress_bytes(self) -> int: ...  # what its progress is shown in: bytes it writes (reads, if it only reads)


class _ReadsAndWrites(Protocol):
    @property
    def read_bytes(self) -> int: ...

    @property
    def write_bytes(self) -> int: ...


class _OfRank(Protocol):
    @property
    def rank(self) -> int: ...


class JobCost:
    """The one cost rule of every kind of job, from the bytes it reads (`read_bytes`) and writes
    (`write_bytes`), its fields or properties: it costs both (`total_bytes`); its progress is
    shown in what it writes, or in what it reads if it writes nothing (`progress_bytes`); each at
    least a byte, as a `ByteCounter` counts."""

    @property
    def total_bytes(self: _ReadsAndWrites) -> int:
        return max(self.read_bytes + self.write_bytes, 1)

    @property
    def progress_bytes(self: _ReadsAndWrites) -> int:
        return max(self.write_bytes or self.read_bytes, 1)


def progress_of(jobs) -> list[tuple[str, int]]:
    """(task, bytes its progress counts) of each job: what the progress bars and a team's declaration show."""
    return [(job.task, job.progress_bytes) for job in jobs]


class RankJobCost(JobCost):
    """A job that fills one output rank's files (`rank`): its progress is reported as `rank N`."""

    @property
    def task(self: _OfRank) -> str:
        return f"rank {self.rank}"


@dataclass(frozen=True)
class TaskProgressed:
    """`done` of `total` bytes of one task (`rank 3`, `model file`) are processed."""

    task: str
    done: int
    total: int

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0


@dataclass(frozen=True)
class TaskFinished:
    task: str
    total: int
    peak_rss: int = 0  # bytes: the peak resident memory of the process that ran the task
    shared: int = 0  # bytes of its output files that share the base's blocks, not written (`cloning`)
    shared_how: str = ""  # how ("reflink", "server-side copy"), where any are
    # bytes of the sources' records its output takes from that were not read: only the blocks that hold
    # what it takes were, checked against the CRC-32s the run's statistics recorded (`source_blocks`)
    sources_unread: int = 0


def written_and_shared(total: int, shared: int, how: str = "", *, unit: str = "written") -> str:
    """`total` bytes of output of which `shared` share a source's blocks (`how` they do: the base's, or, where
    every row is taken from one checkpoint, that one's), as every line and screen says it: "2.3 GiB written" (where none do: `unit`, what a progress counted), or
    "2.3 GiB: 135.3 MiB written, 2.2 GiB sharing its sources' blocks (reflink)"."""
    if not shared:
        return f"{size(total)} {unit}"
    return (f"{size(total)}: {size(total - shared)} written, {size(shared)} sharing its sources' blocks"
            + (f" ({how})" if how else ""))


def peak_rss() -> int:
    """The peak resident memory of this process (bytes): Linux's VmHWM, which starts afresh at
    exec. (getrusage's ru_maxrss does not: a worker spawned by a parent that had imported torch
    would report the parent's size.)"""
    import os
    import resource

    try:  # (read at once: a wide run's workers ask after every rank file)
        fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            status = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        at = status.index(b"\nVmHWM:") + 7
        return int(status[at: status.index(b"\n", at)].split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


Emit = Callable[[object], None]


@dataclass(frozen=True)
class TaskOptions:
    """How a composition's tasks write, carried with them (to worker processes too): the user's
    options alone. (The tests' fault injection, slowed tasks and a kernel without renameat2's
    exchange, lives with the tests: tests/faults.)"""

    durable: bool = True  # fsync before an output counts as written (--no-fsync: False)
    # Output files start as clones of the base's where the filesystem shares blocks (`cloning`);
    # False (--no-clone): every byte written
    clone: bool = True


class ByteCounter:
    """A task's context: counts its bytes and emits TaskProgressed at most every `interval`
    seconds, and carries its TaskOptions to every writer it is handed to.

    It is also where a task notices cancellation: `add` raises once `cancelled()` is true,
    so workers stop between chunks within a fraction of a second (it looks, `look`, every 32
    steps or MiB: a step of a few bytes costs no clock read).

    Writers count every byte they read or write (`total`, the task's cost); what is reported is
    one thing, the bytes of output written (`shown`, e.g. a rank file's size): the share of the
    task done, in bytes of what it writes. Without `shown` the counted bytes are reported.
    """

    def __init__(self, task: str, total: int, emit: Emit, cancelled: Callable[[], bool], *,
                 options: TaskOptions = TaskOptions(), interval: float = 0.1, shown: int | None = None):
        self.task, self.total, self.done = task, max(total, 1), 0
        self.shown = max(shown, 1) if shown is not None else self.total
        self._emit, self._cancelled, self._interval = emit, cancelled, interval
        self.options = options
        self._last = 0.0
        self._steps, self._look_at = 0, 0  # `add` looks at the clock and the cancel flag when due
        self.shared, self.shared_how = 0, ""  # output bytes sharing its sources' blocks (`shares`)
        self.sources_unread = 0  # bytes of the records it takes from not read (`skips`)
        emit(TaskProgressed(task, 0, self.shown))

    @classmethod
    def for_job(cls, job: Job, emit: Emit, cancelled: Callable[[], bool],
                options: TaskOptions = TaskOptions()) -> "ByteCounter":
        """The counter of a job: counts its cost, reports its progress_bytes."""
        return cls(job.task, job.total_bytes, emit, cancelled, options=options, shown=job.progress_bytes)

    def _reported(self) -> int:
        return self.shown if self.done >= self.total else self.shown * self.done // self.total

    def add(self, n: int) -> None:
        self.done = min(self.done + n, self.total)
        self._steps += 1
        if self._steps < 32 and self.done < self._look_at:
            return  # a small step (a resharded piece of a few bytes): looked at every 32 steps or MiB
        self.look()

    def look(self) -> None:
        """Look now at the cancel flag (Cancelled if it is set) and at the clock (progress is
        reported if `interval` has passed since the last report); the next look `add` makes
        by itself is 32 steps or a MiB on."""
        self._steps, self._look_at = 0, self.done + (1 << 20)
        if self._cancelled():
            raise Cancelled()
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._emit(TaskProgressed(self.task, self._reported(), self.shown))

    def shares(self, n: int, how: str) -> None:
        """`n` bytes of the task's output share a source's blocks (`how`), not written."""
        self.shared, self.shared_how = self.shared + n, how

    def skips(self, n: int) -> None:
        """`n` bytes of a source's record the task takes from are not read (`source_blocks`)."""
        self.sources_unread += n

    def finish(self) -> None:
        self.done = self.total
        self._emit(TaskProgressed(self.task, self.shown, self.shown))
        self._emit(TaskFinished(self.task, self.shown, peak_rss(), self.shared, self.shared_how, self.sources_unread))
