"""The block CRC-32s the health statistics recorded of full checkpoints' rank files, cached.

The statistics read every record of a full checkpoint's optim file whole and check its CRC-32;
the same reads give the CRC-32 of each 1 MiB block of the record (`crc.BlockCrcs`), recorded for
each record that passed. They are cached beside the ranks' sums (`stats_run`), one entry per
folder of rank files (O(checkpoints) entries, as the sums), each file's blocks under that file's
identity (`cache.file_identity`: device, inode, size, mtime, ctime) as the statistics saw it
before reading it. A composition looks a source's files up by their identity now (`cached`: a
stat per file, no rank file read): a file changed since, in any way a user can change it, has
another identity and is read whole as before; one that rotted without its identity changing
fails the check of a block it reads (`compose.source_blocks`).

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

from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.checkpoints.cache import entry, identity_key, read_json, write_json

FORMAT = 1  # of the cached block CRC-32s: bump when what they mean changes
MAX_CACHED = 64 << 20  # a folder's entry (~5.4 bytes per MiB of its rank files: ~12 TiB of them); larger: not ours
_MAX_OFFSET = 1 << 62  # no file is larger


def folder_key(path: Path) -> str:
    """The folder a rank file's blocks are cached under (its real folder's path)."""
    return os.path.realpath(path.parent)


def to_json(blocks: dict[str, RecordBlocks]) -> dict:
    """{record name: [data offset, size, declared CRC-32, block size, the values in base64]}."""
    return {name: [b.data_offset, b.size, b.crc, b.block, base64.b64encode(b.values).decode()]
            for name, b in blocks.items()}


def from_json(value) -> dict[str, RecordBlocks]:
    """What `to_json` wrote; ValueError or TypeError for anything else: a value of the wrong type or
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


def _key(folder: str) -> str:
    return hashlib.sha256(json.dumps([FORMAT, "blocks", folder]).encode()).hexdigest()


def _files(cache: Path | None, key: str) -> dict:
    """A folder's entry: {file identity: its records' blocks, as JSON}, or {} (none, or not ours)."""
    data = read_json(entry(cache, "blocks", key), MAX_CACHED)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key \
            or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def store(cache: Path | None, *, folder: str, read: dict[str, dict[str, RecordBlocks]], current: set[str]) -> None:
    """Cache the blocks the statistics just `read` of some of a folder's rank files ({identity: blocks});
    those cached before of its other files are kept where the file still has that identity
    (`current`: the identities of every rank file of the folder the statistics looked at). A read-only or
    full cache is skipped (a composition then reads its sources whole)."""
    key = _key(folder)
    files = {ident: v for ident, v in _files(cache, key).items() if ident in current and ident not in read}
    files.update((ident, to_json(blocks)) for ident, blocks in read.items() if blocks)
    write_json(entry(cache, "blocks", key), {"format": FORMAT, "key": key, "files": files})


def cached(cache: Path | None, *, paths: list[Path]) -> dict[Path, dict[str, RecordBlocks]]:
    """The cached blocks of each of `paths` (full checkpoints' optim files) for the file's identity now:
    {path: {record name: blocks}}, without the files it has none for (or whose entry is not ours).
    A stat per file and a read per folder's entry; no rank file is read."""
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
                if value is not None:
                    found[path] = from_json(value)
            except (OSError, ValueError, TypeError):
                continue  # gone, or an entry that is not ours: read whole
    return found
