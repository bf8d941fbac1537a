"""Where each tensor's bytes sit inside a torch `.pt` file, without reading tensor data.

A `.pt` file is a zip archive: `data.pkl` (the pickled object, tensors as references
to storages) plus one uncompressed record per storage (`data/0`, `data/1`, …). Here
`data.pkl` is read by `pickled.read_pickle` (allow-listed globals only, as inert
stand-ins, no torch): that yields the object's structure and, for each tensor, which
record and which byte offset hold it. Files in torch's legacy (non-zip) format are
read by `ptlegacy` into the same records (with no CRC: that format has none).

The streaming rank writer uses this to copy the base's rank file record by record at
kernel speed and rewrite only the byte ranges a recipe replaces (then the records'
CRC-32s), instead of deserialising and re-serialising whole files.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

from tailor_tui.checked import crc
from tailor_tui.checked.evidence import checked_crcs, record_failed
from tailor_tui.checked.files import NotRegular, open_regular
from tailor_tui.checked.ranges import READ_CHUNK, Window
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.ds_format import FROZEN_PARAM_FRAGMENTS, unsupported_version, version_in_pickle
from tailor_tui.formats.pickled import MAX_PICKLE_BYTES, TensorRef, read_pickle
from tailor_tui.formats.ptlegacy import START as LEGACY_START
from tailor_tui.formats.ptlegacy import LegacyError, read_legacy
from tailor_tui.formats.zipdir import (
    DESCRIBED,
    LOCAL,
    LOCAL_HEADER,
    CheckedArchives,
    KeptRecord,
    RecordError,
    Reference,
    check_directory_of,
    check_spans,
    descriptor_crc_at,
    directory_in,
    end_record,
    local_data_start,
    raw_name,
    read_directory_of,
)


class Unsupported(Exception):
    """The archive is laid out in a way the streaming path does not handle (compressed, …)."""


class Record(NamedTuple):  # a tuple: a model_states file lists one per parameter, a wide run ~200k
    """One record of a torch file: where its data lies, and its CRC-32 as the archive stores it."""

    name: str
    header_offset: int  # local file header
    data_offset: int  # first byte of the stored data
    size: int
    crc: int | None  # CRC-32 of the stored data, as the archive records it (None: legacy format)
    crc_offsets: tuple[int, ...]  # where the CRC-32 sits: local header or data descriptor, central entry


# What `read_structure` reads of a `.pt` file: (pickled object, {record name: Record}, record-name prefix)
Structure = tuple[Any, Mapping[str, Record], str]


class MatchedRecords(Mapping[str, Record]):
    """The records of an archive laid out as a reference (`zipdir.CheckedArchives.match`: `structure_in`), each made
    when asked: a wide run's model_states lists 729, 6 of them with bytes, and a reader asks for a few (making them all
    was most of the time reading its structure took). Named with the archive's own prefix; a record's CRC-32 is the one
    the archive stores (an empty one's: 0, its fields the reference's bytes, which the match compared). Each record is
    made once: the same object whenever asked (readers tell records apart by identity)."""

    __slots__ = ("_prefix", "_ref", "_crcs", "_made")

    def __init__(self, prefix: str, ref: Reference, whole: bytes):
        self._prefix, self._ref = prefix, ref
        self._crcs = {k.name: int.from_bytes(whole[k.crc_offsets[-1]: k.crc_offsets[-1] + 4], "little")
                      for k in ref.with_bytes}
        self._made: dict[str, Record] = {}

    def __getitem__(self, name: str) -> Record:
        found = self._made.get(name)
        if found is None:
            k = self._ref.by_name.get(name[len(self._prefix):]) if name.startswith(self._prefix) else None
            if k is None:
                raise KeyError(name)
            found = self._made[name] = Record(name, k.header_offset, k.data_offset, k.size, self._crcs.get(k.name, 0),
                                              k.crc_offsets)
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith(self._prefix) and \
            name[len(self._prefix):] in self._ref.by_name

    def __iter__(self) -> Iterator[str]:
        return (self._prefix + k.name for k in self._ref.kept)

    def __len__(self) -> int:
        return len(self._ref.kept)

    def named(self, last: str) -> list[str]:
        """The names whose last part (after the last "/") is `last`."""
        return [self._prefix + name for name in self._ref.by_last.get(last, ())]

    def stored(self) -> list[Record]:
        return [self[self._prefix + k.name] for k in self._ref.with_bytes]


def stored(records: Mapping[str, Record]) -> list[Record]:
    """The records of an archive that hold bytes or a CRC-32 other than no bytes' (0): all a check of the archive
    reads (an archive read by `structure_in` as laid out as another: its records with bytes only)."""
    if isinstance(records, MatchedRecords):
        return records.stored()
    return [r for r in records.values() if r.size or r.crc]


@dataclass(frozen=True)
class TensorBytes:
    """A tensor's bytes: `numel` elements of `itemsize` bytes at `offset` in the file."""

    record: Record
    offset: int  # absolute file offset of element 0
    numel: int
    itemsize: int
    dtype: str = "UntypedStorage"  # the storage type torch pickled: FloatStorage, BFloat16Storage, …


