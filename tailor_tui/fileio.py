"""Writing output files durably: chunked copies with progress, fsync, atomic renames
(reading inputs is `checked`'s)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Callable, Literal

from tailor_tui.checked.files import open_regular
from tailor_tui.checked.ranges import READ_CHUNK, crc_range, pread_exact
from tailor_tui.errors import CheckpointError, OutputError
from tailor_tui.held import HeldFolder, HeldPath, swapped

# Where an output file goes: a path, or a place inside the job's hidden folder held open (`held`),
# made relative to its descriptor
Target = Path | HeldPath
Folder = Path | HeldFolder | HeldPath  # where output files go, each `folder / name`


def path_of(target: Target) -> Path:
    """Where `target` is now, by path (to read back what was written, or name it)."""
    return target.path if isinstance(target, HeldPath) else target

CHUNK = 64 << 20


def output_error(exc: OSError, path: Path | HeldPath | HeldFolder) -> OutputError:
    """Turn an OSError while writing `path` into one clear line (inside a held folder that is no longer at
    its path, that is what it says: `held.swapped`)."""
    folder = path.folder if isinstance(path, HeldPath) else path if isinstance(path, HeldFolder) else None
    if folder is not None and folder.vanished():
        return swapped(folder.path)
    reasons: dict[int | None, str] = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EFBIG: "the file size limit was hit (ulimit -f)",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
    }
    reason = reasons.get(exc.errno, exc.strerror or str(exc))
    # what to do follows from why: space only where space ran out
    advices: dict[int | None, str] = {
        errno.ENOSPC: "free space or choose another output folder",
        errno.EDQUOT: "free space or choose another output folder",
        errno.ENOENT: "its folder does not exist (or was removed): choose an output folder whose parent exists",
        errno.ENOTDIR: "a part of its path is not a folder: choose another output folder",
        errno.EACCES: "choose an output folder you may write to",
        errno.EPERM: "choose an output folder you may write to",
        errno.EROFS: "choose an output folder on a writable file system",
    }
    advice = advices.get(exc.errno, "choose another output folder")
    return OutputError(f"{path}: cannot write ({reason}); nothing was left at the output path, {advice}")


# `durable`: whether outputs are fsynced before they count as written (and renamed into
# place). Off (`--no-fsync`): a killed tailor-tui still leaves nothing half-written (the page
# cache survives a process), but a power loss or kernel crash soon after may damage the
# output. It travels with the work (events.TaskOptions), never as a process-wide switch.


def fsync(fd: int, durable: bool = True) -> None:
    if durable:
        os.fsync(fd)


# How an output file is created: a new file, never through a symbolic link or onto a file already
# there (another user's link planted where an output goes would have it written elsewhere)
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def first_free(named: Callable[[int], Path], most: int) -> Path | None:
    """The first of `named(1)`, `named(2)`, … `named(most - 1)` with nothing at it, not even a dangling link:
    where a new file or folder goes beside earlier ones, never over one; None where every one is taken."""
    return next((path for n in range(1, most) if not os.path.lexists(path := named(n))), None)


def create(path: Target, mode: int = 0o644) -> int:
    """A write-only descriptor of a new file at `path` (CREATE)."""
    return open_target(path, CREATE, mode)


def create_sized(path: Target, size: int, head: bytes = b"") -> None:
    """A new file at `path` of `size` bytes, `head` written at its start, the rest a hole (read as zeros) that a
    worker fills; an OutputError naming it where it cannot be made."""
    try:
        fd = create(path)
        try:
            os.ftruncate(fd, size)
            if head:
                pwrite_all(fd, head, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise output_error(exc, path) from None


def open_target(path: Target, flags: int, mode: int = 0o644) -> int:
    """os.open of `path`; a `HeldPath` relative to its held folder's descriptor, never through a link."""
    return path.open(flags, mode) if isinstance(path, HeldPath) else os.open(path, flags, mode)


def write_file(path: Target, data: bytes | str, durable: bool = True) -> None:
    """Write a small file of the output whole (text as UTF-8), fsynced when `durable`."""
    try:
        with open(create(path), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            fsync(f.fileno(), durable)
    except OSError as exc:
        raise output_error(exc, path) from None


def fsync_file(path: Path, durable: bool = True) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd, durable)
    finally:
        os.close(fd)


