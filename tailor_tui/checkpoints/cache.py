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


def file_identity(path: Path) -> list:
    """What a cached result of reading `path` is keyed by: where it is, its size and mtime."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def entry(cache: Path | None, kind: str, key: str) -> Path | None:
    """The file of entry `key` (a hex digest) among the cache's `kind` entries; None: no cache."""
    return None if cache is None else cache / kind / key[:2] / f"{key}.json"


def read_json(path: Path | None, limit: int):
    """The JSON value in `path`, or None if there is none, it is larger than `limit` bytes or
    it is not JSON. The caller validates what it holds."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not block the scan
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        text = os.read(fd, st.st_size + 1)
        if len(text) > st.st_size:  # it grew while being read: not one of ours
            return None
        return json.loads(text)
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def write_json(path: Path | None, value) -> None:
    """Write `value` to `path` atomically; a read-only or full cache is skipped silently."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # one writer per name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