def _opened(path: Path) -> int:
    """A read-only descriptor of the torch file `path`; every reading of one starts here, so one that is not a
    regular file (a FIFO, /dev/zero) is refused before anything opens it (CheckpointError, what to do)."""
    try:
        return open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be opened ({exc.strerror or exc}); "
                              "check that it exists and is readable") from None
    except NotRegular as exc:  # a checkpoint's file: what to do
        raise CheckpointError(f"{exc}; {RECOPY}") from None


def _first_bytes(path: Path) -> bytes:
    """Its first 4 bytes."""
    fd = _opened(path)
    try:
        return os.pread(fd, 4, 0)
    finally:
        os.close(fd)


_FORMATS = {LOCAL: "zip", LEGACY_START: "legacy"}  # torch.save's two formats, by their first 4 bytes


def file_format(path: Path) -> str | None:
    """"zip" or "legacy" by how the file starts (torch.save's two formats), else None."""
    return _FORMATS.get(_first_bytes(path))


def unreadable(path: Path, fmt: str | None, reason: str) -> CheckpointError:
    """The error for a `.pt` file that cannot be read, naming the format it failed as."""
    if fmt is None:
        return CheckpointError(
            f"{path}: not a torch checkpoint file: neither a zip-format nor a legacy-format torch file "
            f"({reason}); it is corrupt or not a checkpoint, {RECOPY}")
    what = "a zip-format" if fmt == "zip" else "a legacy-format (non-zip)"
    return CheckpointError(f"{path}: {what} torch file that cannot be read ({reason}); "
                           f"it is truncated or corrupt, {RECOPY}")


def refused(path: Path, exc: Exception, ds_version: str | None = None) -> CheckpointError:
    """The error for a pickle that cannot be read safely: it names a global outside the
    allow-list, or is larger than any checkpoint's structure. When the file says it was
    written by a DeepSpeed release tailor-tui does not read, that is the error instead."""
    why = unsupported_version(ds_version) if ds_version else None
    if why:
        return CheckpointError(f"{path}: cannot be read: {why}")
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found is None:
        return CheckpointError(f"{path}: refused to load: {str(exc)[:200]}; it is corrupt or was crafted")
    return CheckpointError(
        f"{path}: refused to load: it holds {found.group(1)}, which is not one of the DeepSpeed "
        "checkpoint classes tailor-tui allows; it may be unsafe to open (it could run code)"
    )


def _start(first: bytes) -> str:
    """What a file whose first bytes are `first` starts with, for a line refusing it."""
    return f"it starts with bytes {first.hex() or 'nothing: it is empty'}"


def open_zip(path: Path) -> zipfile.ZipFile:
    """The zip archive `path`, once its end record lists no more records and no larger directory
    than a torch file has (BadZipFile): zipfile would read whatever directory it claims."""
    with open(path, "rb") as f:
        end_record(f)
    return zipfile.ZipFile(path)


def check_complete(path: Path) -> None:
    """Raise CheckpointError unless `path` is a whole `.pt` file: a zip archive's central
    directory, or every storage of a legacy file, is where it should be (no data is read)."""
    fd = _opened(path)
    with os.fdopen(fd, "rb") as f:  # one open: the first bytes and the directory (a wide run: 1,000s of files)
        first = os.pread(fd, 4, 0)
        fmt = _FORMATS.get(first)
        if fmt == "legacy":
            _legacy_records(path, fd)
            return
        try:
            check_directory_of(f)
        except (zipfile.BadZipFile, OSError) as exc:
            raise unreadable(path, fmt, _first_line(exc) if fmt else _start(first)) from None


