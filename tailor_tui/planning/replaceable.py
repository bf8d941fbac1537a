"""What `--force` may replace: only what tailor-tui can prove it wrote.

An existing output is replaced only if it is an earlier tailor-tui output whose every entry is
accounted for by its provenance record (`tailor_provenance.json`, which lists every file it wrote
with its size and mtime, `written_files`):

- each regular file present is listed, with the size and mtime it was written with, and each
  listed file is present (a file replaced by a symbolic link, a folder or anything else is not);
- each folder present is one a listed file needs (its parent, or a folder above that);
- nothing else is there: no symbolic link (never followed: entries are compared by lstat), no
  FIFO, socket or device, no mount of another file system, no checkpoint training saved into it.

Anything else is refused, naming it: a folder without a record (a training run), a record that
cannot be read (not a regular file, too large, not JSON: read bounded, `side_files`), a record
without a file list (a tailor-tui before the list was kept: nothing proves what else was added),
a list that names a path outside the folder (absolute, `..`). The composer offers to replace an
output only where this says it may (`ui.composer`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import OUTPUT_FILES, PROVENANCE
from tailor_tui.checkpoints.scan import find_checkpoint_dirs, training_checkpoints
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json

_KINDS = {stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket",
          stat.S_IFCHR: "device", stat.S_IFBLK: "device", stat.S_IFDIR: "folder"}


def not_replaceable(out: Path) -> str | None:
    """Why `--force` must not replace the existing folder `out` (a phrase that follows "this one"),
    or None when it holds only what tailor-tui wrote there (see the module)."""
    provenance = out / PROVENANCE
    if not os.path.lexists(provenance):  # one that is no regular file is unreadable, below
        return f"holds {_what(out)}, not written by tailor-tui (it has no {PROVENANCE})"
    try:
        record = load_json(provenance, limit=MAX_RECORD, follow=False)
    except OSError as exc:
        return f"has an unreadable {PROVENANCE} ({exc.strerror or exc}); it is not trusted"
    except ValueError as exc:
        return f"has an unreadable {PROVENANCE} ({_short(str(exc))}); it is not trusted"
    written = record.get(OUTPUT_FILES) if isinstance(record, dict) else None
    if written is None:
        inside = [c for c in _inside(out) if c != "."]  # which of them tailor-tui wrote, nothing says
        held = f"; it holds checkpoint folder(s) {_names(inside)}" if inside else ""
        return (f"has a {PROVENANCE} without the list of files tailor-tui wrote (an older tailor-tui made it), "
                f"so nothing proves it holds only those{held}; remove it yourself once you have checked it")
    if why := _malformed(written):
        return f"has a {PROVENANCE} whose file list {why}; it is not trusted"
    return _unaccounted(out, written)


def _malformed(written) -> str | None:
    """Why a record's file list cannot be trusted (a phrase), or None."""
    if not isinstance(written, dict):
        return "is not a table of file names"
    for name, stamp in written.items():
        parts = name.split("/")
        if (not name or name.startswith("/") or "\0" in name or name == PROVENANCE
                or any(p in ("", ".", "..") for p in parts)):
            return f"names {name!r}, which is not a file inside the output (absolute, `..` or empty parts)"
        if not (isinstance(stamp, list) and len(stamp) == 2 and all(type(v) is int for v in stamp)):
            return f"gives {name!r} no [bytes, mtime_ns]"
    return None


def _unaccounted(out: Path, written: dict) -> str | None:
    """Why not every entry of `out` is accounted for by `written` (see the module), or None."""
    needed = {"/".join(name.split("/")[:i]) for name in written for i in range(1, name.count("/") + 1)}
    device = os.lstat(out).st_dev
    added: list[str] = []  # entries nobody listed
    replaced: list[str] = []  # listed files that are something else now
    changed: list[str] = []
    present: set[str] = set()
    folders = [""]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(out / folder) as entries:
                found = sorted((e.name, e.stat(follow_symlinks=False)) for e in entries)
        except OSError as exc:
            return f"has a folder that cannot be read ({folder or '.'}: {exc.strerror or exc})"
        for entry, st in found:
            name = f"{folder}/{entry}" if folder else entry
            kind = stat.S_IFMT(st.st_mode)
            if st.st_dev != device:
                added.append(f"{name} (a mount of another file system)")
            elif kind == stat.S_IFREG:
                if name in written:
                    present.add(name)
                    if written[name] != _stamp(st):
                        changed.append(name)
                elif name != PROVENANCE:
                    added.append(name)
            elif name in written:
                replaced.append(f"{name} (now a {_KINDS.get(kind, 'special file')})")
            elif kind == stat.S_IFDIR and name in needed:
                folders.append(name)
            else:
                added.append(name + "/" if kind == stat.S_IFDIR else f"{name} (a {_KINDS.get(kind, 'special file')})")
    if added:
        inside = _inside(out, training=True)
        why = f"training checkpoint(s) {_names(inside)}: did training resume into it?" if inside else \
            "did training resume into it?"
        return (f"is an earlier tailor-tui output that now also holds {_names(sorted(added))}, which tailor-tui "
                f"did not write ({why})")
    if replaced:
        return f"is an earlier tailor-tui output whose {_names(sorted(replaced))} is not the file tailor-tui wrote"
    if changed:
        return f"is an earlier tailor-tui output whose {_names(sorted(changed))} changed since it was written"
    if gone := sorted(set(written) - present):
        return f"is an earlier tailor-tui output whose {_names(gone)} is gone since it was written"
    return None


def _inside(folder: Path, training: bool = False) -> list[str]:
    """The checkpoint folders under `folder` (relative names; itself "."), or with `training` only
    those training saved, not those tailor-tui composed."""
    found = training_checkpoints(folder) if training else find_checkpoint_dirs(folder)
    return [os.path.relpath(c, folder) for c in found]


def _what(folder: Path) -> str:
    """What a folder holds, for a message: its checkpoints if it is a run, else some entries."""
    checkpoints = _inside(folder)
    if checkpoints:
        return f"{len(checkpoints)} checkpoint(s) ({_names(checkpoints)})"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'} ({_names(entries)})"


def _names(names: list[str], most: int = 3) -> str:
    """Some names, for a one-line message (one with a control character or a newline as repr shows it)."""
    return ", ".join(n if n.isprintable() else repr(n) for n in names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _short(text: str, most: int = 160) -> str:
    return text if len(text) <= most else text[:most] + "…"


def written_files(folder: Path) -> dict[str, list[int]]:
    """Every regular file under `folder` (relative path -> [bytes, mtime_ns], by lstat): what a
    provenance record lists."""
    return {str(p.relative_to(folder)): _stamp(p.lstat()) for p in sorted(folder.rglob("*"))
            if stat.S_ISREG(p.lstat().st_mode)}


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns]