def fsync_dir(path: Path | HeldFolder | HeldPath, durable: bool = True) -> None:
    if not durable:
        return
    if isinstance(path, HeldFolder):
        os.fsync(path.fd())
        return
    try:
        fd = open_target(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_file(src: Path, dst: Target, on_bytes: Callable[[int], None] = lambda n: None, durable: bool = True,
              within: Path | None = None, *, crc: bool = False, opened: int | None = None) -> int | None:
    """Copy bytes (never a hard link), in chunks so progress and cancellation stay live.
    A source that changes size while it is copied is an error, never a short copy. `within`: the
    run folder `src` lies in; a symbolic link on the way that leaves it (or a file swapped in
    after the check) is refused, not read (`checked.files.open_regular`). `crc`: the bytes pass
    through this process, and their CRC-32 is returned (else None: copied in the kernel). `opened`:
    a descriptor of `src` the caller opened (and checked): copied from it, left open."""
    if opened is not None:
        source = os.dup(opened)
    else:
        source = open_regular(src, within=within)  # (NotRegular: a FIFO or a device put in its place)
    with open(source, "rb") as fin, open(create(dst), "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        offset, writeback, value = 0, Writeback(fout.fileno(), durable), None
        if crc:
            def write(at: int, view: memoryview) -> None:
                pwrite_all(fout.fileno(), view, at)
                writeback.advance(at + len(view))

            try:
                value = crc_range(fin.fileno(), 0, size, memoryview(bytearray(READ_CHUNK)), on_bytes=on_bytes,
                                  inspect=write)
                offset = size
            except OSError:
                if os.fstat(fin.fileno()).st_size == size:
                    raise  # (one that shrank is said below)
        else:
            while offset < size:
                n = os.sendfile(fout.fileno(), fin.fileno(), offset, min(CHUNK, size - offset))
                if n == 0:
                    break
                offset += n
                writeback.advance(offset)
                on_bytes(n)
        now = os.fstat(fin.fileno()).st_size
        if offset != size or now != size:
            raise CheckpointError(
                f"{src}: changed while it was copied ({size} bytes, then {now}); is training still "
                "writing it? Run again once it is not")
        os.fchmod(fout.fileno(), os.fstat(fin.fileno()).st_mode & 0o777 | 0o200)
        fout.flush()
        fsync(fout.fileno(), durable)
    return value


class CountingWriter:
    """A write-only file object that reports how many bytes went through it."""

    def __init__(self, f, on_bytes: Callable[[int], None]):
        self._f, self._on_bytes = f, on_bytes
        # torch's zip writer replaces a failed write's OSError (disk full, EFBIG) with its
        # own RuntimeError on cleanup; the first OS error is kept here to report the cause.
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._on_bytes(len(memoryview(data)))
        return n

    def flush(self) -> None:
        self._f.flush()


def _libc():
    """The C library through ctypes (for calls Python's os module lacks), or None."""
    import ctypes
    import ctypes.util

    try:  # glibc's name first: find_library runs `ldconfig -p` (tens of ms, in every worker)
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        pass
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported
    (old kernels, NFS, Lustre; overlayfs answers EXDEV)."""
    import ctypes

    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def aside_prefix(dest: Path) -> str:
    """Where `replace_dir` moves the old folder when it cannot swap: this prefix and its PID."""
    import socket

    return f".{dest.name}.tailor-old-{socket.gethostname()}-"


def replace_dir(new: Path, dest: Path, durable: bool = True) -> None:
    """Put the finished folder `new` at `dest`, replacing the folder there: swapped atomically
    where the kernel can (never a moment without one), else the old one is moved aside first
    and put back if the second rename fails. The old folder is deleted only at the end.
    Callers hold SIGINT/SIGTERM back around it; after a kill -9 between the two renames the
    old folder is found beside `dest` under `aside_prefix` (output.remove_stale restores it)."""
    if exchange(new, dest):  # the old folder is now at `new`
        fsync_dir(dest.parent, durable)
        shutil.rmtree(new, ignore_errors=True)
        return
    old = dest.parent / f"{aside_prefix(dest)}{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except OSError:
        os.rename(old, dest)  # put the user's old folder back
        raise
    fsync_dir(dest.parent, durable)
    shutil.rmtree(old, ignore_errors=True)


def open_fd(stack: contextlib.ExitStack, path: Target, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """os.open (`open_target`) whose descriptor `stack` closes (also when a later open fails)."""
    fd = open_target(path, flags, mode)
    stack.callback(os.close, fd)
    return fd


class OpenFiles:
    """Source files a writer reads, each opened once (read-only) and closed with `stack`."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack = stack
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = open_fd(self.stack, path)
        return self.fds[path]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pwrite_all(fd: int, data, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def copy_range(fin: int, fout: int, offset: int, count: int, *,
               on_bytes: Callable[[int], None] = lambda n: None, out_offset: int | None = None,
               writeback: Writeback | None = None) -> None:
    """Copy [offset, offset+count) of `fin` to `out_offset` (default: the same offset) of `fout`,
    in the kernel where possible."""
    end, delta = offset + count, (offset if out_offset is None else out_offset) - offset
    while offset < end:
        n = min(CHUNK, end - offset)
        try:
            copied = os.copy_file_range(fin, fout, n, offset, offset + delta)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            copied = 0
        if copied == 0:  # not supported here (or a short source): copy through user space
            data = pread_exact(fin, n, offset)
            pwrite_all(fout, data, offset + delta)
            copied = len(data)
        offset += copied
        if writeback is not None:
            writeback.advance(offset + delta)
        on_bytes(copied)


class Writeback:
    """Starts the disk writes of a file's dirty pages as they accumulate.

    Output files are fsynced before the composition counts as done; without this, all of a
    rank file's bytes would wait in the page cache and that fsync would write them all at
    the end, serially. sync_file_range(WRITE) queues the writes of each finished stretch
    (it does not wait), so the disk works while the composition goes on and the final fsync
    waits for the tail only. A no-op where the call does not exist.
    """

    STEP = 32 << 20
    _call: Callable[[int, int, int, int], int] | Literal[False] | None = None  # sync_file_range, once looked up

    def __init__(self, fd: int, durable: bool = True):
        self.fd, self.started, self.durable = fd, 0, durable
        if Writeback._call is None:
            Writeback._call = _sync_file_range() or False

    def advance(self, written_to: int) -> None:
        """Bytes up to `written_to` are written (in page cache)."""
        if Writeback._call and self.durable and written_to - self.started >= self.STEP:
            Writeback._call(self.fd, self.started, written_to - self.started, 2)  # SYNC_FILE_RANGE_WRITE
            self.started = written_to


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    import ctypes

    call = getattr(_libc(), "sync_file_range", None)
    if call is not None:
        call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call
