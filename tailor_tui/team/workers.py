"""Running a composition's tasks: inline, or in a pool of worker processes.

Workers start with SIGINT held back, ignore Ctrl-C (the parent alone decides how to stop),
leave by themselves when orphaned (kill -9 of the parent), and report progress through a
queue (in lists: `_Outbox`); the parent turns a cancel flag into a stop flag (`StopFlag`). They are forked where that is safe
(see `start_method`), else spawned.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tailor_tui.errors import Cancelled, OutputError
from tailor_tui.events import Emit, TaskOptions
from tailor_tui.interrupts import signals_held

if TYPE_CHECKING:  # for annotations only: statistics run calls without loading the planner
    from tailor_tui.planning.plan import ComposePlan

_WORKER_QUEUE = None
_WORKER_CANCEL = None
_WORKER_COMMON: tuple = ()  # the leading arguments of every call of the pool (`run_calls`' `common`)


def _worker_init(events, cancel, parent: int, common: tuple = ()) -> None:
    global _WORKER_QUEUE, _WORKER_CANCEL, _WORKER_COMMON
    # Ctrl-C reaches the whole process group: the parent alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the parent's SIGTERM handler (the CLI's, or the one noting it while the
    # pool runs): a SIGTERM (scancel signals every process of the job) ends it, as in a spawned one.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A worker holds its own copy of the task queue's pipe, so it would wait forever if the
    # parent were killed (kill -9, OOM killer): it leaves as soon as it is orphaned.
    # `parent` comes from the parent itself: read here, it could already be init's PID.
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A process that put to a queue waits, as it exits, until the pipe has taken all of it: once
    # the parent has stopped reading (a task failed, a cancel), a worker with more events than a
    # pipe holds would never exit, and the pool's shutdown would wait for it forever. Those events
    # are only progress nobody reads any more (a finished task's last event is read before the
    # shutdown: `run_pool`), so a worker exits without waiting for them.
    events.cancel_join_thread()
    _WORKER_QUEUE, _WORKER_CANCEL, _WORKER_COMMON = events, cancel, common


class StopFlag:
    """The parent's word to its workers to stop: one byte of shared memory, written by the parent, read by
    the workers, without a lock. A multiprocessing Event takes a lock a worker holds while it asks it: a
    worker killed in that moment (the out-of-memory killer) leaves it held, and the parent's `set` then
    waits forever."""

    def __init__(self, ctx) -> None:
        self.flag = ctx.RawValue("b", 0)

    def set(self) -> None:
        self.flag.value = 1

    def is_set(self) -> bool:
        return bool(self.flag.value)


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _run_batch(calls: list, options: TaskOptions) -> list:
    outbox, cancel = _Outbox(_WORKER_QUEUE), _WORKER_CANCEL
    assert cancel is not None, "_worker_init set it"
    try:
        results = [fn(*_WORKER_COMMON, *args, outbox, cancel.is_set, options) for fn, args in calls]
    finally:
        outbox.flush()
    outbox.events.put([BatchDone()])  # its last message: every event of the batch is before it
    return results


@dataclass(frozen=True)
class BatchDone:
    """A worker's last message for a batch: the parent has every event of it once this one came."""


# A worker's events reach the parent in lists, one message at most every SEND_EVERY seconds: a
# batch of small tasks (a wide run's rank files) would otherwise send three messages per task, each
# waking the queue's feeder thread (a fifth of such a worker's time). A long task's progress, one
# event every 0.1 s, still goes out as it comes.
SEND_EVERY = 0.05


class _Outbox:
    def __init__(self, events):
        self.events, self.pending, self.sent = events, [], time.monotonic()

    def __call__(self, event) -> None:
        self.pending.append(event)
        now = time.monotonic()
        if now - self.sent >= SEND_EVERY:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self.pending:
            self.events.put(self.pending)
            self.pending = []
        self.sent = time.monotonic() if now is None else now


# Small tasks (the rank files of a wide run: tens of KiB each) go to a worker in batches: one
# submission, one pickled message each way, one future for the parent to watch per batch; jobs
# sharing objects (a checkpoint's layout) are pickled with them once. A batch holds at most a
# quarter of a worker's share of the bytes, so the workers stay evenly busy to the end.
BATCH_BYTES = 64 << 20
BATCH_CALLS = 64


