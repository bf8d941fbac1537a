"""The output folder: what may be written or replaced, one writer at a time, and how a
finished composition takes its place.

- `check_output` (before anything is written): the output must not be, hold or sit inside
  any source checkpoint, compared by identity (device and inode), so that a bind mount,
  a second mount of the same NFS export or a symlinked path cannot reach a source under
  another name; nor be or sit inside any checkpoint training saved (of the run or any other),
  each folder on its path looked at itself. An existing non-empty folder is replaced only with
  `--force`, and only if it is an earlier tailor-tui output whose every entry its provenance
  accounts for (`replaceable`), never a training run.
- `output_lock`: an flock on a lock file beside the output; a second tailor-tui writing
  the same output is refused instead of one result silently replacing the other.
- `publish`: the finished folder is renamed into place, or swapped with the old one
  (atomically where the kernel can), with SIGINT and SIGTERM held back until the swap
  and the removal of the old folder are done, so a cancel never leaves the output path
  empty or reports "nothing was written" about a replaced output.
- `remove_stale`: what compositions on this host left when killed (kill -9, OOM): temp folders
  are removed, and an old output moved aside by a swap that was cut short is put back.
- `default_output`: the one rule for an output nobody named (the composer, an LLMTailor recipe,
  `--import`): `BASE-tailored` beside the base, `-2`, `-3`, … past every existing path.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path

from tailor_tui.checked.files import identity as file_identity
from tailor_tui.checkpoints.scan import is_training_checkpoint
from tailor_tui.errors import OutputError, RecipeError
from tailor_tui.fileio import (
    aside_prefix,
    exchange,
    first_free,
    fsync_dir,
    output_error,
    pid_alive,
    replace_dir,
)
from tailor_tui.held import HeldFolder, own_folder, swapped
from tailor_tui.interrupts import signals_held
from tailor_tui.planning.replaceable import not_replaceable

# --- before anything is written ------------------------------------------------------------


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what `path` names (symlinks followed), or None if nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return file_identity(st)


def _ancestors(path: Path) -> list[Path]:
    """`path` and the folders above it, as spelled and as resolved (symlinks, `..`)."""
    spelled = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    return [spelled, *spelled.parents, real, *real.parents]


def check_output(out: Path, sources, force: bool, preview: bool = False) -> str | None:
    """Raise OutputError if the composition may not be written to `out` (see the module).
    A preview (`--dry-run`) writes nothing: what only the real run would refuse about an
    existing output is returned as a note instead."""
    out = Path(out)
    if out.is_symlink():
        target = os.readlink(out)
        gone = "" if out.exists() else ", which does not exist"
        raise OutputError(f"output {out}: is a symbolic link (to {target}{gone}); name the folder itself")
    mine = identity(out)
    above = {identity(p) for p in _ancestors(out)} - {None}
    for src in sources:
        folders = {identity(src.path), identity(src.tag_dir)} - {None}
        if mine in folders:
            raise OutputError(f"output {out}: is source checkpoint {src.path} (the same folder); "
                              "choose another output folder")
        if above & folders:
            raise OutputError(f"output {out}: would nest inside source checkpoint {src.path}; "
                              "choose another output folder")
        if mine is not None and mine in {identity(p) for p in _ancestors(src.path)}:
            raise OutputError(f"output {out}: holds source checkpoint {src.path}; replacing it would "
                              "delete the source; choose another output folder")
        if not src.in_folder and mine is not None and mine == identity(src.save_dir):
            raise OutputError(f"output {out}: is the save_dir of source {src.path}; choose another folder")
    _check_not_in_training_checkpoint(out, mine)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out}: exists and is not a folder; choose another output path")
    problem = None
    if out.is_dir() and any(out.iterdir()):
        if why := not_replaceable(out):  # said first: passing --force would not help
            problem = (f"output {out}: already exists and {why}; --force replaces only an earlier tailor-tui "
                       "output or an empty folder, so choose another output folder")
        elif not force:
            problem = (f"output {out}: already exists and holds an earlier tailor-tui output; choose another "
                       "folder or pass --force (it replaces it, only once the new one is complete)")
    if problem and not preview:
        raise OutputError(problem)
    return f"the real run would refuse it: {problem}" if problem else None


def _check_not_in_training_checkpoint(out: Path, mine: tuple[int, int] | None) -> None:
    """An output is never a checkpoint training saved, nor inside one (of this run or any other):
    the checkpoint would no longer be one as saved, and the Trainer's rotation would delete the output
    with it. Each folder on the output's path (as spelled and as resolved) is looked at itself, so a
    bind mount of a checkpoint is one too; one holding a checkpoint is `not_replaceable`'s to refuse."""
    for folder in dict.fromkeys(_ancestors(out)):
        if not is_training_checkpoint(folder):
            continue
        if identity(folder) == mine:
            raise OutputError(f"output {out}: is training checkpoint {folder}, not an output; "
                              "choose another output folder")
        raise OutputError(f"output {out}: would nest inside training checkpoint {folder} (it would no longer "
                          "be the checkpoint training saved, and rotating checkpoints would delete the output "
                          "with it); choose an output folder outside every checkpoint")


