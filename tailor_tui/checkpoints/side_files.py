"""Reading a checkpoint's small side files (config.json, trainer_state.json, a manifest, an
index, the DeepSpeed config a run names) as hostile input: bounded in size and in nesting.

A side file must be a regular file: a FIFO, device or socket named in its place is refused
without being read (`/dev/zero` would grow without end, a FIFO would block). It is read up to a
size bound (1 MiB unless the caller allows more, `$TAILOR_TUI_MAX_SIDE_FILE` raises the default)
and its JSON may nest at most MAX_DEPTH levels. Each refusal is a ValueError saying what the
file is instead; an unreadable one an OSError.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tailor_tui.reading import open_regular
from tailor_tui.units import whole_number

MAX_SIDE_FILE = 1 << 20  # bytes: config.json and the like are a few KiB
MAX_RECORD = 64 << 20  # records that grow with the model or the run: an index, a manifest, a provenance record
MAX_DEPTH = 64  # nesting of JSON arrays and objects: HF configs nest three or four levels
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(rb"[\[\]{}]")


def side_file_limit() -> int:
    """The default size bound of a side file: MAX_SIDE_FILE, or `$TAILOR_TUI_MAX_SIDE_FILE` bytes."""
    value = os.environ.get("TAILOR_TUI_MAX_SIDE_FILE", "")
    bound = whole_number(value)
    return bound if bound else MAX_SIDE_FILE


def read_small(path: Path, limit: int | None = None, *, follow: bool = True, within: Path | None = None) -> bytes:
    """The bytes of the regular file at `path`, refused (ValueError) if it is not one or holds
    more than `limit` bytes (default `side_file_limit()`); `follow=False`: a symlink at `path`
    is refused too (OSError ELOOP); `within`: the run folder it lies in, which no link on the way
    may leave (CheckpointError, `reading.confine`)."""
    limit = side_file_limit() if limit is None else limit
    fd = open_regular(path, follow=follow, within=within)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise ValueError(f"{st.st_size:,} bytes, more than the {limit:,} such a file may hold; not read")
        parts, got = [], 0
        while got <= limit:
            part = os.read(fd, limit + 1 - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        if got > limit:
            raise ValueError(f"it grew past {limit:,} bytes while being read; not read")
        return b"".join(parts)
    finally:
        os.close(fd)


def parse_json(text: bytes | str, depth: int = MAX_DEPTH):
    """The JSON value of `text`, refused (ValueError) if it nests deeper than `depth` levels."""
    raw = text.encode() if isinstance(text, str) else text
    level = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b'""', raw)):
        level += 1 if bracket in b"[{" else -1
        deepest = max(deepest, level)
    if deepest > depth:
        raise ValueError(f"JSON nested {deepest} levels deep, more than the {depth} a side file may nest")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def load_json(path: Path, limit: int | None = None, depth: int = MAX_DEPTH, *, follow: bool = True,
              within: Path | None = None):
    """The JSON value of the side file `path` (bounded as `read_small` and `parse_json`)."""
    return parse_json(read_small(path, limit, follow=follow, within=within), depth)
