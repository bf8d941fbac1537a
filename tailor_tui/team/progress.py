"""Progress of a job over several processes, told by process 0 for the whole job.

Every other process posts the state of its tasks (bytes done of each rank file or model file)
to the job's store at most once a second and whenever a task finishes; process 0 reads them
every two seconds and hands them, as progress events, to its own reporter with its own
tasks' events: its log then follows every rank of the job (`rank 311: 41% …`; once they are
many, one line for them all) and, with `JobLines`, the whole job's bytes and throughput. Each
process's own lines still go to its stderr, prefixed by its process rank.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from tailor_tui.events import Emit, TaskFinished, TaskProgressed
from tailor_tui.progress_bars import LineReporter

POST_EVERY = 1.0
READ_EVERY = 2.0


class JobLines:
    """Process 0's log of a job: `LineReporter`'s lines for every task of the job, and its summary
    line for the whole job (`job: 41% …, 37 of 512 tasks done, …`) at most every `every_seconds`
    or tenth: with a handful of tasks besides each task's lines, with many in their place. Events
    come from two threads (its own tasks', the reader of the others'): one at a time."""

    def __init__(self, out, tasks, every_seconds: float = 5.0, *, unit: str = "written", clock=time.monotonic):
        self.lines = LineReporter(out, every_seconds, unit=unit, tasks=tasks, label="job", summary=True, clock=clock)
        self.lock = threading.Lock()

    def __call__(self, event) -> None:
        with self.lock:
            self.lines(event)

    def close(self) -> None:
        with self.lock:
            self.lines.close()


def relay(team, emit: Emit, tasks) -> tuple[Emit, Callable[[], None]]:
    """(the emit this process's composition uses, a stop function). One process: `emit` itself."""
    if team.size == 1:
        return emit, lambda: None
    if team.lead:
        return emit, _reader(team, emit, [name for name, _total in tasks])
    state: dict[str, list] = {}
    last = [0.0]

    def post(event) -> None:
        emit(event)
        if isinstance(event, TaskProgressed):
            state[event.task] = [event.done, event.total, False]
        elif isinstance(event, TaskFinished):  # with what it shared of the base's blocks, for the job's lines
            state[event.task] = [event.total, event.total, True, event.shared, event.shared_how]
        else:
            return
        now = time.monotonic()
        if isinstance(event, TaskFinished) or now - last[0] >= POST_EVERY:
            last[0] = now
            team.post("progress", state)

    return post, lambda: None


def _reader(team, emit: Emit, names: list[str]):
    stop = threading.Event()
    seen: dict[str, list] = {}

    def read_once() -> bool:
        for p in range(1, team.size):
            try:
                theirs = team.peek("progress", p) or {}
            except Exception:  # noqa: BLE001 - the job is failing: the composition says why
                return False
            for task, entry in theirs.items():
                if task in names and seen.get(task) != entry:
                    seen[task] = entry
                    done, total, finished = entry[:3]
                    shared, how = entry[3:5] if len(entry) >= 5 else (0, "")  # a finished task's (`post`)
                    emit(TaskFinished(task, total, shared=shared, shared_how=how) if finished
                         else TaskProgressed(task, done, total))
        return True

    def read() -> None:
        while not stop.wait(READ_EVERY) and read_once():
            pass

    thread = threading.Thread(target=read, name="job-progress", daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join()
        read_once()  # what finished since the last read

    return halt
