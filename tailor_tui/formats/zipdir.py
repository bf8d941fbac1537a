"""A zip archive's central directory, read with struct alone: one bounded read, a small tuple per
record (zipfile builds a ZipInfo of many fields per record: on a 512-rank run, most of the cost of
opening its rank files).

The end record (zip64's where there is one, as torch writes it) must list no more records and no
larger directory than a torch file has, before anything else is read; zip64 extra fields are
followed for sizes and offsets past 4 GiB. Errors are `zipfile.BadZipFile`, as zipfile's are.

An archive is read as torch's reader (miniz, in PyTorchStreamReader) would read it, and whatever
that reader would refuse or read otherwise than zipfile does is refused first (`RecordError`,
naming the record): a record compressed, encrypted or with flags torch never writes, on another
disk, listed twice (names compared as miniz does, ASCII case ignored), its local header or data
descriptor disagreeing with its directory entry, its data outside the archive or overlapping
another's; a directory that does not end where its end record begins (miniz reads it where the
end record says, zipfile where it ends), an end record of several disks. `local_data_start`,
`descriptor_crc_at` and `check_spans` are the checks of the bytes outside the directory; the
caller reads them (one small read each, or from the archive in memory).
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from tailor_tui.checked import crc
from tailor_tui.errors import RECOPY

# A torch file's zip archive lists one record per storage (a .bin of a large MoE: tens of
# thousands); its directory is a few MiB at most
MAX_RECORDS = 1 << 17
MAX_DIRECTORY = 32 << 20  # bytes
_LOCAL = struct.Struct("<4x2xHH4xIIIHH")  # flags, method, crc, packed, size, name, extra
# flags, method, crc, packed, size, name, extra, comment, disk, external attributes, offset
_ENTRY = struct.Struct("<4x2x2xHH4xIIIHHHH2xII")
DIRECTORY = 0x10  # an MS-DOS attribute: torch's reader takes a record with it for a folder, and reads nothing
_FULL = 0xFFFFFFFF
_U32 = struct.Struct("<I")
LOCAL_HEADER = 30
# the zip vocabulary, named once for the readers (`ptfile`, this module) and the writer (`ptwrite`): each record's
# signature
LOCAL = b"PK\x03\x04"  # a local header: a torch file's first bytes
CENTRAL = b"PK\x01\x02"  # a central directory entry
DESCRIPTOR = b"PK\x07\x08"  # a data descriptor
END = b"PK\x05\x06"  # the end of central directory record
END64 = b"PK\x06\x06"  # zip64's end of central directory record
LOCATOR64 = b"PK\x06\x07"  # zip64's locator of it
DESCRIBED, UTF8 = 0x0008, 0x0800  # the only flags torch writes: a data descriptor follows, names are UTF-8
ENCRYPTED = 0x0001 | 0x0040 | 0x2000  # encrypted, strongly encrypted, local headers masked
MAX_INFLATION = 64  # a compressed record's size to its stored size beyond which it is called a zip bomb


class RecordError(zipfile.BadZipFile):
    """A record torch's reader would refuse or misread: `what` is wrong with record `name`."""

    def __init__(self, name: str, what: str):
        super().__init__(f"record {name}: {what}")
        self.name, self.what = name, what