# --- one writer per output ------------------------------------------------------------------


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.tailor-lock"


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold an exclusive lock on `out` for the whole composition (its parent folder made first if it is
    not there), or raise OutputError naming the tailor-tui that holds it. File systems without
    flock (some Lustre mounts) get no lock."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, out.parent) from None
    path, fd, mine = _lock_path(out), None, False
    try:
        with signals_held():  # a Ctrl-C waits until the lock file is one this call knows to remove
            fd = _lock(out, path)
            mine = fd is not None and os.fstat(fd).st_uid == os.geteuid()  # another user's: locked, left
        if fd is not None and mine:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        if fd is not None:
            if mine:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # while still locked: a waiter that opened it sees it gone and retries
            os.close(fd)


def _lock(out: Path, path: Path) -> int | None:
    """The locked lock file of `out` at `path` (an fd), or None where the file system has no locks."""
    import fcntl

    drain_until = time.monotonic() + ORPHANS_LEAVE_WITHIN
    while True:
        try:  # never through a link planted in its place (its target would be truncated)
            fd = _open_lock(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputError(f"{path}: a symbolic link stands where tailor-tui keeps the output's lock; "
                                  "it is not followed: remove it (someone may have planted it) and run again") from None
            raise output_error(exc, path) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"{path}: not a regular file where tailor-tui keeps the output's lock (a FIFO or a "
                              "device?); remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner, holder = os.fstat(fd).st_uid, _holder(fd)
            os.close(fd)
            if owner != os.geteuid():  # what it holds is never read into a message
                raise OutputError(f"output {out}: its lock file {path} belongs to another user (uid {owner}), "
                                  "whose process holds it now; tailor-tui neither reads nor removes it: wait for "
                                  "it to end or choose another output folder") from None
            if _holder_is_gone(holder) and time.monotonic() < drain_until:
                time.sleep(0.1)
                continue
            raise OutputError(f"output {out}: another tailor-tui ({holder}) is writing it now; wait for it "
                              "to finish or choose another output folder") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return None  # no locks on this file system
            raise output_error(exc, path) from None
        st = os.fstat(fd)
        if identity(path) == file_identity(st):  # still the file at `path`
            return fd
        os.close(fd)  # its holder removed it as we opened it: lock the new one


# A tailor-tui killed with kill -9 leaves its forked workers holding the lock (they share its open
# file) until they notice they are orphaned (`workers._exit_when_orphaned` looks twice a second).
ORPHANS_LEAVE_WITHIN = 3.0


def _open_lock(path: Path) -> int:
    """The lock file at `path`, opened (made, 0644, where there is none) without following a link; one
    another user made and this one may not write is opened to read: it can be locked all the same."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except PermissionError:
        return os.open(path, os.O_RDONLY | flags)


HOLDER = re.compile(r"pid (\d+) on ([A-Za-z0-9._-]{1,255})", re.ASCII)  # what `output_lock` writes in its lock file


def _holder(fd: int) -> str:
    """Who holds this user's lock file `fd`, for a message: what a tailor-tui wrote there ("pid N on
    HOST"), and only that (never a file's text as it is)."""
    written = os.pread(fd, 300, 0).decode("ascii", errors="replace").strip()
    return written if HOLDER.fullmatch(written) else "another process"


def _holder_is_gone(holder: str) -> bool:
    """Whether the lock's holder, as it wrote itself ("pid N on HOST"), is a process of this host that
    has ended (its lock is then held only by its orphaned workers, for a moment)."""
    match = HOLDER.fullmatch(holder)
    return match is not None and match[2] == socket.gethostname() and not pid_alive(int(match[1]))


# --- taking its place ------------------------------------------------------------------------


def temp_prefix(out: Path) -> str:
    # Host and PID: run folders often live on shared file systems used by many nodes.
    return f".{out.name}.tailor-partial-{socket.gethostname()}-"


def remove_stale(out: Path) -> None:
    """Clean up after compositions on this host that were killed (kill -9, OOM): their temp folders
    are removed; an old output a swap had moved aside is put back if the output path is empty
    (killed between the two renames), else removed (killed while deleting it)."""
    if not out.parent.is_dir():
        return
    for p in _left_by_dead(out, temp_prefix(out)):
        shutil.rmtree(p, ignore_errors=True)
    for p in _left_by_dead(out, aside_prefix(out)):
        if not os.path.lexists(out):
            os.rename(p, out)
            fsync_dir(out.parent)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _left_by_dead(out: Path, prefix: str) -> list[Path]:
    """Folders beside `out` named `prefix` + the PID of a process that is gone, and this user's own: a
    folder (not a link) whose owner is this user. One another user put there under such a name (in a
    group-writable project folder) is never restored, removed or read."""
    found = []
    for p in out.parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix):]
        if pid.isdigit() and not pid_alive(int(pid)) and folder_identity(p) is not None:
            found.append(p)
    return found