def record_refused(path: Path, exc: RecordError) -> CheckpointError:
    """The one line for a record torch's reader would refuse or misread: file, record, what, what to do."""
    return CheckpointError(f"{path}: {exc}")


def _records(path: Path) -> dict[str, Record]:
    fd = _opened(path)
    try:
        return _records_of(path, fd)
    finally:
        os.close(fd)


def _records_of(path: Path, fd: int) -> dict[str, Record]:
    """`_records` of the file `path` open as `fd`: its directory and local headers read through that descriptor."""
    try:
        with open(fd, "rb", closefd=False) as f:
            entries = read_directory_of(f)
    except RecordError as exc:
        raise record_refused(path, exc) from None
    except (zipfile.BadZipFile, OSError) as exc:
        first = os.pread(fd, 4, 0)
        fmt = _FORMATS.get(first)
        raise unreadable(path, fmt, f"not a complete archive: {exc}" if fmt else _start(first)) from None
    records, spans = {}, []
    window = Window(fd)
    try:
        for e in entries:
            raw = raw_name(e)
            head = window.read(e.header_offset, LOCAL_HEADER + len(raw))
            data_offset = local_data_start(e.name, raw, e.flags, e.crc, e.size, head, e.header_offset)
            crc_at, end = _crc_at(e, data_offset, window.read(data_offset + e.size, 8))
            spans.append((e.header_offset, end, e.name))
            records[e.name] = Record(name=e.name, header_offset=e.header_offset, data_offset=data_offset,
                                     size=e.size, crc=e.crc, crc_offsets=(crc_at, e.crc_field))
        check_spans(spans, entries.start)
    except RecordError as exc:
        raise record_refused(path, exc) from None
    return records


def _crc_at(e, data_offset: int, tail: bytes) -> tuple[int, int]:
    """(where the CRC-32 of entry `e`, whose data starts at `data_offset`, sits to be rewritten, where
    its record ends), from `tail`, the 8 bytes after its data. torch writes a data descriptor after
    each record: its CRC is the one that counts (the local header's is 0); it may or may not start
    with a signature."""
    if e.flags & DESCRIBED:
        crc_at = descriptor_crc_at(e, data_offset + e.size, tail)
        return crc_at, crc_at + 12  # the CRC-32 and two sizes, at least
    return e.header_offset + 14, data_offset + e.size


# How reading a damaged or crafted pickle fails, besides a refused global
PICKLE_FAILURES = (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                   OverflowError, MemoryError, RecursionError)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:160] if str(exc).strip() else type(exc).__name__


def _legacy_records(path: Path, fd: int, refs: dict | None = None, stand_in=None) -> tuple[object, dict[str, Record]]:
    """The object and records of the legacy-format file `path`, open as `fd` (read through it)."""
    try:
        obj, storages = read_legacy(fd, refs, stand_in)
    except pickle.UnpicklingError as exc:  # a global outside the allow-list, or too large
        head = os.pread(fd, MAX_PICKLE_BYTES, 0)  # the pickles come before the storages
        raise refused(path, exc, version_in_pickle(head)) from None
    except (LegacyError, OSError, *PICKLE_FAILURES) as exc:
        raise unreadable(path, "legacy", _first_line(exc)) from None
    records = {f"data/{key}": Record(f"data/{key}", at - 8, at, size, None, ())
               for key, (at, size) in storages.items()}
    return obj, records


@functools.lru_cache(maxsize=8)
def _shared_pickle(data: bytes):
    """`read_pickle(data)`, once per process for equal bytes (see read_structure's `shared`)."""
    return read_pickle(data)


def read_structure(path: Path, storages: dict | None = None, *, shared: bool = False, stand_in=None) -> Structure:
    """(object with TensorRefs, records, record-name prefix) of a `.pt` file in either of
    torch's formats; reads only the pickled structure, never tensor data. `storages`, if
    given, receives every storage the object refers to (key -> StorageRef). `shared`: the
    object may be one this process built for equal pickle bytes before (a checkpoint's ranks
    pickle the same structure: a wide run's is built once, not once per rank file); the caller
    only reads it. `stand_in`: the pickle's globals' stand-ins (`pickled.read_pickle`)."""
    path = Path(path)
    fd = _opened(path)
    try:
        return _structure_of(path, fd, storages, shared, stand_in)
    finally:
        os.close(fd)