class Directory(list):
    """The entries of an archive's central directory, in order, and where the directory starts
    (the end of the bytes its records may use)."""

    start: int = 0


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
    f.seek(max(0, size - 256))  # (where its comment is empty, as torch writes it, the end record lies here)
    tail = f.read()
    at = tail.rfind(END)
    if at < 20 < size - len(tail) + at or at < 0:  # not found in the last 256 bytes, or zip64's may lie before
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
        at = tail.rfind(END)
    if at < 0 or at > len(tail) - 22:
        raise zipfile.BadZipFile("File is not a zip file")
    disk, disk_dir, here, records, directory, start = struct.unpack_from("<HHHHII", tail, at + 4)
    where = size - len(tail) + at  # of the end record
    if at >= 20 and tail[at - 20: at - 16] == LOCATOR64:  # zip64: its own end record says
        disks, where64 = struct.unpack_from("<I", tail, at - 4)[0], struct.unpack_from("<Q", tail, at - 12)[0]
        if where64 > where:
            raise zipfile.BadZipFile("its zip64 end record is missing (damaged)")
        f.seek(where64)
        end64 = f.read(56)
        if len(end64) < 56 or end64[:4] != END64:
            raise zipfile.BadZipFile("its zip64 end record is missing (truncated or damaged)")
        length, disk, disk_dir, here, records, directory, start = struct.unpack_from("<Q4xII4Q", end64, 4)
        if disks != 1 or length < 44 or where64 + 56 > where - 20:
            raise zipfile.BadZipFile("its zip64 end record is damaged (torch's reader refuses it)")
        where = where64
    if records > MAX_RECORDS or directory > MAX_DIRECTORY:
        raise zipfile.BadZipFile(f"its directory claims {records:,} records in {directory:,} bytes, more than any "
                                 "torch file has")
    if disk or disk_dir or here != records:
        raise zipfile.BadZipFile("its end record describes an archive of several disks (damaged; torch's reader "
                                 "refuses it)")
    if start + directory != where or directory > where:  # torch's reader starts where it says, zipfile back from here
        raise zipfile.BadZipFile("its directory does not end where its end record begins (truncated or damaged)")
    return records, directory, where - directory  # (measured back from its end, as zipfile does)


def check_directory_of(f) -> None:
    """BadZipFile (or OSError) unless the archive open as `f` ends with an end record whose directory,
    of at least one record, starts where it says: what a truncated copy loses. Reads a few KiB
    whatever the number of records (a wide run's model_states files list hundreds each)."""
    records, directory, start = end_record(f)
    f.seek(start)
    if records == 0 or directory < 46 or f.read(4) != CENTRAL:
        raise zipfile.BadZipFile("it lists no record" if records == 0 else
                                 f"its directory does not start at byte {start} (truncated or damaged)")


def read_directory(path: Path) -> Directory:
    """Every record the archive `path` lists, in order (BadZipFile, OSError)."""
    with open(path, "rb") as f:
        return read_directory_of(f)


def read_directory_of(f) -> Directory:
    """`read_directory` of the archive open as `f`."""
    records, directory, start = end_record(f)
    f.seek(start)
    data = f.read(directory)
    return _entries(data, records, directory, start)


def directory_in(archive: bytes) -> Directory:
    """Every record the whole archive `archive` (its bytes, read at once) lists, in order (BadZipFile)."""
    records, directory, start = end_record(io.BytesIO(archive))
    return _entries(archive[start: start + directory], records, directory, start)


def _entries(data: bytes, records: int, directory: int, start: int) -> Directory:
    """The entries of the directory `data`, each checked as torch's reader would read it."""
    if len(data) < directory:
        raise zipfile.BadZipFile("its directory is cut short (truncated)")
    entries, i, unpack, central = Directory(), 0, _ENTRY.unpack_from, data.startswith
    entries.start, lowered, names = start, data.lower(), set[bytes]()
    for _ in range(records):
        if i + 46 > len(data) or not central(CENTRAL, i):
            raise zipfile.BadZipFile(f"its directory entry at byte {start + i} is damaged")
        flags, method, crc, packed, size, name_len, extra_len, comment_len, disk, external, offset = unpack(data, i)
        name_at = i + 46
        extra_at = name_at + name_len
        end = extra_at + extra_len + comment_len
        if end > len(data):
            raise zipfile.BadZipFile(f"its directory entry at byte {start + i} runs past the directory")
        folded = lowered[name_at: extra_at]
        if folded in names or flags & ~(DESCRIBED | UTF8) or method or disk or external & DIRECTORY \
                or folded.endswith(b"/") or (packed != size and _FULL not in (size, packed)):
            _refuse(data[name_at: extra_at], flags, method, packed, size, names, disk)
        names.add(folded)
        if _FULL in (size, packed, offset):
            size, packed, offset = _zip64(data[extra_at: extra_at + extra_len], size, packed, offset)
            if packed != size:
                _refuse(data[name_at: extra_at], flags, method, packed, size, set())
        if offset + LOCAL_HEADER + size > start:
            raise RecordError(_decode(data[name_at: extra_at], flags), f"its data would lie past byte {start:,}, "
                                                                       f"where the archive's directory starts "
                                                                       f"(damaged); {RECOPY}")
        else:
            entries.append(Entry(_decode(data[name_at: extra_at], flags), offset, False, flags, crc, size, packed,
                                 start + i + 16))
        i = end
    return entries


