"""Reading a verification's bytes: reused buffers compared by memcmp, and descriptors kept only where they are the
files named.

A comparison holds a buffer per reading thread for the output and a few for its sources (`Buffer`,
`SourceWindows`), filled by pread and compared with the C library's memcmp (Python's comparison of two memoryviews
goes element by element, ~20x slower); `first_difference` finds the first byte two differing buffers differ at, by
halves. A thread opens each file it reads itself (`Descriptors`), and reads it only where it is, by fstat of the
descriptor, the file first looked at (its identity: inode, size, times); `close` looks again, and says which changed
meanwhile.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from tailor_tui.checked.files import FileIdentity, open_regular
from tailor_tui.checked.ranges import READ_CHUNK, Readahead
from tailor_tui.errors import CheckpointError

WINDOW = 1 << 20  # bytes of a source one read holds for the claims that follow it (`SourceWindows`)

_ZEROS = bytearray(READ_CHUNK)


def _memcmp():
    try:
        libc = ctypes.CDLL(None)
        function = libc.memcmp
    except (OSError, AttributeError):  # no C library to call: Python's comparison, a copy each
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


_MEMCMP = _memcmp()


class Buffer:
    """A reused read buffer and its address (for memcmp); `file`, `start`, `length`: which bytes of which file it
    holds, where a reader keeps them for the reads that follow (`file` -1: none)."""

    def __init__(self, size: int = READ_CHUNK):
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.data)) if _MEMCMP else 0
        self.file, self.start, self.length = -1, 0, 0

    def holds(self, f: int, at: int, n: int) -> bool:
        """Whether bytes [at, at+n) of file `f` are in the buffer (from `at - start`)."""
        return self.file == f and self.start <= at and at + n <= self.start + self.length

    def forget(self) -> None:
        self.file = -1


class SourceWindows:
    """A reading thread's buffers for its sources' bytes: `count` windows of WINDOW bytes, each holding a stretch of
    one source read once for the claims on it that follow while claims on other sources come between (a
    composition's rows alternate between their checkpoints), and one of READ_CHUNK bytes for a part larger than a
    window (read as it is, kept for nothing)."""

    def __init__(self, count: int = 4):
        self.count, self.size = count, WINDOW
        self.buffers: list[Buffer] = []  # the most recently used last
        self._large: Buffer | None = None

    def holding(self, f: int, at: int, n: int) -> Buffer | None:
        """The window holding bytes [at, at+n) of file `f`, if one does."""
        for k, buffer in enumerate(self.buffers):
            if buffer.holds(f, at, n):
                self.buffers.append(self.buffers.pop(k))
                return buffer
        return None

    def free(self, f: int) -> Buffer:
        """A window to read bytes of `f` into: the one holding others of `f`, else a new one, else the least
        recently used."""
        k = next((k for k, b in enumerate(self.buffers) if b.file == f), None)
        if k is None and len(self.buffers) < self.count:
            self.buffers.append(Buffer(self.size))
        else:
            self.buffers.append(self.buffers.pop(0 if k is None else k))
        return self.buffers[-1]

    def large(self) -> Buffer:
        """The READ_CHUNK-sized buffer, its bytes anyone's."""
        if self._large is None:
            self._large = Buffer()
        return self._large

    def forget(self) -> None:
        for buffer in self.buffers:
            buffer.forget()


_ZERO_ADDRESS = ctypes.addressof(ctypes.c_char.from_buffer(_ZEROS)) if _MEMCMP else 0


def same(a: Buffer, at_a: int, b: Buffer | None, at_b: int, n: int) -> bool:
    """Whether `n` bytes of `a` from `at_a` equal those of `b` from `at_b` (`b` None: zero bytes)."""
    if _MEMCMP is not None:
        other = _ZERO_ADDRESS if b is None else b.address + at_b
        return _MEMCMP(a.address + at_a, other, n) == 0
    theirs = bytes(n) if b is None else bytes(b.view[at_b: at_b + n])
    return bytes(a.view[at_a: at_a + n]) == theirs


def opened(path: Path) -> int:
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None


class Descriptors:
    """The descriptors one task reads through: each file opened when first needed, and kept only where it is the
    file named (its identity); `close` looks at each again, and says which changed meanwhile. `ahead`: the kernel
    asked to read on ahead of a sequential reader of one (a cold disk kept busy while bytes are compared)."""

    def __init__(self, paths: list[Path], identities: list[FileIdentity]) -> None:
        self.paths, self.identities, self.fds = paths, identities, dict[int, int]()
        self._ahead: dict[int, Readahead] = {}

    def ahead(self, f: int, position: int, end: int) -> None:
        """About to read file `f` from `position` on, up to `end`."""
        if f not in self._ahead:
            self._ahead[f] = Readahead(self[f])
        self._ahead[f].before(position, end)

    def __getitem__(self, f: int) -> int:
        if f not in self.fds:
            fd = self.fds[f] = opened(self.paths[f])
            if FileIdentity.of(os.fstat(fd)) != self.identities[f]:
                raise Moved(f)
        return self.fds[f]

    def close(self) -> list[int]:
        moved = [f for f, fd in self.fds.items() if FileIdentity.of(os.fstat(fd)) != self.identities[f]]
        for fd in self.fds.values():
            os.close(fd)
        self.fds, self._ahead = {}, {}
        return moved


class Moved(Exception):
    """A file that is not, when a task opens it, the one the claims were made of."""

    def __init__(self, f: int):
        self.f = f


def first_difference(a: Buffer, at_a: int, b: Buffer | None, at_b: int, n: int) -> int:
    """The first of `n` bytes (known to differ somewhere) where `a` and `b` differ, by halves."""
    low = 0
    while n > 1:
        half = n // 2
        if same(a, at_a + low, b, at_b + low, half):
            low, n = low + half, n - half
        else:
            n = half
    return low


