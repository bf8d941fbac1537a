"""Which file is read: a regular file only, never through a symbolic link that leaves its run
(`confine`), and the file the plan recorded (`FileIdentity`, `PlannedFiles`), compared by fstat of
the descriptor in the process that reads it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

from tailor_tui.errors import CheckpointError

NOT_REGULAR = "not a regular file (a FIFO, a device or a socket); not read"


class NotRegular(CheckpointError, ValueError):
    """`path` is no regular file (`NOT_REGULAR`): a checkpoint's damage, one line naming it; a ValueError too, for
    the readers that note a side file they cannot read and go on."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path}: {NOT_REGULAR}")


# --- symbolic links: never out of the run -------------------------------------------------------
#
# The one rule for links inside a checkpoint (docs/security.md, "Symbolic links"): a link on the
# way from a run folder down to a file it holds (the checkpoint folder, a subfolder, the tag
# folder, the file itself) is followed only where it leads inside that run folder, found by
# resolving it whole (chains, `..`) and comparing the folders above the result with the run
# folder by identity (device, inode), so another name of the run (a bind mount) is inside and a
# look-alike path is not. A link that leads out of the run, or nowhere, refuses the checkpoint in
# one line naming it and its target; a link to a FIFO or device is left to the regular-file check
# (refused unread, as such).


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _inside(real: str, run: tuple[int, int], run_real: str) -> bool:
    """Whether the resolved path `real` lies below the run folder (its identity `run`)."""
    if real.startswith(run_real.rstrip("/") + "/"):
        return True
    for parent in Path(real).parents:
        try:
            if identity(os.stat(parent)) == run:
                return True
        except OSError:
            return False
    return False


def link_refusal(link: Path, target: str, run: Path, why: str = "") -> CheckpointError:
    """The one line refusing a link that leaves the run (`why` says otherwise: it leads nowhere, …)."""
    folder = os.path.isdir(target)
    what, fix = (("folder", f"rm {link} && cp -r {target} {link}") if folder
                 else ("file", f"cp --remove-destination {target} {link}"))
    return CheckpointError(f"{link} is a symbolic link to {target}, {why or f'outside the run {run}'}; tailor-tui "
                           f"reads no file through a link that leaves the run: replace it with the {what} itself "
                           f"({fix}) if you trust it")


def confine(path: Path, run: Path) -> tuple[int, int] | None:
    """Check every symbolic link on `path` below the folder `run` (`path` spelled as run/…) by the
    rule above: CheckpointError for one that leads out of the run or nowhere. Returns the
    identity of what `path` leads to, or None where nothing is there."""
    st = confined(path, run)
    return None if st is None else identity(st)


def confined(path: Path, run: Path) -> os.stat_result | None:
    """`confine`, returning what stat finds at `path` (None: nothing there, or nothing stat can see): what a
    caller that describes the file (a checkpoint's thousands of rank files) would otherwise stat again."""
    spelled, top = os.path.abspath(path), os.path.abspath(run)
    if spelled != top and not spelled.startswith(top.rstrip(os.sep) + os.sep):
        raise ValueError(f"{path} is not spelled below {run}")
    parts = [p for p in spelled[len(top):].split(os.sep) if p]
    at, st = os.fspath(run), None
    for part in parts:
        at = os.path.join(at, part)
        try:
            st = os.lstat(at)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISLNK(st.st_mode):
            continue  # (the common case: what the run is and where it lies are looked up for a link only)
        link = Path(at)
        try:
            run_st = os.stat(run)
        except OSError:
            return None
        run_real, real = os.path.realpath(run), os.path.realpath(link)
        try:
            target = os.stat(real)
        except OSError:
            raise link_refusal(link, os.readlink(link), run, "which leads nowhere (nothing is there)") from None
        special = not (stat.S_ISREG(target.st_mode) or stat.S_ISDIR(target.st_mode))
        if identity(target) == identity(run_st):
            raise link_refusal(link, real, run, "the run folder itself (a loop)")
        if not special and not _inside(real, identity(run_st), run_real):
            raise link_refusal(link, real, run)
    if st is not None and not stat.S_ISLNK(st.st_mode) and at == os.fspath(path):
        return st  # (what lstat found of a path spelled as given, no link at its end: what stat finds)
    try:
        return os.stat(path)
    except OSError:
        return None