def _decode(raw: bytes, flags: int) -> str:
    try:
        return raw.decode("utf-8" if flags & UTF8 else "cp437")
    except UnicodeDecodeError:
        raise RecordError(raw.decode("utf-8", "backslashreplace"), "its name is flagged UTF-8 but is not "
                                                                   f"(damaged); {RECOPY}") from None


def raw_name(entry: Entry) -> bytes:
    """The bytes of `entry`'s name, as its directory entry stores them."""
    return entry.name.encode("utf-8" if entry.flags & UTF8 else "cp437")


def _refuse(raw: bytes, flags: int, method: int, packed: int, size: int, seen: set, disk: int = 0):
    """The RecordError of a directory entry torch's reader would refuse or misread."""
    name = _decode(raw, flags)
    if raw.lower() in seen:
        raise RecordError(name, "listed twice in the archive's directory (torch's reader, which ignores case, "
                                f"would pick one of them); {RECOPY}")
    if flags & ENCRYPTED:
        raise RecordError(name, f"marked encrypted (flags {flags:#06x}), which torch's reader refuses; {RECOPY}")
    if flags & ~(DESCRIBED | UTF8):
        raise RecordError(name, f"has flags {flags:#06x}, which torch never writes (damaged); {RECOPY}")
    if method:
        bomb = (f", {packed:,} bytes expanding to {size:,}: a zip bomb?" if size > MAX_INFLATION * packed + (64 << 20)
                else "")
        raise RecordError(name, f"compressed (method {method}{bomb}), which torch never writes and its reader "
                                f"misreads; {RECOPY}")
    if packed != size:
        raise RecordError(name, f"stored as {packed:,} bytes but listed as {size:,} (damaged); {RECOPY}")
    if disk:
        raise RecordError(name, f"lies on another disk of a multi-disk archive, which torch's reader refuses; "
                                f"{RECOPY}")
    raise RecordError(name, f"marked a folder, which torch's reader does not read (damaged); {RECOPY}")


def local_data_start(name: str, raw: bytes, flags: int, crc: int, size: int, head: bytes, at: int = 0) -> int:
    """Where the data of record `name` (`raw`: its name's bytes) starts, from `head`, the first
    LOCAL_HEADER + len(raw) bytes at `at`, its local header: RecordError unless that header agrees
    with the record's directory entry (torch's reader skips it by its own name and extra lengths)."""
    if len(head) < LOCAL_HEADER + len(raw) or head[:4] != LOCAL:
        raise RecordError(name, f"has no local header at byte {at:,} (truncated or damaged); {RECOPY}")
    local_flags, method, local_crc, packed, local_size, name_len, extra_len = _LOCAL.unpack_from(head)
    if name_len != len(raw) or head[LOCAL_HEADER: LOCAL_HEADER + name_len] != raw:
        raise RecordError(name, f"its local header names another record (damaged); {RECOPY}")
    if local_flags != flags or method:
        raise RecordError(name, f"its local header says flags {local_flags:#06x}, method {method}, its directory "
                                f"entry flags {flags:#06x}, method 0 (damaged); {RECOPY}")
    blank = (0,) if flags & DESCRIBED else ()  # the descriptor tells them
    if local_crc not in (crc, *blank) or packed not in (size, _FULL, *blank) or local_size not in (size, _FULL, *blank):
        raise RecordError(name, f"its local header disagrees with its directory entry on its CRC-32 or size "
                                f"(damaged); {RECOPY}")
    return at + LOCAL_HEADER + name_len + extra_len


def descriptor_crc_at(entry: Entry, data_end: int, tail: bytes) -> int:
    """Where the CRC-32 of `entry` (flagged DESCRIBED) sits in its data descriptor, which starts at
    `data_end` and whose first 8 bytes are `tail`: RecordError unless the descriptor holds the CRC-32
    its directory entry lists."""
    signed = tail[:4] == DESCRIPTOR
    crc_at = data_end + (4 if signed else 0)
    found = tail[crc_at - data_end: crc_at - data_end + 4]
    if len(found) < 4 or int.from_bytes(found, "little") != entry.crc:
        raise RecordError(entry.name, f"its data descriptor at byte {data_end:,} does not hold the CRC-32 its "
                                      f"directory entry lists (damaged); {RECOPY}")
    return crc_at