def structure_as(path: Path) -> tuple[Structure, os.stat_result]:
    """`read_structure(path, shared=True)`, and what fstat said of the file it was read from: one open, through which
    the structure is read (a file of at most SMALL_RANK_FILE bytes read whole, `structure_in`), for a reader that
    holds the file's bytes to it later (`--verify`)."""
    path = Path(path)
    fd = _opened(path)
    try:
        st = os.fstat(fd)
        whole = _small_archive(fd, st.st_size, SMALL_RANK_FILE)
        if whole is not None:
            return structure_in(path, whole), st
        return _structure_of(path, fd, None, True, None), st
    finally:
        os.close(fd)


def _structure_of(path: Path, fd: int, storages: dict | None, shared: bool, stand_in) -> Structure:
    """`read_structure` of the file `path` open as `fd`: its directory, local headers and pickle (a legacy-format
    file's pickles and storages' headers) read through it."""
    if _FORMATS.get(os.pread(fd, 4, 0)) == "legacy":
        return (*_legacy_records(path, fd, storages, stand_in), "")
    records = _records_of(path, fd)
    rec, prefix = _pickle_record(records)
    if rec.size > MAX_PICKLE_BYTES:
        raise unreadable(path, "zip", f"its data.pkl is {rec.size} bytes, more than a checkpoint's structure needs")
    data = os.pread(fd, rec.size, rec.data_offset)
    return _structure(path, records, prefix, rec, data, storages, shared, stand_in)


def _pickle_record(records: Mapping[str, Record]) -> tuple[Record, str]:
    pickles = records.named("data.pkl") if isinstance(records, MatchedRecords) else \
        [n for n in records if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pickles) != 1:
        raise Unsupported("no single data.pkl")
    return records[pickles[0]], pickles[0][: -len("data.pkl")]


def _structure(path: Path, records: Mapping[str, Record], prefix: str, rec: Record, data, storages: dict | None,
               shared: bool, stand_in) -> Structure:
    """`read_structure`'s result, from the bytes of its data.pkl (record `rec`)."""
    if crc.crc32(data) != rec.crc:  # the structure everything else relies on: never read a damaged one
        raise record_failed(path, rec, crc.crc32(data))
    try:
        obj = _shared_pickle(data) if shared and storages is None and stand_in is None \
            else read_pickle(data, storages, stand_in)
    except pickle.UnpicklingError as exc:  # a global outside the allow-list
        raise refused(path, exc, version_in_pickle(data)) from None
    except PICKLE_FAILURES as exc:
        raise unreadable(path, "zip", _first_line(exc)) from None
    return obj, records, prefix


# A torch file at most this size (a wide run's rank file: tens to hundreds of KiB) is read whole, once, by whoever
# reads its structure (`read_whole`, `structure_in`): one read, where reading its structure reads a few times. A
# larger one costs more read whole than the reads it saves: a 4 MiB one read whole, checked, matched, and read again
# for its bytes took 3.5 ms, a verification of 256 such ranks 6.2 s where 2.7 s read its structure alone
SMALL_RANK_FILE = 1 << 20


