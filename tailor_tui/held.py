"""The hidden folder an output is written in, held open by descriptor, and the places inside it.

A job's hidden folder sits beside the output, in a folder others may be able to write (a project
folder, mode 2775): they cannot write inside it (it is 0700), but they can rename it aside and put
a folder of their own, with links in it, at its path. So nothing is made in it by path. Each
process opens it once (`HeldFolder`: never through a link, a folder of this user's, the one the
job made, told by device and inode) and makes every file and folder inside it relative to that
descriptor (`HeldPath`), one component at a time, none of them followed if it is a link. A swap after
the opening cannot move where anything goes; one before it is found at the opening.

A `HeldFolder` travels to worker processes (pickled) as its path and identity; the worker opens it
again and checks that it is the same folder before it writes anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.errors import OutputError

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def own_folder(st: os.stat_result) -> bool:
    """Whether what `st` (an lstat's or an fstat's: a link is no folder) describes is a folder of
    this user's."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def swapped(path: Path) -> OutputError:
    """The one line of a hidden folder that is no longer the one the job made."""
    return OutputError(f"{path}: no longer the folder tailor-tui made there (it was renamed, and something else "
                       f"put in its place: someone else who can write in {path.parent}?); nothing was published, "
                       "and what is there now is left alone: run again, in a folder only you can write")


class HeldFolder:
    """A folder of this user's at `path`, opened (once per process, at its first use) by descriptor;
    `identity` (device, inode): the folder it must be, else it is taken to be the one found at the
    first opening. `folder / "a/b"` is a `HeldPath` inside it."""

    def __init__(self, path: Path, identity: tuple[int, int] | None = None):
        self.path, self.identity = Path(path), identity
        self._fd: int | None = None

    @classmethod
    def make(cls, path: Path) -> "HeldFolder":
        """A new folder at `path` (0700: this user's alone), opened at once (OSError if it cannot be
        made; OutputError if what is at `path` by the time it is opened is not it)."""
        os.mkdir(path, 0o700)
        held = cls(path)
        held.fd()
        return held

    def fd(self) -> int:
        """Its descriptor, opened now if this process has none: OutputError where what is at its path
        is not a folder of this user's, or not the one it must be."""
        if self._fd is None:
            try:
                fd = os.open(self.path, DIRECTORY)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise swapped(self.path) from None  # a link or a file in its place, or nothing
                raise
            st = os.fstat(fd)
            if not own_folder(st) or (self.identity is not None and (st.st_dev, st.st_ino) != self.identity):
                os.close(fd)
                raise swapped(self.path)
            self.identity, self._fd = (st.st_dev, st.st_ino), fd
            weakref.finalize(self, os.close, fd)
        return self._fd

    def vanished(self) -> bool:
        """Whether the folder this process holds is no longer at its path (renamed away, or removed: by
        another process of the job that found it swapped, or by someone else)."""
        if self._fd is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity or os.fstat(self._fd).st_nlink == 0

    def __getstate__(self) -> dict:
        return {"path": self.path, "identity": self.identity}  # a descriptor is this process's alone

    def __setstate__(self, state: dict) -> None:
        self.path, self.identity, self._fd = state["path"], state["identity"], None

    def __truediv__(self, rel: str | os.PathLike[str]) -> "HeldPath":
        return HeldPath(self, ()) / rel

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"HeldFolder({str(self.path)!r})"


@contextlib.contextmanager
def _blamed(folder: HeldFolder):
    """An OSError inside a held folder that is no longer at its path is that (`swapped`), not the disk's."""
    try:
        yield
    except OSError:
        if folder.vanished():
            raise swapped(folder.path) from None
        raise


@dataclass(frozen=True)
class HeldPath:
    """A file or folder inside a `HeldFolder`, by its path from there; made and opened relative to the
    held folder's descriptor. Named in messages by its path (`str`)."""

    folder: HeldFolder
    parts: tuple[str, ...]

    def __truediv__(self, rel: str | os.PathLike[str]) -> "HeldPath":
        parts = [p for p in os.fspath(rel).split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"{rel}: a place inside the output never climbs out of it")
        return HeldPath(self.folder, (*self.parts, *parts))

    @property
    def name(self) -> str:
        return self.parts[-1] if self.parts else self.folder.path.name

    @property
    def stem(self) -> str:
        return Path(self.name).stem

    @property
    def parent(self) -> "HeldPath":
        return HeldPath(self.folder, self.parts[:-1])

    @property
    def path(self) -> Path:
        """Where it is now by path (for messages, and for reading back what was written)."""
        return self.folder.path.joinpath(*self.parts)

    def __str__(self) -> str:
        return str(self.path)

    def open(self, flags: int, mode: int = 0o644) -> int:
        """os.open of this place (never through a link, on the way or at its end)."""
        if not self.parts:
            raise IsADirectoryError(errno.EISDIR, "the held folder itself", str(self.path))
        with _blamed(self.folder):
            parent = self._folder_fd(self.parts[:-1], make=False)
            try:
                return os.open(self.parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
            finally:
                if parent != self.folder.fd():
                    os.close(parent)

    def unlink(self) -> None:
        """Remove this file (a name in its folder, as os.unlink: never what a link points to)."""
        if not self.parts:
            raise IsADirectoryError(errno.EISDIR, "the held folder itself", str(self.path))
        with _blamed(self.folder):
            parent = self._folder_fd(self.parts[:-1], make=False)
            try:
                os.unlink(self.parts[-1], dir_fd=parent)
            finally:
                if parent != self.folder.fd():
                    os.close(parent)

    def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        """Make this folder (as Path.mkdir: `parents`, `exist_ok`), inside the held folder."""
        if not self.parts:
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, "the held folder itself", str(self.path))
            return
        with _blamed(self.folder):
            parent = self._folder_fd(self.parts[:-1], make=parents)
            try:
                os.mkdir(self.parts[-1], mode, dir_fd=parent)
            except FileExistsError:
                if not exist_ok:
                    raise
                os.close(os.open(self.parts[-1], DIRECTORY, dir_fd=parent))  # a folder, not a link or a file
            finally:
                if parent != self.folder.fd():
                    os.close(parent)

    def _folder_fd(self, parts: tuple[str, ...], make: bool) -> int:
        """The descriptor of the folder `parts` below the held one (the held folder's own for none; the
        caller closes any other), each component opened without following a link; `make`: folders
        that are not there are made."""
        fd = self.folder.fd()
        for part in parts:
            if make:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                inner = os.open(part, DIRECTORY, dir_fd=fd)
            finally:
                if fd != self.folder.fd():
                    os.close(fd)
            fd = inner
        return fd
