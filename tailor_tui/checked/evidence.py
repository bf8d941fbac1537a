"""Bytes checked against the evidence of what they should be, as they are read.

Three kinds of evidence, each checked here and nowhere else:

- **a record's CRC-32**, as its archive stores it (`checked_crcs`, `checked_ranges`, `read_and_check`):
  every byte of the record is read once and the CRC-32 of the whole compared with the stored one;
  the CRC-32s of the ranges inside it a writer takes or replaces come from the same pass.
- **a partial save's slice CRC-32**, as `selective.save_rows` recorded it in its rows file's metadata
  (`SliceCheck`, `crc_range_checked`, `check_crc`): a slice is read whole and compared.
- **the block CRC-32s the run's statistics recorded** of a record (`crc.RecordBlocks`, kept in the
  cache by `checkpoints.evidence`): where a writer takes a few rows of a large record, it reads only
  the 1 MiB blocks that hold them, each compared with its recorded CRC-32 (`read_blocks`). The
  recorded values are evidence of what the bytes should be, never proof of what they are now: only
  the block read proves that.

What fails is one line naming the file, the record (or slice, or block) and what to do
(CheckpointError: exit 4). Records are described by what they are (`Checkable`: a name, where its data
lies, how long it is, its CRC-32), whatever format holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from tailor_tui.checked import crc
from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.checked.ranges import RangeCrcs, crc_range, pread_into
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.events import ByteCounter

Inspect = Callable[[int, memoryview], None]  # (offset in the file, the chunk just read)


class Checkable(Protocol):
    """A record of an archive (`formats.ptfile.Record`) as far as checking it goes."""

    @property
    def name(self) -> str: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def crc(self) -> int | None: ...  # None: a legacy-format record, which has none


class Counts(Protocol):
    """What looks at the bytes read: counts their non-finite values (`formats.nonfinite.Census`), takes
    the CRC-32s of parts of them (`ranges.RegionCrcs`), or both (`compose.taken.Looks`)."""

    def inspect(self, offset: int, chunk: memoryview) -> None: ...


# --- a record's own CRC-32 ------------------------------------------------------------------------

def record_failed(path: Path, record: Checkable, computed: int) -> CheckpointError:
    """The one line refusing a record whose bytes do not give the CRC-32 its archive stores."""
    return CheckpointError(
        f"{path}: record {record.name} fails its CRC-32 check (stored {record.crc:08x}, its bytes give "
        f"{computed:08x}): the file is corrupt (bit rot or a damaged copy); re-copy it from the training "
        "run or pick another checkpoint")


def checked_crcs(fd: int, path: Path, record: Checkable, ranges: list[tuple[int, int]], buffer: memoryview, *,
                 on_bytes: Callable[[int], None] = lambda n: None, inspect: Inspect | None = None) -> list[int]:
    """The CRC-32 of each byte range (offset, length) of `record`, reading every byte of the
    record once and checking the CRC-32 the archive stores for it: a record whose bytes do
    not match (bit rot, a damaged copy) is a CheckpointError naming the file and the record.
    `ranges` are sorted, disjoint and inside the record's data. A legacy-format record has
    no CRC to check: only its ranges are read. The record is read in chunks the size of
    `buffer`, whatever the ranges (a record of a wide run's rank file, hundreds of small ranges,
    is one read); `inspect(offset, chunk)` sees every chunk read."""
    if record.crc is None:
        return [crc_range(fd, at, n, buffer, on_bytes=on_bytes, inspect=inspect) for at, n in ranges]
    crcs = RangeCrcs(record.data_offset, record.data_offset + record.size, ranges)
    offset = record.data_offset
    while not crcs.complete:
        view = buffer[: min(len(buffer), crcs.end - offset)]
        pread_into(fd, view, offset)
        crcs.feed(view)
        if inspect is not None:
            inspect(offset, view)
        on_bytes(len(view))
        offset += len(view)
    return checked_ranges(path, record, crcs)


def checked_ranges(path: Path, record: Checkable, crcs: RangeCrcs) -> list[int]:
    """The CRC-32s of `crcs`' ranges, once every byte of `record` was fed to it (`crcs`) and its
    bytes match the CRC-32 its archive stores (else a CheckpointError naming file and record)."""
    if not crcs.complete:
        raise ValueError(f"record {record.name} was not read to its end")
    if crcs.whole != record.crc:
        raise record_failed(path, record, crcs.whole)
    return crcs.found


def read_and_check(fd: int, path: Path, records, ranges: set, buffer: memoryview, *,
                   counter: ByteCounter, census: Counts | None = None,
                   also: Inspect | None = None) -> dict[tuple[int, int], int]:
    """Read every byte of `records` of the file `fd` once, checking each record's stored
    CRC-32 (`checked_crcs`), and return the CRC of each (record, offset, length) in
    `ranges` as {(offset, length): crc}; `census` counts non-finite values on the way, and
    `also(offset, chunk)` sees every chunk too."""
    found: dict[tuple[int, int], int] = {}
    inspect: Inspect | None = census.inspect if census is not None else None
    if also is not None:
        inspect = also if inspect is None else _both(inspect, also)
    by_record: dict[int, list[tuple[int, int]]] = {}  # grouped once (records compared by identity)
    for r, at, n in ranges:
        by_record.setdefault(id(r), []).append((at, n))
    for record in sorted(records, key=lambda r: r.data_offset):
        mine = sorted(by_record.get(id(record), ()))
        found.update(zip(mine, checked_crcs(fd, path, record, mine, buffer, on_bytes=counter.add, inspect=inspect)))
    return found


def _both(first: Inspect, second: Inspect) -> Inspect:
    def inspect(offset: int, chunk) -> None:
        first(offset, chunk)
        second(offset, chunk)
    return inspect


# --- a partial save's slice CRC-32 ----------------------------------------------------------------

def check_crc(path: Path, crcs: dict[str, int], name: str, found: int) -> None:
    """Refuse tensor `name` of the rows file `path` if its bytes read (CRC-32 `found`) are not
    the ones saved (`crcs`: what its save recorded; a tensor it has none for is not checked)."""
    stored = crcs.get(name)
    if stored is not None and stored != found:
        raise CheckpointError(f"{path}: tensor {name} fails its CRC-32 check (the file is damaged); re-copy the "
                              "partial checkpoint, or take its rows from another checkpoint")


@dataclass(frozen=True)
class SliceCheck:
    """A partial save's slice that some bytes lie in: `length` bytes from `begin` of its rows file
    `path`, tensor `name`, whose CRC-32 its save recorded as `crc` (None: a save from before)."""

    path: Path
    name: str
    begin: int
    length: int
    crc: int | None

    def check(self, found: int) -> None:
        """Refuse the slice if its bytes read (CRC-32 `found`) are not the ones saved."""
        if self.crc is not None:
            check_crc(self.path, {self.name: self.crc}, self.name, found)

    def read_checked(self, fd: int, inside: list[tuple[int, int]], buffer: memoryview,
                     on_bytes: Callable[[int], None], inspect: Inspect | None = None) -> dict[tuple[int, int], int]:
        """{(first byte, length): CRC-32} of each piece `inside` the slice (sorted, not overlapping)
        of the rows file open as `fd`; the whole slice is read, once, and checked (a save from before
        CRC-32s were recorded: the pieces alone, unchecked)."""
        found = {}
        if self.crc is None:
            for at, n in inside:
                found[at, n] = crc_range(fd, at, n, buffer, on_bytes=on_bytes, inspect=inspect)
            return found
        value, at, end = 0, self.begin, self.begin + self.length
        for start, n in inside:
            gap = crc_range(fd, at, start - at, buffer, on_bytes=on_bytes, inspect=inspect)
            piece = found[start, n] = crc_range(fd, start, n, buffer, on_bytes=on_bytes, inspect=inspect)
            value, at = crc.combine(crc.combine(value, gap, start - at), piece, n), start + n
        self.check(crc.combine(value, crc_range(fd, at, end - at, buffer, on_bytes=on_bytes, inspect=inspect), end - at))
        return found


def crc_range_checked(fd: int, offset: int, length: int, checks: list[tuple[int, SliceCheck]], buffer: memoryview,
                      *, on_bytes: Callable[[int], None] = lambda n: None, inspect: Inspect | None = None) -> int:
    """`ranges.crc_range` of a range of `fd` that holds slices copied from rows files: each
    slice's CRC-32 is also checked (`checks`: where in `fd` each slice lies, inside the range, not
    overlapping), with every byte still read once."""
    value, at, end = 0, offset, offset + length
    for start, piece in sorted(checks, key=lambda c: c[0]):
        gap = crc_range(fd, at, start - at, buffer, on_bytes=on_bytes, inspect=inspect)
        found = crc_range(fd, start, piece.length, buffer, on_bytes=on_bytes, inspect=inspect)
        piece.check(found)
        value = crc.combine(crc.combine(value, gap, start - at), found, piece.length)
        at = start + piece.length
    return crc.combine(value, crc_range(fd, at, end - at, buffer, on_bytes=on_bytes, inspect=inspect), end - at)


# --- the block CRC-32s the run's statistics recorded ----------------------------------------------

def blocks_usable(record: Checkable, blocks: RecordBlocks | None, ranges: list[tuple[int, int]]) -> bool:
    """Whether `record`'s ranges are read by its recorded blocks: recorded of the record as it is laid out
    now, their values combining to the CRC-32 its archive declares (a cache entry damaged or made up
    is not taken for a source that changed: the record is read whole), and every range starting a
    whole number of 4-byte values from its data's start, as the blocks do (a block's bytes are
    counted for NaN/Inf, which never splits a value)."""
    return blocks is not None and blocks.describes(record) and blocks.combined() == record.crc and all(
        (at - record.data_offset) % 4 == 0 for at, _n in ranges)


def read_blocks(fd: int, path: Path, record: Checkable, blocks: RecordBlocks, ranges: list[tuple[int, int]], *,
                buffer: memoryview, counter: ByteCounter, census: Counts) -> dict[tuple[int, int], int]:
    """The CRC-32s of `ranges` (sorted, inside `record`), from the blocks that cover them: each read
    once, checked against its recorded CRC-32 (CheckpointError naming the file, the record and the
    block's bytes where it fails); the ranges' bytes fed to `census`. The rest of the record is not
    read (counted as `counter.skips`)."""
    wanted = sorted({i for at, n in ranges for i in blocks.covering(at, n)})
    values = [0] * len(ranges)
    read = 0
    for i in wanted:
        a, b = blocks.span(i)
        pieces = [(max(at, a), min(at + n, b), k) for k, (at, n) in enumerate(ranges) if at < b and at + n > a]

        def seen(offset: int, view: memoryview, pieces=pieces) -> None:
            end = offset + len(view)
            for lo, hi, _k in pieces:
                if lo < end and hi > offset:
                    census.inspect(max(lo, offset), view[max(lo, offset) - offset: min(hi, end) - offset])

        found = _checked_block(fd, path, record, blocks, i, [(lo, hi - lo) for lo, hi, _k in pieces], buffer, counter,
                               seen)
        for (lo, hi, k), value in zip(pieces, found):
            values[k] = crc.combine(values[k], value, hi - lo)
        read += b - a
    counter.skips(record.size - read)
    return dict(zip(ranges, values))


def _checked_block(fd: int, path: Path, record: Checkable, blocks: RecordBlocks, i: int,
                   pieces: list[tuple[int, int]], buffer: memoryview, counter: ByteCounter,
                   seen: Inspect | None = None) -> list[int]:
    """The CRC-32s of `pieces` ((offset, length), sorted, inside `record`'s block i), from one read of the
    whole block, checked against its recorded CRC-32 (CheckpointError naming the file, the record and the
    block's bytes where it fails); `seen(offset, bytes)` is given what is read, chunk by chunk."""
    a, b = blocks.span(i)
    crcs = RangeCrcs(a, b, pieces)
    for offset in range(a, b, len(buffer)):
        view = buffer[: min(len(buffer), b - offset)]
        pread_into(fd, view, offset)
        crcs.feed(view)
        if seen is not None:
            seen(offset, view)
        counter.add(len(view))
    if crcs.whole != blocks.value(i):
        raise _block_failed(path, record, a, b, blocks.value(i), crcs.whole)
    return crcs.found


def _block_failed(path: Path, record: Checkable, a: int, b: int, recorded: int, computed: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: record {record.name}, bytes {a}..{b}, fails the CRC-32 the run's statistics recorded of them "
        f"(recorded {recorded:08x}, its bytes give {computed:08x}): the file changed since the statistics read it "
        f"(bit rot or a damaged copy); {RECOPY} or pick another checkpoint")