def read_whole(path: Path, limit: int = SMALL_RANK_FILE) -> bytes | None:
    """The bytes of `path` where it is a regular file of at most `limit` bytes that starts as a zip
    archive (a wide run's rank file: one read, where reading its structure reads a few times); else
    None, also where it cannot be read (the caller reads it as it would have, which says why)."""
    try:
        fd = open_regular(path)
    except (OSError, ValueError):
        return None
    try:
        return _small_archive(fd, os.fstat(fd).st_size, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _small_archive(fd: int, size: int, limit: int) -> bytes | None:
    """The bytes of the file open as `fd` (`size`: fstat's) where it is at most `limit` bytes and starts as a zip
    archive, read in one read; else None."""
    if size > limit:
        return None
    data = os.pread(fd, size, 0)
    return data if len(data) == size and data.startswith(LOCAL) else None


def structure_in(path: Path, whole: bytes) -> Structure:
    """`read_structure(path, shared=True)` of the zip-format file `path` whose bytes are `whole`. One
    laid out as a file read before (`zipdir.CheckedArchives`: a wide run's ranks' files), each of its records
    matching its CRC-32, has the records of that one, its own names and CRC-32s in them; another is
    read whole, and kept as a reference where every record matches its CRC-32."""
    found = _CHECKED.match(whole)
    records: Mapping[str, Record]
    if found is not None and found[1].complete:
        records = MatchedRecords(*found, whole)
    else:
        located = _located(path, whole)
        records = {e.name: Record(e.name, e.header_offset, start, e.size, e.crc, (crc_at, e.crc_field))
                   for e, start, crc_at in located}
        view = memoryview(whole)
        if all(crc.crc32(view[r.data_offset: r.data_offset + r.size]) == r.crc for r in records.values()):
            _CHECKED.remember(whole, _kept(located), complete=True)
    rec, prefix = _pickle_record(records)
    if rec.size > MAX_PICKLE_BYTES:
        raise unreadable(path, "zip", f"its data.pkl is {rec.size} bytes, more than a checkpoint's structure needs")
    return _structure(path, records, prefix, rec, whole[rec.data_offset: rec.data_offset + rec.size], None, True,
                      None)


def zip_format(path: Path) -> bool:
    """Whether `path` is a zip-format torch file (False: a legacy-format one, or no torch file); CheckpointError for
    a zip archive torch's reader would take for a legacy-format file, and fail on."""
    fmt = file_format(path)
    if fmt is None and _ends_as_zip(path):
        raise CheckpointError(f"{path}: a zip archive that does not start with a record's local header (damaged); "
                              f"{RECOPY}")
    return fmt == "zip"


def zip_records(path: Path) -> dict[str, Record]:
    """The records of a zip-format torch file, its directory and local headers held to what torch's reader accepts
    (CheckpointError naming the file and what, in one line); none for a legacy-format file or no torch file. Their
    bytes are not read: a caller checks each against its CRC-32 as it reads them."""
    return _records(path) if zip_format(path) else {}


def check_crcs(path: Path, inspect=None, *, skip: frozenset = frozenset(), small: int | None = None) -> None:
    """Read every record of a zip-format torch file and check the CRC-32 each stores
    (CheckpointError naming the record if one fails; torch.load itself never checks them).
    Files in the legacy format, and files that are no torch file, have none to check.
    `inspect(offset, chunk)` sees every chunk read. `skip`: names of records the caller
    checks itself as it reads them. A file of at most `small` bytes (default SMALL_FILE) is
    read whole and checked in memory."""
    if not zip_format(path):
        return
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        whole = f.read(size) if size <= (SMALL_FILE if small is None else small) else None
    if whole is not None:
        _check_in_memory(path, whole, inspect, skip)
        return
    records = _records(path)
    end = max((r.data_offset + r.size for r in records.values()), default=0)
    buffer = memoryview(bytearray(min(READ_CHUNK, end)))
    with open(path, "rb") as f:
        window = Window(f.fileno(), min(READ_CHUNK, end))  # small records, side by side, read a chunk at a time
        for record in sorted(records.values(), key=lambda r: r.data_offset):
            if record.name in skip:
                continue
            if record.size > 1 << 18:
                checked_crcs(f.fileno(), path, record, [], buffer, inspect=inspect)
                continue
            data = window.view(record.data_offset, record.size) if record.size else b""
            if len(data) < record.size:
                raise unreadable(path, "zip", f"not a complete archive: record {record.name} is cut short")
            if inspect is not None and record.size:
                inspect(record.data_offset, data)
            if crc.crc32(data) != record.crc:
                raise record_failed(path, record, crc.crc32(data))


def _ends_as_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            end_record(f)
    except (zipfile.BadZipFile, OSError, struct.error):
        return False
    return True


# A file this small (a ZeRO-3 model_states: one record per parameter, nearly all empty) is read
# whole and checked from memory: no Record made, no read per record
SMALL_FILE = 16 << 20


# Small archives checked whole, as references for the next ones laid out alike but for their records'
# names and bytes (a wide run's ranks' files: `zipdir.CheckedArchives`)
_CHECKED = CheckedArchives()


def _check_in_memory(path: Path, whole: bytes, inspect, skip: frozenset) -> None:
    """`check_crcs` of the archive `path` whose bytes are `whole`."""
    plain = inspect is None and not skip
    if plain and _CHECKED.match(whole) is not None:
        return  # laid out as one checked before, every record's bytes matching its CRC-32
    # every record placed, the empty placeholders too: one whose local header says its data starts elsewhere (its
    # extra field's length flipped) overlaps its neighbour, as the verifier finds; in memory, that costs nothing
    located = _located(path, whole)
    for _entry, _data in _checked(path, whole, located, skip, inspect):
        pass
    if plain:
        _CHECKED.remember(whole, _kept(located))


def records_in(path: Path, whole: bytes, *, skip: frozenset = frozenset(), inspect=None):
    """Each record of the archive `path` whose bytes are `whole`, in order: (its directory entry,
    its bytes), each checked against its CRC-32 first (CheckpointError if one fails or is cut
    short, or one torch's reader would refuse or misread: see zipdir). `skip`: as `check_crcs`'s;
    `inspect(offset, data)` sees each record's bytes before its check."""
    yield from _checked(path, whole, _located(path, whole), skip, inspect)


def _located(path: Path, whole: bytes) -> list[tuple[Any, int, int]]:
    """(directory entry, where its data starts, where its CRC-32 sits) of each record of `whole`,
    their headers and places checked (see `records_in`)."""
    try:
        entries = directory_in(whole)
        located, spans = [], []
        for e in entries:
            at, raw = e.header_offset, raw_name(e)
            start = local_data_start(e.name, raw, e.flags, e.crc, e.size, whole[at: at + LOCAL_HEADER + len(raw)], at)
            end = start + e.size
            crc_at, span_end = _crc_at(e, start, whole[end: end + 8])
            located.append((e, start, crc_at))
            spans.append((e.header_offset, span_end, e.name))
        check_spans(spans, entries.start)
    except RecordError as exc:
        raise record_refused(path, exc) from None
    except zipfile.BadZipFile as exc:
        raise unreadable(path, "zip", f"not a complete archive: {exc}") from None
    return located


def _checked(path: Path, whole: bytes, located: list, skip: frozenset, inspect):
    view, crc32 = memoryview(whole), crc.crc32
    for e, start, _crc_at in located:
        if e.name in skip:
            continue
        data = view[start: start + e.size]
        if len(data) < e.size:
            raise unreadable(path, "zip", f"not a complete archive: record {e.name} is cut short")
        if inspect is not None and e.size:
            inspect(start, data)
        if (value := crc32(data)) != e.crc:
            raise record_failed(path, Record(e.name, e.header_offset, start, e.size, e.crc, ()), value)
        yield e, data


def _kept(located: list) -> list[KeptRecord]:
    """The records of an archive checked whole, as `CheckedArchives` keeps them."""
    return [KeptRecord(e.name.partition("/")[2], e.header_offset, start, e.size, (crc_at, e.crc_field),
                 e.header_offset + 14 if e.flags & DESCRIBED else None) for e, start, crc_at in located]


def frozen_fragment_bytes(path: Path, names, structure: Structure | None = None) -> dict[str, TensorBytes]:
    """{name: TensorBytes} of frozen parameters' fragments in a model_states file
    (CheckpointError naming the parameter whose fragment is missing or unreadable); `structure`:
    the file's `read_structure`, if read already."""
    obj, records, prefix = structure if structure is not None else read_structure(path)
    fragments: Any = obj.get(FROZEN_PARAM_FRAGMENTS) if isinstance(obj, dict) else None  # as pickled: checked below
    found = {}
    for name in names:
        try:
            found[name] = locate(fragments[name], records, prefix)
        except (KeyError, TypeError, Unsupported):
            raise CheckpointError(f"{path}: has no readable fragment of frozen parameter {name}") from None
    return found


def locate(tensor: TensorRef, records: Mapping[str, Record], prefix: str) -> TensorBytes:
    """The bytes of a tensor read by `read_structure` (must be contiguous)."""
    if not isinstance(tensor, TensorRef) or not tensor.is_contiguous():
        raise Unsupported("not a plain contiguous tensor")
    record = records.get(f"{prefix}data/{tensor.storage.key}")
    if record is None:
        raise Unsupported(f"storage {tensor.storage.key} has no record")
    itemsize = tensor.element_size()
    if tensor.storage_offset < 0 or (tensor.storage_offset + tensor.numel()) * itemsize > record.size:
        raise CheckpointError(f"a tensor lies outside its record {record.name}; the file is corrupt")
    return TensorBytes(record, record.data_offset + tensor.storage_offset * itemsize, tensor.numel(), itemsize,
                       tensor.storage.type_name)
