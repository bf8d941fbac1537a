"""What the run's statistics established of each rank file, as the file was when they read it, cached.

The statistics read every record of a rank file whole, check its CRC-32 and count its NaN/Inf; the
same reads give the CRC-32 of each 1 MiB block of a record (`checked.crc.BlockCrcs`). Of each file
they read they record its facts (`FileFacts`): the block CRC-32s of each record that passed its
CRC-32 check, and the rows whose bytes in this file are whole and finite. The facts are cached in
the one store (`cache`), one entry per folder of rank files (O(checkpoints) entries, as the
statistics' sums), each file's facts under that file's identity (`cache.file_identity`: device,
inode, size, mtime, ctime) as the statistics saw it before reading it.

Planning looks a source's files up by their identity now (`cached`: a stat per file, no rank file
read) and decides once what each rank's task reads (`planning.reads`): a file changed since, in any
way a user can change it, has another identity and has no facts: it is read whole and counted, as
before. The facts are evidence of what the bytes should be, never proof of what they are now: the
writer still reads every byte it keeps or takes and checks it (`checked.evidence`); a file that
rotted without its identity changing fails the check of a block it reads.

An entry is an input like any other: read up to a bound, every value's type, range and length
checked against what it claims (`from_json`); anything else is not used (its files are read
whole). Numpy-free: the process that plans the statistics and the one that plans a composition
read it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import NamedTuple

from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.checkpoints.cache import entry, identity_key, read_json, write_json

FORMAT = 2  # of the cached facts: bump when what they mean changes (2: the rows found finite beside the blocks)
MAX_CACHED = 64 << 20  # a folder's entry (~5.4 bytes per MiB of its rank files: ~12 TiB of them); larger: not ours
_MAX_OFFSET = 1 << 62  # no file is larger
MAX_ROW_NAME = 1024  # a row's name (`model.layers.12`): longer is not one of ours


class FileFacts(NamedTuple):
    """What the statistics established of one rank file, as it was when they read it."""

    blocks: dict[str, RecordBlocks]  # by record name: the block CRC-32s of each record that passed its check
    finite: frozenset[str]  # the rows whose bytes in this file and those `along` are whole and finite
    # the rank's other files the rows' bytes lie in too (a frozen parameter's fragments in model_states), by
    # name in the same folder, with the identity each had: `finite` holds only while each still has it
    along: tuple[tuple[str, str], ...] = ()


def folder_key(path: Path) -> str:
    """The folder a rank file's facts are cached under (its real folder's path)."""
    return os.path.realpath(path.parent)


def blocks_to_json(blocks: dict[str, RecordBlocks]) -> dict:
    """{record name: [data offset, size, declared CRC-32, block size, the values in base64]}."""
    return {name: [b.data_offset, b.size, b.crc, b.block, base64.b64encode(b.values).decode()]
            for name, b in blocks.items()}


def blocks_from_json(value) -> dict[str, RecordBlocks]:
    """What `blocks_to_json` wrote; ValueError or TypeError for anything else: a value of the wrong type or
    out of range, a block size not among `crc.BLOCK_SIZES`, or values that are not as many as the
    record's size makes blocks."""
    if not isinstance(value, dict):
        raise TypeError("not a file's block CRC-32s")
    found = {}
    for name, fields in value.items():
        if not isinstance(fields, list) or len(fields) != 5:
            raise ValueError("not a record's block CRC-32s")
        data_offset, size, crc, block, values = fields
        if not (all(type(v) is int for v in (data_offset, size, crc, block)) and 0 <= data_offset < _MAX_OFFSET
                and 0 <= size < _MAX_OFFSET and 0 <= crc < 1 << 32 and block > 0 and isinstance(values, str)):
            raise ValueError("not a record's block CRC-32s")
        try:
            packed = base64.b64decode(values, validate=True)
        except binascii.Error:
            raise ValueError("block CRC-32s not in base64") from None
        blocks = RecordBlocks(name, data_offset, size, crc, block, packed)
        if not blocks.well_formed():
            raise ValueError(f"record {name}: {len(packed)} bytes of CRC-32s of {block}-byte blocks for {size} bytes")
        found[name] = blocks
    return found


def to_json(facts: FileFacts) -> dict:
    return {"blocks": blocks_to_json(facts.blocks), "finite": sorted(facts.finite), "along": dict(facts.along)}


def from_json(value) -> FileFacts:
    """What `to_json` wrote; ValueError or TypeError for anything else (`blocks_from_json`; rows that
    are not a list of short strings)."""
    if not isinstance(value, dict) or not isinstance(value.get("finite"), list) \
            or not isinstance(value.get("along"), dict):
        raise TypeError("not a file's facts")
    finite, along = value["finite"], value["along"]
    if not all(isinstance(row, str) and 0 < len(row) <= MAX_ROW_NAME for row in finite):
        raise ValueError("not a list of rows")
    if not all(isinstance(name, str) and isinstance(ident, str) and _plain(name) for name, ident in along.items()):
        raise ValueError("not the names of files beside it")
    return FileFacts(blocks_from_json(value.get("blocks")), frozenset(finite), tuple(sorted(along.items())))


def _plain(name: str) -> bool:
    """A file's name in the same folder: no separator, not `.` or `..`."""
    return 0 < len(name) <= 255 and "/" not in name and "\0" not in name and name not in (".", "..")


def _key(folder: str) -> str:
    return hashlib.sha256(json.dumps([FORMAT, "facts", folder]).encode()).hexdigest()


def _files(cache: Path | None, key: str) -> dict:
    """A folder's entry: {file identity: its facts, as JSON}, or {} (none, or not ours)."""
    data = read_json(entry(cache, "facts", key), MAX_CACHED)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key \
            or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def store(cache: Path | None, *, folder: str, read: dict[str, FileFacts], current: set[str]) -> None:
    """Cache the facts the statistics just `read` of some of a folder's rank files ({identity: facts});
    those cached before of its other files are kept where the file still has that identity
    (`current`: the identities of every rank file of the folder the statistics looked at). A read-only or
    full cache is skipped (a composition then reads its sources whole and counts them)."""
    key = _key(folder)
    files = {ident: v for ident, v in _files(cache, key).items() if ident in current and ident not in read}
    files.update((ident, to_json(facts)) for ident, facts in read.items() if facts.blocks or facts.finite)
    write_json(entry(cache, "facts", key), {"format": FORMAT, "key": key, "files": files})


def cached(cache: Path | None, *, paths: list[Path]) -> dict[Path, FileFacts]:
    """The cached facts of each of `paths` (rank files) for the file's identity now: {path: its facts},
    without the files it has none for (or whose entry is not ours). A stat per file and a read per
    folder's entry; no rank file is read."""
    memo: dict = {}
    by_folder: dict[str, list[Path]] = {}
    for path in paths:
        by_folder.setdefault(folder_key(path), []).append(path)
    found = {}
    for folder, mine in by_folder.items():
        files = _files(cache, _key(folder))
        if not files:
            continue
        for path in mine:
            try:
                value = files.get(identity_key(path, memo))
                if value is None:
                    continue
                facts = from_json(value)
                if any(identity_key(path.parent / name, memo) != ident for name, ident in facts.along):
                    facts = facts._replace(finite=frozenset())  # a file beside it changed: its rows are counted
                found[path] = facts
            except (OSError, ValueError, TypeError):
                continue  # gone, or an entry that is not ours: read whole
    return found