def hidden_folder(out: Path, force: bool) -> HeldFolder:
    """The empty hidden folder beside `out` that an output is written in before it takes its
    place (call holding `output_lock`), held open: what killed runs left is cleaned up first, and
    with `force` an existing output's folder is probed for the swap."""
    remove_stale(out)
    if force and out.is_dir():
        probe_swap(out)
    tmp = out.parent / f"{temp_prefix(out)}{os.getpid()}"
    try:
        return HeldFolder.make(tmp)  # this user's alone until it is published (`publish` opens it up)
    except OSError as exc:
        raise output_error(exc, out.parent) from None


def folder_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder of this user's at `path` (lstat: never through a link), or None
    where there is none: nothing, a link, a file, another user's."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return file_identity(st) if own_folder(st) else None


def check_made(tmp: Path, made: tuple[int, int] | None) -> None:
    """OutputError unless the folder at `tmp` is still the hidden folder this job made (`made`: its
    identity): in a folder others can write, it could be renamed aside and another put in its place."""
    if made is not None and folder_identity(tmp) != made:
        raise swapped(tmp)


def check_published(out: Path, made: tuple[int, int] | None) -> None:
    """After `publish`: OutputError unless what is at `out` is the folder the job made (one put in its
    place between the last `check_made` and the rename would be there instead)."""
    if made is not None and folder_identity(out) != made:
        raise OutputError(f"output {out}: holds a folder someone put in the place of the one tailor-tui made, as "
                          "it was published; it is not this composition and is left as it is: see who else writes "
                          f"in {out.parent}, and run again in a folder only you can write")