def open_regular(path: Path, *, follow: bool = True, within: Path | None = None) -> int:
    """A read-only descriptor of the regular file at `path`. A FIFO, device or socket there is
    refused (`NotRegular`) without being opened: a FIFO would wait for a writer, and
    /dev/zero never ends. `follow=False`: a symbolic link at `path` is refused too (OSError ELOOP).
    `within`: the run folder `path` lies in; a link on the way that leaves it is refused (`confine`),
    and so is a file that is not, once opened, the one checked (a link swapped in meanwhile)."""
    expected = confine(path, within) if within is not None else None
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except PermissionError:  # not damage: said as what it is
        raise CheckpointError(f"{path}: cannot be read (permission denied: its owner is uid {st.st_uid}, its mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); ask its owner to let you read it, or compose "
                              "from a copy you can read") from None
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):  # put in its place since: not read either
        os.close(fd)
        raise NotRegular(path)
    if within is not None and identity(opened) != expected:
        os.close(fd)
        raise CheckpointError(f"{path}: changed while it was opened (another file, or a symbolic link, was put in "
                              "its place); not read: run again once nothing changes the run")
    return fd


# --- a file's identity: the one the plan recorded, the one read ----------------------------------
#
# A checkpoint's files are looked at when it is opened (`checkpoints.checkpoint`, which records each
# one's identity) and read later, by workers, maybe minutes later (the composer) and in other
# processes. Training may save again meanwhile, in place or by renaming a new file over the old. A
# task opens each file it reads and compares what it opened (fstat of the descriptor, in the process
# that reads it) with what the plan recorded, then again once it has read everything: any write
# changes a file's ctime, which no user can set back, and a rename gives the path another inode
# (and the renamed file a new ctime), so bytes read between two equal identities are the planned
# file's bytes. A file that changed is refused in one line (exit 4), never read into an output.


class FileIdentity(NamedTuple):
    """Which file, and which state of it: device, inode, size, mtime and ctime (ns)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def differences(self, other: "FileIdentity") -> str:
        """What differs between the two, in words ("its size 10 -> 12, its ctime")."""
        said = []
        if (self.device, self.inode) != (other.device, other.inode):
            said.append("another file is in its place")
        if self.size != other.size:
            said.append(f"its size {self.size:,} -> {other.size:,} bytes")
        said += [f"its {what}" for what, a, b in (("mtime", self.mtime_ns, other.mtime_ns),
                                                  ("ctime", self.ctime_ns, other.ctime_ns)) if a != b]
        return ", ".join(said)


def changed_error(path: Path, planned: FileIdentity, now: FileIdentity, when: str) -> CheckpointError:
    """The one line refusing a file that is not, or no longer, the one the plan recorded."""
    return CheckpointError(f"{path}: changed {when} ({planned.differences(now)}); nothing read from it is used: "
                           "run again once nothing writes to the run (training saving a checkpoint)")


MAX_HELD = 64  # descriptors a task keeps open between its two looks at its files; the rest are reopened


class PlannedFiles:
    """The files a task reads, each the file the plan recorded (`identities`: path -> FileIdentity).

    Entering opens each (a regular file only) and compares its descriptor's identity (fstat) with
    the planned one, holding the descriptor; leaving without an exception looks again, by fstat of
    the same descriptor (or of the path opened anew, past MAX_HELD descriptors), and refuses the task
    if any changed while it was read. The task's readers open the files by path in between: what they
    read is what the two equal looks bracket (the module's account above)."""

    def __init__(self, identities: Mapping[Path, FileIdentity], since: str = "since the composition was planned"):
        self.identities, self.since = identities, since  # (`since`: when they were recorded, as the line says it)
        self._held: dict[Path, int] = {}

    def __enter__(self) -> "PlannedFiles":
        try:
            for path in self.identities:
                fd = self._open_checked(path, self.since)
                if len(self._held) < MAX_HELD:
                    self._held[path] = fd
                else:
                    os.close(fd)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                for path, planned in self.identities.items():
                    if path in self._held:
                        now = FileIdentity.of(os.fstat(self._held[path]))
                    else:
                        os.close(self._open_checked(path, "while it was read"))
                        continue
                    if now != planned:
                        raise changed_error(path, planned, now, "while it was read")
        finally:
            self.close()

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def _open_checked(self, path: Path, when: str) -> int:
        try:
            fd = open_regular(path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot be opened any more ({exc}); it changed {when}: run again once "
                                  "nothing writes to the run (training saving a checkpoint)") from None
        planned, now = self.identities[path], FileIdentity.of(os.fstat(fd))
        if now != planned:
            os.close(fd)
            raise changed_error(path, planned, now, when)
        return fd


def read_as_planned(job, call: Callable, identities: Mapping[Path, FileIdentity], *args):
    """A task (`team.transaction.Task`: `call(job, *args)`) whose every source file is checked to be the one
    its plan recorded, in the process that runs it, before and after it reads (`PlannedFiles`): a file that
    training saved again meanwhile fails the task in one line (exit 4), and nothing is published."""
    with PlannedFiles(identities):
        return call(job, *args)