def check_spans(spans: list[tuple[int, int, str]], directory_start: int) -> None:
    """RecordError unless the records' byte ranges (header offset, end of data or descriptor,
    name) lie before the directory and none overlaps another."""
    previous_end, previous = 0, ""
    for begin, end, name in sorted(spans):
        if begin < previous_end:
            raise RecordError(name, f"overlaps record {previous} (damaged or crafted); {RECOPY}")
        if end > directory_start:
            raise RecordError(name, f"runs past byte {directory_start:,}, where the archive's directory starts "
                                    f"(damaged); {RECOPY}")
        previous_end, previous = end, name


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


# --- archives laid out as one checked before -----------------------------------------------------
#
# Small archives laid out as one checked before: a wide run's rank files.
#
# A ZeRO-3 checkpoint's ranks write archives laid out byte for byte alike but for the name torch gives
# each record (`zero_pp_rank_5_mp_rank_00_model_states/data/17`: the archive's name, then the record's)
# and the bytes of their records (their tensors, their serialization id) with those bytes' CRC-32s; a
# wide run's model_states files list one empty placeholder per parameter. Checking such a file record
# by record was most of the cost of composing a rank of a 256-rank run (729 records, 723 of them empty, for 357
# KiB), and reading each rank file's structure most of a statistics task's.
#
# A file checked whole (every record's place, header and CRC-32: `ptfile`) becomes a reference
# (`remember`): its bytes but for the name of each record, where each starts with one prefix (the
# archive's name and "/"), in its local header and its directory entry, and but for each record's
# bytes and CRC-32 fields (empty placeholders, CRC 0, are kept whole). Another file that has the same
# bytes around its own prefix of the same length on every name, and whose records' bytes match the
# CRC-32 each of their fields holds (`match`: a comparison in C per stretch between records' bytes, a CRC
# per record with bytes), is laid out as the reference: each record where the reference's is, with its
# flags and size, its names distinct as the reference's when folded as torch's reader folds them (ASCII
# case, byte by byte, after an equal prefix), and its bytes whole. It passes every check the reference
# passed; any other file is checked whole.

LARGEST = 4 << 20  # bytes: a reference is kept in memory (a real model's files are read as they are)
KEEP = 8  # references: per file size and prefix length (a 256-rank run's rank numbers have 1 to 3 digits)
NAME, DATA, CRC = 0, 1, 2  # what lies in a cut of a reference


class KeptRecord(NamedTuple):
    """A record of a reference with bytes of its own: where they lie and where their CRC-32 is held."""

    name: str  # after the prefix
    header_offset: int
    data_offset: int
    size: int
    crc_offsets: tuple[int, ...]  # the fields that must hold its CRC-32 (a data descriptor's, a directory entry's)
    blank_at: int | None  # a local header's CRC field that holds it or 0 (a record with a data descriptor)


class Reference(NamedTuple):
    runs: list[list[bytes]]  # the bytes around the holes, each run cut where a name's prefix lies
    holes: list[tuple[int, int]]  # (at, length): a record's bytes or a CRC-32 field, each file's own
    kept: list[KeptRecord]
    complete: bool  # `kept` lists every record (else those with bytes only)
    with_bytes: list[KeptRecord]  # those of `kept` with bytes: an empty one's CRC-32 fields are in the runs (0)
    by_name: dict[str, KeptRecord]  # `kept` by name
    by_last: dict[str, list[str]]  # the names of `kept` by their last part (after the last "/")


