"""The cache outside every run: where it lives, what its entries are keyed by, reading and writing them.

Row statistics (`stats_run`) and what scanning reads of each checkpoint's model_states
file (`scan_cache`) are cached under `cache_dir()`, never inside a run (sources stay
read-only). Entries are JSON, never pickle: reading the cache runs nothing. A cache file
is an input like any other: read up to a bound and validated by its reader, anything
unreadable or of another format is computed again. Writes are atomic (a temporary file
renamed into place); a read-only or full cache is skipped.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import stat
import threading
from pathlib import Path

from tailor_tui.checked.files import FileIdentity
from tailor_tui.checkpoints.side_files import load_json


class Where(enum.Enum):
    ROOT = "the cache root"  # cache_dir(), as the environment names it when the cache is used


ROOT = Where.ROOT


def chosen(cache: Path | None | Where) -> Path | None:
    """The folder a `cache=` option names: ROOT is cache_dir() now; None: no cache."""
    return cache_dir() if cache is ROOT else cache


def cache_dir() -> Path:
    """Where results are cached: $TAILOR_TUI_CACHE, else $XDG_CACHE_HOME/tailor-tui, else
    ~/.cache/tailor-tui (never inside a run: sources stay read-only)."""
    if os.environ.get("TAILOR_TUI_CACHE"):
        return Path(os.environ["TAILOR_TUI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tailor-tui"


def file_identity(path: Path, folders: dict | None = None) -> list:
    """What a cached result of reading `path` is keyed by: where it is, which file it is (device,
    inode), its size, mtime and ctime. A file changed in place and given back its size and mtime
    (`touch -r`) still has a new ctime, which no user can set back: its results are computed again.
    `folders`: the real paths of folders, kept by a caller that asks for many files of a few
    folders (a wide run's rank files), whose own paths are not links: one lstat each, not one per
    folder above it."""
    plain = folders is not None and ".." not in str(path).split(os.sep)  # (`..` after a link: realpath's to say)
    st = os.lstat(path) if plain else None
    if st is None or stat.S_ISLNK(st.st_mode):
        st = os.stat(path)
        return [os.path.realpath(path), *FileIdentity.of(st)]
    assert folders is not None, "lstat'ed only with folders"
    folder, name = os.path.split(os.path.abspath(path))
    if folder not in folders:
        folders[folder] = os.path.realpath(folder)
    real = os.path.join(folders[folder], name) if name not in ("", ".") else os.path.realpath(path)
    return [real, *FileIdentity.of(st)]


def identity_key(path: Path, folders: dict | None = None) -> str:
    """`file_identity`, as a string: what cache keys and entries name a file by (OSError where it
    cannot be looked at)."""
    return json.dumps(file_identity(path, folders))


def entry(cache: Path | None, kind: str, key: str) -> Path | None:
    """The file of entry `key` (a hex digest) among the cache's `kind` entries; None: no cache."""
    return None if cache is None else cache / kind / key[:2] / f"{key}.json"


def read_json(path: Path | None, limit: int):
    """The JSON value in `path`, or None if there is none, it is not a regular file of ours (a
    symlink, a FIFO), it is larger than `limit` bytes, nests too deeply or is not JSON. The
    caller validates what it holds."""
    if path is None:
        return None
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid():  # planted by someone else in a shared cache: not trusted
            return None
        return load_json(path, limit, follow=False)
    except (OSError, ValueError):
        return None


def write_json(path: Path | None, value) -> None:
    """Write `value` to `path` atomically: a new file of this user's (0600, created exclusively,
    never through a symlink) renamed into place; the cache's folders are made 0700. A read-only
    or full cache, or a folder of the cache that is not this user's, is skipped silently."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # one writer per name
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path.parent)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(value, separators=(",", ":")).encode())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
