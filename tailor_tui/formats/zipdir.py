"""A zip archive's central directory, read with struct alone: one bounded read, a small tuple per
record (issue 32: zipfile builds a ZipInfo of many fields per record, which was most of the cost
of opening the rank files of a 512-rank run).

The end record (zip64's where there is one, as torch writes it) must list no more records and no
larger directory than a torch file has, before anything else is read; zip64 extra fields are
followed for sizes and offsets past 4 GiB. Errors are `zipfile.BadZipFile`, as zipfile's are.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path
from typing import NamedTuple

# A torch file's zip archive lists one record per storage (a .bin of a large MoE: tens of
# thousands); its directory is a few MiB at most
MAX_RECORDS = 1 << 17
MAX_DIRECTORY = 32 << 20  # bytes
CENTRAL = b"PK\x01\x02"
_ENTRY = struct.Struct("<4x2x2xHH4xIIIHHH2x2x4xI")  # flags, method, crc, packed, size, name, extra, comment, offset
_FULL = 0xFFFFFFFF


class Entry(NamedTuple):  # a tuple: made hundreds of thousands of times on a wide run
    name: str
    header_offset: int  # of its local header
    compressed: bool
    flags: int
    crc: int
    size: int  # uncompressed
    packed: int
    crc_field: int  # where the central directory stores its CRC-32 (a byte offset in the file)


def end_record(f) -> tuple[int, int, int]:
    """(records, directory bytes, where the directory starts) of the open archive `f`, refused
    (BadZipFile) when it claims more than a torch file has."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - (1 << 16) - 22))
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at > len(tail) - 22:
        raise zipfile.BadZipFile("File is not a zip file")
    records, directory, start = struct.unpack_from("<HII", tail, at + 10)
    where = size - len(tail) + at  # of the end record
    if at >= 20 and tail[at - 20: at - 16] == b"PK\x06\x07":  # zip64: its own end record says
        f.seek(where64 := struct.unpack_from("<Q", tail, at - 12)[0])
        end64 = f.read(56)
        if len(end64) < 56 or end64[:4] != b"PK\x06\x06":
            raise zipfile.BadZipFile("its zip64 end record is missing (truncated or damaged)")
        records, directory, start = struct.unpack_from("<QQQ", end64, 32)
        where = where64
    if records > MAX_RECORDS or directory > MAX_DIRECTORY:
        raise zipfile.BadZipFile(f"its directory claims {records:,} records in {directory:,} bytes, more than any "
                                 "torch file has")
    if start + directory > where or directory > where:
        raise zipfile.BadZipFile("its directory does not end where its end record begins (truncated or damaged)")
    return records, directory, where - directory  # (measured back from its end, as zipfile does)


def check_directory(path: Path) -> None:
    """BadZipFile (or OSError) unless the archive `path` ends with an end record whose directory,
    of at least one record, starts where it says: what a truncated copy loses. Reads a few KiB
    whatever the number of records (a wide run's model_states files list hundreds each)."""
    with open(path, "rb") as f:
        records, directory, start = end_record(f)
        f.seek(start)
        if records == 0 or directory < 46 or f.read(4) != CENTRAL:
            raise zipfile.BadZipFile("it lists no record" if records == 0 else
                                     f"its directory does not start at byte {start} (truncated or damaged)")


def read_directory(path: Path) -> list[Entry]:
    """Every record the archive `path` lists, in order (BadZipFile, OSError)."""
    with open(path, "rb") as f:
        records, directory, start = end_record(f)
        f.seek(start)
        data = f.read(directory)
    return _entries(data, records, directory, start)


def directory_in(archive: bytes, *, skip_empty: bool = False) -> list[Entry]:
    """Every record the whole archive `archive` (its bytes, read at once) lists, in order (BadZipFile);
    `skip_empty`: but those stored uncompressed, empty, with the CRC-32 of nothing (0), which a CRC
    check passes unread (a ZeRO-3 model_states lists one such placeholder per parameter)."""
    records, directory, start = end_record(io.BytesIO(archive))
    return _entries(archive[start: start + directory], records, directory, start, skip_empty)


def _entries(data: bytes, records: int, directory: int, start: int, skip_empty: bool = False) -> list[Entry]:
    if len(data) < directory:
        raise zipfile.BadZipFile("its directory is cut short (truncated)")
    entries, i, unpack, central = [], 0, _ENTRY.unpack_from, data.startswith
    for _ in range(records):
        if i + 46 > len(data) or not central(CENTRAL, i):
            raise zipfile.BadZipFile(f"its directory entry at byte {start + i} is damaged")
        flags, method, crc, packed, size, name_len, extra_len, comment_len, offset = unpack(data, i)
        name_at = i + 46
        extra_at = name_at + name_len
        end = extra_at + extra_len + comment_len
        if end > len(data):
            raise zipfile.BadZipFile(f"its directory entry at byte {start + i} runs past the directory")
        if skip_empty and not (size or packed or crc or method):
            i = end
            continue
        raw = data[name_at: extra_at]
        name = raw.decode("utf-8" if flags & 0x800 else "cp437")
        if _FULL in (size, packed, offset):
            size, packed, offset = _zip64(data[extra_at: extra_at + extra_len], size, packed, offset)
        entries.append(Entry(name, offset, method != 0, flags, crc, size, packed, start + i + 16))
        i = end
    return entries


def _zip64(extra: bytes, size: int, packed: int, offset: int) -> tuple[int, int, int]:
    """The 64-bit values of a record's zip64 extra field, for those its entry leaves at 0xFFFFFFFF."""
    j = 0
    while j + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, j)
        if kind == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, j + 4))
            try:
                size = values.pop(0) if size == _FULL else size
                packed = values.pop(0) if packed == _FULL else packed
                offset = values.pop(0) if offset == _FULL else offset
            except IndexError:
                raise zipfile.BadZipFile("a zip64 extra field is shorter than its entry needs") from None
            return size, packed, offset
        j += 4 + length
    raise zipfile.BadZipFile("an entry needs a zip64 extra field it does not have")