class CheckedArchives:
    """References by (file size, prefix length), the latest `keep` (thread-safe)."""

    def __init__(self, keep: int = KEEP, largest: int = LARGEST):
        self.keep, self.largest = keep, largest
        self._refs: OrderedDict[tuple[int, int], Reference] = OrderedDict()
        self._lock = threading.Lock()

    def match(self, whole: bytes) -> tuple[str, Reference] | None:
        """(its prefix, the reference) where the archive `whole` is laid out as a reference (see above)."""
        prefix = _prefix(whole)
        if prefix is None or len(whole) > self.largest:
            return None
        with self._lock:
            ref = self._refs.get((len(whole), len(prefix)))
        if ref is None:
            return None
        # each run, its names given this file's prefix, where it lies in this file (after the hole before it): the
        # bytes compared in place, not copied into an archive of its size built to be compared (a 357 KiB model_states:
        # ~70 us, not ~350)
        at = 0
        for hole, run in zip([(0, 0), *ref.holes], ref.runs):
            expected = prefix.join(run)
            if not whole.startswith(expected, hole[0] + hole[1]):
                return None
            at = hole[0] + hole[1] + len(expected)
        if at != len(whole):
            return None
        view, field = memoryview(whole), _U32.unpack_from
        for k in ref.with_bytes:
            value = crc.crc32(view[k.data_offset: k.data_offset + k.size])
            for at in k.crc_offsets:
                if field(whole, at)[0] != value:
                    return None
            if k.blank_at is not None and field(whole, k.blank_at)[0] not in (0, value):
                return None
        return prefix.decode(), ref

    def remember(self, whole: bytes, kept: list[KeptRecord], complete: bool = False) -> None:
        """Keep the archive `whole`, checked whole, as a reference, where its names allow: `kept`, its
        records with bytes (`complete`: all its records; the others are empty placeholders of CRC-32 0)."""
        prefix = _prefix(whole)
        if prefix is None or len(whole) > self.largest:
            return
        names = _name_starts(whole, prefix)
        if names is None:
            return
        with_bytes = [k for k in kept if k.size]  # (an empty record's CRC-32 is 0: held so by the runs)
        cuts = sorted([(at, len(prefix), NAME) for at in names] + [(k.data_offset, k.size, DATA) for k in with_bytes] +
                      [(at, 4, CRC) for k in with_bytes for at in (*k.crc_offsets, *(() if k.blank_at is None
                                                                                      else (k.blank_at,)))])
        cuts = [c for c in cuts if c[1]]
        if any(a + n > b for (a, n, _w), (b, _m, _v) in zip(cuts, cuts[1:])) or (cuts and cuts[-1][0] + cuts[-1][1]
                                                                                   > len(whole)):
            return  # cuts that overlap: not an archive laid out as torch writes one
        runs: list[list[bytes]] = [[]]
        at = 0
        for begin, n, what in cuts:
            runs[-1].append(whole[at: begin])
            if what != NAME:
                runs.append([])
            at = begin + n
        runs[-1].append(whole[at:])
        holes = [(begin, n) for begin, n, what in cuts if what != NAME]
        with self._lock:
            self._refs[len(whole), len(prefix)] = Reference(runs, holes, kept, complete, with_bytes,
                                                                   {k.name: k for k in kept}, _by_last(kept))
            self._refs.move_to_end((len(whole), len(prefix)))
            while len(self._refs) > self.keep:
                self._refs.popitem(last=False)


def _by_last(kept: list[KeptRecord]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for k in kept:
        found.setdefault(k.name.rpartition("/")[2], []).append(k.name)
    return found


def _prefix(whole: bytes) -> bytes | None:
    """The first record's name up to its first "/", included (ASCII, at least one byte before it)."""
    if len(whole) < LOCAL_HEADER or not whole.startswith(LOCAL):
        return None
    name = whole[LOCAL_HEADER: LOCAL_HEADER + struct.unpack_from("<H", whole, 26)[0]]
    cut = name.find(b"/")
    if cut < 1 or not name[: cut].isascii():
        return None
    return name[: cut + 1]


def _name_starts(whole: bytes, prefix: bytes) -> list[int] | None:
    """Where each record's name starts, in its local header and its directory entry; None unless
    every name starts with `prefix` (an archive checked whole: its headers are where its directory says)."""
    try:
        records, size, start = end_record(io.BytesIO(whole))
    except zipfile.BadZipFile:
        return None
    starts, i, end = [], start, start + size
    for _ in range(records):
        if i + 46 > end or whole[i: i + 4] != CENTRAL:
            return None
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", whole, i + 28)
        offset = _U32.unpack_from(whole, i + 42)[0]
        if offset == 0xFFFFFFFF:  # a zip64 offset: not looked for
            return None
        for at in (offset + LOCAL_HEADER, i + 46):
            if whole[at: at + len(prefix)] != prefix:
                return None
            starts.append(at)
        i += 46 + name_len + extra_len + comment_len
    return starts
