"""Fault injection for the tests, from outside the package: the product carries no test hooks
(issue 58), so the tests patch it, here, in one place.

Each fault is asked for by an environment variable:

- `TAILOR_TEST_SLOW_COMPOSE=SECONDS` (`slow_tasks`): every progress step of every task sleeps
  SECONDS, then looks at the cancel flag. The tests' checkpoints compose in well under a second;
  the tests of cancel, kill and a hung worker need the work to last long enough to signal it
  mid-way, and need a cancel to be seen at the next step, as it is on a checkpoint of real size.
- `TAILOR_TEST_NO_RENAME_EXCHANGE=1` (`refuse_exchange`): the C library's renameat2 answers an
  exchange (RENAME_EXCHANGE) with EINVAL, as the kernel does on file systems that cannot swap
  two names (NFS, Lustre). tailor-tui's own fallback then runs, as it does there: an output is
  replaced by two renames, the old folder moved aside first.
- `TAILOR_TEST_FAULTS_LOG=FILE`: each exchange refused appends a line to FILE (`refused_exchanges`
  reads them back), so a test can tell that the fallback really ran.
- `TAILOR_TEST_SLOW_LOG=FILE`: each slowed step appends a line (`slow PID`) to FILE before it sleeps,
  so a test can tell that a task is in its sleep.

A process started with `environment(...)` among its variables has this folder first on its
PYTHONPATH: its `sitecustomize` calls `install`, which patches each module as the process imports
it, and the workers it forks inherit the patch while those it spawns (fresh interpreters, the same
environment) install it again. A test applies the same rules to its own process through
monkeypatch (`slow_tasks(seconds, monkeypatch.setattr)`: conftest's `slow_tasks` fixture).

This module is imported at the start of every such process: it imports nothing but modules of the
standard library that start-up has loaded already, and tailor_tui only as a fault asks.
"""

from __future__ import annotations

import os
import sys
import time

SLOW = "TAILOR_TEST_SLOW_COMPOSE"
NO_EXCHANGE = "TAILOR_TEST_NO_RENAME_EXCHANGE"
LOG = "TAILOR_TEST_FAULTS_LOG"
SLOW_LOG = "TAILOR_TEST_SLOW_LOG"
FOLDER = os.path.dirname(os.path.abspath(__file__))  # put first on a process's PYTHONPATH

RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h)


def environment(*, slow: float | None = None, no_exchange: bool = False, log: str | os.PathLike | None = None,
                slow_log: str | os.PathLike | None = None, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that make a process started with them inject these faults: each asked for,
    and PYTHONPATH with this folder first, the entries `inherited` (this process's environment by
    default) has kept after it, so that what the path held before still wins over the rest."""
    path = (os.environ if inherited is None else inherited).get("PYTHONPATH", "")
    env = {"PYTHONPATH": path if path.split(os.pathsep)[0] == FOLDER
           else os.pathsep.join([FOLDER, path]) if path else FOLDER}
    if slow is not None:
        env[SLOW] = str(slow)
    if no_exchange:
        env[NO_EXCHANGE] = "1"
    if log is not None:
        env[LOG] = os.fspath(log)
    if slow_log is not None:
        env[SLOW_LOG] = os.fspath(slow_log)
    return env


def install(environ=os.environ) -> None:
    """Called at start-up (sitecustomize): the faults `environ` asks for, each applied as the module
    it patches is imported; none asked for, nothing is done and nothing imported."""
    slow, no_exchange, log = environ.get(SLOW), environ.get(NO_EXCHANGE), environ.get(LOG)
    if slow:
        seconds = float(slow)  # a malformed value is the test's mistake: said at once, not ignored
        after_import("tailor_tui.events", lambda _module: slow_tasks(seconds, log=environ.get(SLOW_LOG) or None))
    if no_exchange:
        after_import("tailor_tui.fileio", lambda _module: refuse_exchange(log or None))


def slow_tasks(seconds: float, setattr=setattr, log: str | None = None) -> None:
    """Every `ByteCounter.add` (a task's progress step) counts the step, sleeps `seconds`, and then
    looks at the cancel flag and the clock (`ByteCounter.look`). `add` by itself looks only every
    32 steps or MiB: slowed, a step could then sleep 32 times before a cancel was seen. `setattr`:
    how the class is patched (monkeypatch.setattr to undo it at a test's end). `log`: a file each
    step appends `slow PID` to before it sleeps."""
    from tailor_tui.events import ByteCounter

    add = ByteCounter.add
    if getattr(add, "slowed_by", None) is not None:
        add = add.__wrapped__  # slowed again (another value): one sleep a step, never two

    def slowed(self, n: int) -> None:
        add(self, n)
        if log is not None:
            with open(log, "a") as f:
                f.write(f"slow {os.getpid()}\n")
        time.sleep(seconds)
        self.look()

    slowed.__wrapped__, slowed.slowed_by = add, seconds
    setattr(ByteCounter, "add", slowed)


def refuse_exchange(log: str | os.PathLike | None = None, setattr=setattr) -> None:
    """tailor_tui.fileio's C library (`_libc`, through which `exchange` calls renameat2) as on a
    file system without RENAME_EXCHANGE: an exchange fails with EINVAL, so `fileio.exchange` says
    False and every caller takes its own way without it (`replace_dir`'s two renames, the probe
    before composing). The patch is at the lowest level so that all of tailor-tui's code on that
    way runs, as on NFS. Each refusal appends a line to `log`, where one is named."""
    from tailor_tui import fileio

    libc = fileio._libc  # (an AttributeError here, if it is renamed: the fault must not silently vanish)
    setattr(fileio, "_libc", lambda: _WithoutExchange(libc(), log))


class _WithoutExchange:
    """The C library (`libc`, None where there is none) but for renameat2's exchange, refused with
    EINVAL; every other call, renameat2's plain renames among them, is the library's own."""

    def __init__(self, libc, log: str | os.PathLike | None):
        self._libc, self._log = libc, log

    def __getattr__(self, name: str):
        return getattr(self._libc, name)

    def renameat2(self, olddirfd: int, oldpath: bytes, newdirfd: int, newpath: bytes, flags: int) -> int:
        import ctypes
        import errno

        if not flags & RENAME_EXCHANGE:
            return self._libc.renameat2(olddirfd, oldpath, newdirfd, newpath, flags)
        if self._log is not None:
            line = f"exchange refused\t{os.fsdecode(oldpath)}\t{os.fsdecode(newpath)}\n"
            fd = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())  # one write with O_APPEND: lines of processes side by side stay whole
            finally:
                os.close(fd)
        ctypes.set_errno(errno.EINVAL)  # what ctypes.get_errno() then says, as after the failed call
        return -1


def refused_exchanges(log: str | os.PathLike) -> list[tuple[str, str]]:
    """The exchanges `refuse_exchange` refused and logged to `log`, as (first path, second path)
    in the order refused; none if it refused none (the file is made by the first)."""
    try:
        with open(log) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [(a, b) for _, a, b in (line.split("\t") for line in lines)]


def after_import(name: str, then) -> None:
    """Call `then(module)` once the module `name` is imported, each time it is loaded (at once if
    it is already): a finder first on sys.meta_path lets the others find it, and wraps its loader's
    exec_module. The module is neither imported early nor found another way than it would be."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport:
    """A meta path finder that finds nothing itself (see `after_import`)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then  # this spec's own loader (a file loader is made per module found)
        return spec
