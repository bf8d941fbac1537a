"""An output file that starts as a clone of the base's: the blocks are shared, not written.

XFS (reflink, the default since xfsprogs 5.1), Btrfs and OpenZFS ≥ 2.2 share blocks between files
through the FICLONE ioctl: the clone costs no space and no writes until a block of it is written
(copy-on-write copies that block only). NFS 4.2, CephFS and SMB have no FICLONE but copy in the
server (`copy_file_range`), which shares blocks where the server's filesystem can. A writer clones
the base's file into its (new, empty) output file, then writes only the ranges that change
(`rank_stream`, `model_files`, `bin_files`); where the filesystem cannot (another filesystem,
ext4, tmpfs), `clone` says so and the writer writes every byte, as it always has.

`--no-clone` (`TaskOptions.clone`) makes every writer write every byte.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

FICLONE = 0x40049409  # _IOW(0x94, 9, int): clone all of the file whose descriptor is passed
# What FICLONE answers where the filesystem (or the pair of files) cannot share blocks: then the
# writer writes every byte. Any other error (ENOSPC, EIO, ...) is the output's and fails the task.
CANNOT = frozenset({errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY, errno.ENOSYS})
# Filesystems that copy in the server through copy_file_range (their kernel clients have no FICLONE)
SERVER_COPY = frozenset({"nfs", "nfs4", "ceph", "cifs", "smb3"})
COPY_STEP = 1 << 30  # bytes per copy_file_range call of a server-side copy (progress between them)


def worth_it(replaced: int, size: int) -> bool:
    """Whether a file of `size` bytes, `replaced` of which are written anew, is better cloned first:
    when less than half of it is replaced (more: writing every byte costs about as much, and leaves
    no file fragmented by copy-on-write)."""
    return 2 * replaced < size


def clone(fin: int, fout: int, fs_type: str | None = None) -> str | None:
    """Make the empty file `fout` a copy of `fin` that shares its blocks: "reflink" (FICLONE), or
    "server-side copy" on a network filesystem that copies in its server (`fs_type`, as
    `filesystem_type` names it; looked up when None). None: this filesystem cannot (or the two files
    are on different ones); `fout` is left empty for the writer to write every byte."""
    try:
        fcntl.ioctl(fout, FICLONE, fin)
        return "reflink"
    except OSError as exc:
        if exc.errno not in CANNOT:
            raise
    if (fs_type or filesystem_type(fout)) not in SERVER_COPY or os.fstat(fin).st_dev != os.fstat(fout).st_dev:
        return None
    size, at = os.fstat(fin).st_size, 0
    try:
        while at < size:
            copied = os.copy_file_range(fin, fout, min(COPY_STEP, size - at), at, at)
            if copied == 0:
                break
            at += copied
    except OSError as exc:
        if exc.errno not in CANNOT:
            raise
    if at != size:  # not copied whole in the server: written by the writer instead
        os.ftruncate(fout, 0)
        return None
    return "server-side copy"


def filesystem_type(target: int | str | Path) -> str | None:
    """The type of the filesystem holding `target` (a descriptor or a path), as /proc/self/mountinfo
    names it ("xfs", "btrfs", "nfs4", ...); None where it cannot be told."""
    try:
        dev = os.fstat(target).st_dev if isinstance(target, int) else os.stat(target).st_dev
        with open("/proc/self/mountinfo") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError:
        return None
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:  # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and " - " in line:
            return line.split(" - ", 1)[1].split()[0]
    return None


def may_share(base: Path, output_parent: Path) -> str | None:
    """Why the output (made in `output_parent`) may share the base's blocks, for the plan: "the
    base's xfs filesystem" where both lie on one filesystem of a type that can; None where they
    cannot (what the writers then find out for sure, file by file, is in the log)."""
    try:
        same = os.stat(base).st_dev == os.stat(output_parent).st_dev
    except OSError:
        return None
    kind = filesystem_type(output_parent)
    if same and kind in {"xfs", "btrfs", "zfs", "bcachefs", "ocfs2", *SERVER_COPY}:
        return f"the base's {kind} filesystem"
    return None