def remove_made(tmp: Path, made: tuple[int, int] | None) -> None:
    """Remove the hidden folder this job made: at `tmp` if it is still there, else where it was renamed
    to beside it (found by `made`, its identity); never another folder. Without `made` (a process that
    did not make it), only a folder of this user's at `tmp`."""
    if made is None:
        if folder_identity(tmp) is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        for candidate in (tmp, *tmp.parent.iterdir()):
            if folder_identity(candidate) == made:
                shutil.rmtree(candidate, ignore_errors=True)
                return


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; 022 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def probe_swap(out: Path) -> None:
    """Before composing: find out now, not after the composition, whether `out`'s folder lets
    tailor-tui create, swap and remove folders (OutputError if not)."""
    a, b = (out.parent / f".{out.name}.tailor-probe-{i}-{os.getpid()}" for i in (0, 1))
    try:
        a.mkdir()
        b.mkdir()
        exchange(a, b)  # False where unsupported: publish then moves the old folder aside first
    except OSError as exc:
        raise output_error(exc, out.parent) from None
    finally:
        for p in (a, b):
            with contextlib.suppress(OSError):
                p.rmdir()


def publish(held: HeldFolder, out: Path, force: bool, durable: bool = True) -> None:
    """Put the finished folder `held` at `out` (see `signals_held`: call it inside that), with
    the permissions a folder made now would have."""
    tmp = held.path
    try:
        os.fchmod(held.fd(), 0o777 & ~_umask())
        if out.is_dir() and any(out.iterdir()):
            if not force:
                raise OutputError(f"output {out}: appeared while composing; not overwritten")
            why = not_replaceable(out)
            if why:
                raise OutputError(f"output {out}: changed while composing and now {why}; not overwritten")
            replace_dir(tmp, out, durable)
            return
        if out.is_dir():
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent, durable)
    except OSError as exc:
        raise output_error(exc, out) from None


# --- the output nobody named ------------------------------------------------------------------

MAX_DEFAULTS = 10_000  # BASE-tailored-N tried before asking for a name


def default_output(base: Path) -> Path:
    """Where a composition of `base` goes when nobody named its output: `BASE-tailored` beside the base;
    `BASE-tailored-2`, `-3`, … when an earlier output (or anything else) has that name: a new composition
    never lands in or over a previous one, whichever command or screen chose it."""
    found = first_free(lambda n: default_name(base, n), MAX_DEFAULTS)
    if found is not None:
        return found
    raise RecipeError(f"{base.parent}: {MAX_DEFAULTS:,} outputs named {base.name}-tailored-N already; name one "
                      "with `output:` in the recipe or --output")


def recipe_output(recipe, *, written: bool = False) -> Path | None:
    """The output of `recipe` (a `planning.recipe.Recipe`): the one it names; an LLMTailor recipe's, which
    names none, `default_output` of its base (`written`: the one written last, `newest_default_output`, for
    `--verify`); else None."""
    if recipe.output is not None:
        return Path(recipe.output)
    if recipe.converted_from is None:
        return None
    return newest_default_output(recipe.base) if written else default_output(recipe.base)


def newest_default_output(base: Path) -> Path | None:
    """The default output (`default_output`) of `base` written last: the highest `BASE-tailored-N` there is
    (what `--verify` of a recipe that names no output checks), or None."""
    found = None
    for n in range(1, MAX_DEFAULTS):
        candidate = default_name(base, n)
        if not os.path.lexists(candidate):
            break
        found = candidate
    return found


def default_name(base: Path, n: int) -> Path:
    """The `n`-th default output name of `base` (1: `BASE-tailored`)."""
    return base.with_name(f"{base.name}-tailored" + (f"-{n}" if n > 1 else ""))


def is_default_output(base: Path, output: Path | None) -> bool:
    """Whether `output` is one of `base`'s default names (so that it follows a change of base)."""
    return (output is not None and output.parent == base.parent
            and re.fullmatch(re.escape(base.name) + r"-tailored(-\d+)?", output.name, re.ASCII) is not None)
