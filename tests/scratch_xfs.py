"""A loop-mounted XFS with reflink, for the tests and benches of block sharing (`cloning`).

`mkfs.xfs -m reflink=1` on a sparse file, mounted with `mount -o loop`: a filesystem that shares
blocks on any Linux machine where this runs as root and xfsprogs is installed. `unavailable` says
in one line why it cannot be made here (the reason a test skips with).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def unavailable() -> str | None:
    """Why a loop XFS cannot be mounted here; None where it can (as far as can be told unmounted)."""
    if os.name != "posix" or not Path("/proc/filesystems").exists():
        return "not Linux"
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    if shutil.which("mkfs.xfs") is None:
        return "mkfs.xfs is not installed (xfsprogs: `apt-get install xfsprogs`)"
    if shutil.which("mount") is None or shutil.which("losetup") is None:
        return "mount/losetup are not installed (util-linux)"
    if "xfs" not in Path("/proc/filesystems").read_text().split() and shutil.which("modprobe"):
        subprocess.run(["modprobe", "xfs"], capture_output=True)
    if "xfs" not in Path("/proc/filesystems").read_text().split():
        return "this kernel has no XFS"
    return None


@contextlib.contextmanager
def loop_xfs(image: Path, mountpoint: Path, size: int = 4 << 30) -> Iterator[Path]:
    """A fresh XFS with reflink in the sparse file `image`, mounted at `mountpoint` while in the
    block; unmounted and the image removed after. Raises RuntimeError (one line: the command's own
    message) where it cannot be made."""
    image.parent.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    try:
        for command in (["mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)],
                        ["mount", "-o", "loop", str(image), str(mountpoint)]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                said = (done.stderr or done.stdout).strip().splitlines()
                raise RuntimeError(f"{command[0]}: {said[-1] if said else f'exit {done.returncode}'}")
        try:
            yield mountpoint
        finally:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    finally:
        image.unlink(missing_ok=True)


def shared_bytes(path: Path) -> int:
    """Bytes of `path` in extents marked shared (FIEMAP, through `filefrag -v`); after a sync."""
    os.sync()
    done = subprocess.run(["filefrag", "-v", "-b1", str(path)], capture_output=True, text=True, check=True)
    total = 0
    for line in done.stdout.splitlines():
        fields = line.replace(":", " ").replace("..", " ").split()
        if "shared" in line and len(fields) >= 6 and fields[0].isdigit():
            total += int(fields[5])  # ext, logical start, end, physical start, end, length (bytes with -b1)
    return total