def batches(calls: list[Call], workers: int) -> list[list[Call]]:
    """`calls`, in order, cut into consecutive batches (a call larger than a batch goes alone)."""
    sizes = [getattr(args[0], "total_bytes", 0) if args else 0 for _fn, args in calls]
    limit = min(BATCH_BYTES, max(1, sum(sizes) // (4 * workers)))
    found: list[list[Call]] = []
    held = 0
    for call, n in zip(calls, sizes):
        if not found or held + n > limit or len(found[-1]) >= BATCH_CALLS:
            found.append([])
            held = 0
        found[-1].append(call)
        held += n
    return found


# What one worker process holds besides its task's data: the interpreter and tailor-tui's
# torch-free modules (streaming, 1 MiB buffer; a partial base's optim file too), or with torch
# imported (the re-serialising fallback, model_states taking fragments, casting model files).
STREAMING_WORKER = 64 << 20
TORCH_WORKER = 512 << 20


def worker_memory(plan: ComposePlan) -> int:
    """The most memory any one task of `plan` needs in a worker (bytes)."""
    from tailor_tui.planning.jobs import TORCH, RankJob, optim_writer

    needs = [STREAMING_WORKER]
    for job in plan.rank_jobs() if plan.reshard is None else ():  # resharding workers stream
        assert isinstance(job, RankJob), "not resharding: every rank's job is a RankJob"
        base = job.files[0]
        if job.frozen or job.buffers:  # model_states re-saved by torch (a partial base's optim file is not)
            needs.append(TORCH_WORKER)
        elif optim_writer(base) == TORCH:  # re-serialised: the whole rank
            needs.append(TORCH_WORKER + 2 * plan.base.rank_bytes(job.rank))
    if any(job.loads_states for job in plan.model_file_jobs()):
        needs.append(TORCH_WORKER)
    return max(needs)


def default_workers(plan: ComposePlan) -> int:
    """As many workers as there are tasks, cores, and memory for what each really holds."""
    return workers_for(len(plan.rank_jobs()) + len(plan.model_file_jobs()), worker_memory(plan))


def workers_for(tasks: int, memory_each: int) -> int:
    """As many workers as there are `tasks`, cores, and memory for `memory_each` bytes each."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(tasks, cores, _available_memory() // memory_each))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# A call: (a top-level function, its leading arguments); it is run as
# fn(*common, *args, emit, cancelled, options) in a worker and its return value comes back.
Call = tuple


def run_calls(calls: list[Call], workers: int, emit: Emit, cancel: threading.Event,
              options: TaskOptions, *, common: tuple = ()) -> list:
    """Run `calls` on `workers` processes (in this one if 1) and return their results in order.
    Each call's events reach `emit` in this process; `cancel` stops them between chunks. `common`: arguments
    every call takes first, given each worker once as it starts (a forked one inherits them, a spawned one
    unpickles them once), not pickled with every batch: what all the calls share (a verification's plan and
    checkpoints: a MiB for a wide run, whose unpickling was a tenth of its time, once per call)."""
    if max(1, min(workers, len(calls))) == 1:
        return [fn(*common, *args, emit, cancel.is_set, options) for fn, args in calls]
    return run_pool(calls, min(workers, len(calls)), emit, cancel, options, common=common)


def prepare_worker_processes() -> None:
    """Start multiprocessing's resource tracker now, while sys.stderr is the real one.

    The tracker is started lazily with `sys.stderr.fileno()` among the fds it inherits;
    inside a full-screen app stderr is replaced and the first worker spawn would fail.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


# Modules that start threads of their own (OpenMP, BLAS pools) that Python does not count
THREADED_MODULES = ("torch", "numpy", "textual")


def start_method() -> str:
    """How workers start: forked where this process is one thread and has loaded nothing that
    starts threads of its own (a fork copies a lock another thread holds, still held, so a
    worker could wait on it forever): the command line's composing process. A forked worker
    starts in milliseconds with what its parent imported; a spawned one (the TUI, a process
    with torch or numpy loaded) starts a fresh interpreter and imports what it runs (~0.15 s)."""
    if sys.platform != "linux" or threading.active_count() > 1 or any(m in sys.modules for m in THREADED_MODULES):
        return "spawn"
    return "fork"


# How long the parent waits for the workers' events before it looks at their results again: a
# batch's result comes a moment after its last events, when none may follow (a wait of 0.05 s
# was a quarter of a small clone's time). The parent never puts into the events' queue to wake
# itself: a worker that exits while its queue's thread holds the queue's write lock (they exit
# without waiting for it) leaves that lock held, and a put of the parent's would wait for it at exit.
WAKE_EVERY = 0.01
# How long workers told to stop (a Ctrl-C, a failure of the job's) may take to see the flag and leave: they
# look at it every MiB they read or write, and at most finish an fsync. A worker still at work past it is
# stuck (a file system that stopped answering): it is killed, and the process leaves without waiting on it.
STOP_GRACE = 15.0


def run_pool(calls: list[Call], workers: int, emit: Emit, cancel: threading.Event, options: TaskOptions, *,
             common: tuple = ()) -> list:
    # A Ctrl-C or SIGTERM cancels through the flag, and is raised once every worker is gone:
    # raised at once, it could land inside `wait` while that holds a future's lock (see
    # `interrupts`), and the shutdown below would then wait for the pool forever.
    with signals_held(on_signal=cancel.set):
        return _run_pool(calls, workers, emit, cancel, options, common)


def _run_pool(calls: list[Call], workers: int, emit: Emit, cancel: threading.Event, options: TaskOptions,
              common: tuple) -> list:
    import multiprocessing as mp
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context(start_method())
    events, stop = ctx.Queue(), StopFlag(ctx)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(events, stop, os.getpid(), common))
    finished = [0]  # batches whose every event came (each ends with a BatchDone: a call may finish many tasks)
    stuck = False  # workers killed as stuck: not waited for

    def emit_and_count(event) -> None:
        if isinstance(event, BatchDone):
            finished[0] += 1
        else:
            emit(event)

    try:  # from the first spawn on: a Ctrl-C deferred while spawning arrives as the block ends
        with _children_ignore_sigint():
            futures = [pool.submit(_run_batch, batch, options) for batch in batches(calls, workers)]
        pending, stopping = set(futures), None
        while pending:
            if cancel.is_set():
                stop.set()
                stopping = stopping or time.monotonic()
                if time.monotonic() - stopping > STOP_GRACE:  # a worker stuck: not waited for any longer
                    stuck = True
                    _kill(pool)
                    raise Cancelled()
            _drain(events, emit_and_count, timeout=WAKE_EVERY)
            done, pending = wait(pending, timeout=0, return_when=FIRST_EXCEPTION)
            failed = next((exc for f in done if (exc := f.exception()) is not None), None)
            processes = list((getattr(pool, "_processes", None) or {}).values())
            # A worker died: the pool says so (its futures fail) only once it is woken (a result, a submit), and a
            # worker it spawned after its last wake-up may die unnoticed until another's batch ends, so this
            # process looks too. The exit codes are read once the pool has stopped and reaped every worker (read
            # sooner, one being reaped by the pool reads None).
            if isinstance(failed, BrokenProcessPool) or (pending and any(p.exitcode is not None for p in processes)):
                stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise worker_lost(processes) from None
            if failed is not None:
                stop.set()
                raise failed
        # A worker's events go through its queue's feeder thread and may arrive after its
        # result: wait for every batch's last event, so no rank's bar stops short of done.
        deadline = time.monotonic() + 10
        while finished[0] < len(futures) and time.monotonic() < deadline:
            _drain(events, emit_and_count, timeout=0.05)
        return [result for f in futures for result in f.result()]
    finally:
        # Workers still starting up need the queue and event: they are shut down (and have
        # exited) before those are released; those killed as stuck are not waited for.
        stop.set()
        pool.shutdown(wait=not stuck, cancel_futures=True)


def _kill(pool) -> None:
    """Kill the pool's workers (SIGKILL: one stuck in a system call leaves once it returns)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, ValueError):
            process.kill()


def worker_lost(processes) -> OutputError:
    """What to say when a worker process died mid-task (the pool is broken): by its signal, read
    from the pool's `processes` once it has stopped them all (the others with SIGTERM)."""
    codes = {p.exitcode for p in processes}
    killed = sorted(signal.Signals(-c).name for c in codes if c is not None and c < 0 and -c != signal.SIGTERM)
    how = f" (killed by {killed[0]}{', the out-of-memory killer?' if killed[0] == 'SIGKILL' else ''})" if killed else ""
    return OutputError(f"a worker process died before its task was done{how}; run again, with fewer --workers "
                       "if memory is short")


@contextlib.contextmanager
def _children_ignore_sigint():
    """Spawn workers that never see SIGINT, without the parent missing one.

    A terminal's Ctrl-C reaches the whole process group; a worker still starting up would
    die with a traceback of its own. SIGINT is blocked while `submit` spawns the processes:
    a blocked signal stays blocked across exec, so a worker cannot receive it before its
    initializer ignores it (which also drops one already pending). The parent only defers
    it: a Ctrl-C pressed while workers start is delivered when it is unblocked, and the
    composition is cancelled (ignoring SIGINT here instead lost that Ctrl-C: the composition ran on).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are the main thread's business (the TUI gets Ctrl-C as a key anyway)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _drain(events, emit: Emit, timeout: float) -> None:
    """Hand the workers' events that have come (each message a list: `_Outbox`) to `emit`."""
    try:
        for event in events.get(timeout=timeout) if timeout else events.get_nowait():
            emit(event)
        while True:
            for event in events.get_nowait():
                emit(event)
    except queue.Empty:
        pass


