"""Small archives laid out as one checked before: a wide run's rank files.

A ZeRO-3 checkpoint's ranks write archives laid out byte for byte alike but for the name torch gives
each record (`zero_pp_rank_5_mp_rank_00_model_states/data/17`: the archive's name, then the record's)
and the bytes of their records (their tensors, their serialization id) with those bytes' CRC-32s; a
wide run's model_states files list one empty placeholder per parameter. Checking such a file record
by record was most of the cost of composing a rank of a 256-rank run (729 records, 1.5 ms, for 357
KiB), and reading each rank file's structure most of a statistics task's.

A file checked whole (every record's place, header and CRC-32: `ptfile`) becomes a reference
(`remember`): its bytes but for the name of each record, where each starts with one prefix (the
archive's name and "/"), in its local header and its directory entry, and but for each record's
bytes and CRC-32 fields (empty placeholders, CRC 0, are kept whole). Another file that has the same
bytes around its own prefix of the same length on every name, and whose records' bytes match the
CRC-32 each of their fields holds (`match`: one comparison in C and a CRC per record), is laid out
as the reference: each record where the reference's is, with its flags and size, its names distinct
as the reference's when folded as torch's reader folds them (ASCII case, byte by byte, after an
equal prefix), and its bytes whole. It passes every check the reference passed; any other file is
checked whole, as before.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
from collections import OrderedDict
from typing import NamedTuple

from tailor_tui import crc
from tailor_tui.formats.zipdir import CENTRAL, LOCAL, LOCAL_HEADER, end_record

LARGEST = 4 << 20  # bytes: a reference is kept in memory (a real model's files are read as they are)
KEEP = 8  # references: per file size and prefix length (a 256-rank run's rank numbers have 1 to 3 digits)
NAME, DATA, CRC = 0, 1, 2  # what lies in a cut of a reference
_U32 = struct.Struct("<I")


class Kept(NamedTuple):
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
    kept: list[Kept]
    complete: bool  # `kept` lists every record (else those with bytes only)


class SameArchives:
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
        parts = [prefix.join(ref.runs[0])]
        for (at, n), run in zip(ref.holes, ref.runs[1:]):
            parts += (whole[at: at + n], prefix.join(run))
        if b"".join(parts) != whole:
            return None
        view, field = memoryview(whole), _U32.unpack_from
        for k in ref.kept:
            value = crc.crc32(view[k.data_offset: k.data_offset + k.size])
            for at in k.crc_offsets:
                if field(whole, at)[0] != value:
                    return None
            if k.blank_at is not None and field(whole, k.blank_at)[0] not in (0, value):
                return None
        return prefix.decode(), ref

    def remember(self, whole: bytes, kept: list[Kept], complete: bool = False) -> None:
        """Keep the archive `whole`, checked whole, as a reference, where its names allow: `kept`, its
        records with bytes (`complete`: all its records; the others are empty placeholders of CRC-32 0)."""
        prefix = _prefix(whole)
        if prefix is None or len(whole) > self.largest:
            return
        names = _name_starts(whole, prefix)
        if names is None:
            return
        cuts = sorted([(at, len(prefix), NAME) for at in names] + [(k.data_offset, k.size, DATA) for k in kept] +
                      [(at, 4, CRC) for k in kept for at in (*k.crc_offsets, *(() if k.blank_at is None
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
            self._refs[len(whole), len(prefix)] = Reference(runs, holes, kept, complete)
            self._refs.move_to_end((len(whole), len(prefix)))
            while len(self._refs) > self.keep:
                self._refs.popitem(last=False)


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
