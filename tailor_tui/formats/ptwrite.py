"""Write a torch zip archive (`.pt`) without torch, laid out byte for byte as torch.save lays it out.

torch.save writes its archive with miniz (caffe2's PyTorchFileWriter): stored records in a
fixed order (`data.pkl`, `.format_version`, `.storage_alignment`, `byteorder`, `data/0` …,
`version`, `.data/serialization_id`), each with a data descriptor, no time stamps, its data
aligned to 64 bytes by an `FB` extra field of `Z`s, zip64 fields where a size or an offset
reaches 4 GiB, and always a zip64 end record. `write_archive` writes the same bytes for the
same pickle and storages (tests/test_ptwrite.py compares it with torch.save, beyond 4 GiB
too). A storage's bytes are given, copied from a record of another file in the kernel
(its CRC-32 checked on the way), or reserved: left as a hole (a sparse file) for the caller
to fill, with the CRC-32 fields at the offsets the returned `Record` names.

A file's structure can also be read to be written again changed (`Rewritable`: the resharding
skeleton, a partial base's optim file): `clone` gives a tensor its own copy of a storage (torch's
`clone`), `reserved` a new tensor whose bytes the caller writes later, `write` puts the changed
object out with each storage's bytes copied from where they lie.

Torch-free; `ptfile` reads what this writes.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checked import crc
from tailor_tui.checked.evidence import checked_crcs
from tailor_tui.checked.ranges import READ_CHUNK
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.fileio import CREATE, OpenFiles, Target, copy_range, open_fd, output_error, pwrite_all
from tailor_tui.formats.pickled import StorageRef, TensorRef
from tailor_tui.formats.ptfile import Record, Unsupported, locate, read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes, tensor
from tailor_tui.formats.zipdir import CENTRAL, DESCRIPTOR, END, END64, LOCAL, LOCATOR64

ALIGNMENT = 64
FORMAT_VERSION = b"1"
BYTEORDER = b"little"
VERSION = b"3\n"  # the archive format torch writes (caffe2's kProducedFileFormatVersion)
_UTF8, _DESCRIBED = 0x0800, 0x0008  # names are UTF-8; a data descriptor follows a record (not an empty one)
_ZIP64 = 0xFFFFFFFF  # a size or an offset this large or larger takes a zip64 field
_ZIP64_COUNT = 0xFFFF  # more records than this: the end record says 0xFFFF, the zip64 one the count
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")


@dataclass(frozen=True)
class Copied:
    """A storage's bytes copied from a record of another file: `size` bytes at `offset` in
    `record` of `path`, whose stored CRC-32 is checked as they are copied."""

    path: Path
    record: Record
    offset: int
    size: int


@dataclass(frozen=True)
class Reserved:
    """A storage whose `size` bytes the caller writes (and then sets its record's CRC-32)."""

    size: int


def serialization_id(pickle: bytes, archive: str) -> str:
    """An archive's id, 40 decimal digits as torch's. torch draws its at random; this one is
    drawn from what the archive holds, so that writing the same structure again (a re-run,
    or a job over several processes) gives the same bytes."""
    return _ident(hashlib.sha256(pickle).digest(), archive)


def _ident(pickle_digest: bytes, archive: str) -> str:
    digest = hashlib.sha256(archive.encode("utf-8") + b"\0" + pickle_digest).digest()
    return f"{int.from_bytes(digest, 'big') % 10 ** 40:040d}"


def write_archive(path: Target, *, archive: str, pickle: bytes, storages: list, ident: str | None = None,
                  buffer: memoryview | None = None) -> dict[str, Record]:
    """Write `path` as torch.save would: records named `archive/…`, `pickle` as data.pkl and
    `storages[k]` (bytes, `Copied` or `Reserved`) as `data/k`. Returns every record, by name.
    Not fsynced: the caller fsyncs once the reserved records are filled."""
    layout = _Layout(archive, pickle, storages, ident or serialization_id(pickle, archive))
    return layout.write(path, buffer)


def layout(*, archive: str, pickle: bytes, storages: list, ident: str) -> "_Layout":
    """The archive `write_archive` writes, laid out and not written: its `size`, its bytes where it holds no
    storage of another file's (`whole`), or written from any offset of a file (`write_into`) with its reserved
    storages' bytes and CRC-32s the caller's (`reserved_at`): one of the archives a DCP `.distcp` file holds
    one after another, each as torch.save writes it to a stream."""
    return _Layout(archive, pickle, storages, ident)


class SameArchives:
    """Archives of one structure (`pickle`, `storages`) under many names: a resharded output's
    rank files. The layout of the first of each name length is kept, and every other of that
    length is written as that layout with its names and its serialization id changed: the bytes
    `write_archive` writes, without its per-record work again (a model_states file holds a
    record per parameter, and a wide run hundreds of such files)."""

    def __init__(self, pickle: bytes, storages: list):
        self.pickle, self.storages = pickle, list(storages)
        self.digest = hashlib.sha256(pickle).digest()
        self._layouts: dict[int, _Layout] = {}

    def write(self, path: Target, archive: str, buffer: memoryview | None = None) -> dict[str, Record]:
        ident = _ident(self.digest, archive)
        length = len(archive.encode("utf-8"))
        known = self._layouts.get(length)
        if known is None:
            known = self._layouts[length] = _Layout(archive, self.pickle, self.storages, ident)
            return known.write(path, buffer)
        return known.renamed(archive, ident).write(path, buffer)


class _Layout:
    """An archive's bytes but those copied from other files and the reserved holes: its chunks
    of consecutive bytes (headers, small records, descriptors, the central directory) by offset,
    where each record lies, and where the archive's name, its serialization id and the CRC-32s
    of copied records go."""

    def __init__(self, archive: str, pickle: bytes, storages: list, ident: str):
        self.archive = archive
        self.chunks: list[list] = []  # [offset, bytearray], in file order
        self.starts: list[int] = []  # each chunk's offset, kept beside them: _patch bisects it
        self.names: list[int] = []  # where the archive's name starts: in each local header and central entry
        self.copies: list[tuple[Copied, int]] = []  # (what, index of its record)
        self.records: list[list] = []  # [name in the archive, header offset, data offset, size, CRC-32, CRC offsets]
        entries = [("data.pkl", pickle), (".format_version", FORMAT_VERSION), (".storage_alignment", b"64"),
                   ("byteorder", BYTEORDER), *((f"data/{k}", s) for k, s in enumerate(storages)),
                   ("version", VERSION), (".data/serialization_id", ident.encode("ascii"))]
        prefix = f"{archive}/".encode("utf-8")
        central, at = [], 0
        for name, content in entries:
            full = prefix + name.encode("utf-8")
            size = content.size if isinstance(content, (Copied, Reserved)) else len(content)
            wide = size >= _ZIP64 or at >= _ZIP64
            flags = _UTF8 | (_DESCRIBED if size else 0)
            header = _local_header(full, size, at, flags)
            data_at = at + len(header)
            self._put(header, at)
            self.names.append(at + _LOCAL.size)
            value = 0  # reserved: the caller's; copied: set as it is copied
            if isinstance(content, Copied) and not _empty(content):
                self.copies.append((content, len(self.records)))
            elif not isinstance(content, (Copied, Reserved)):
                self._put(content, data_at)
                value = crc.crc32(content)
            end = data_at + size
            descriptor = b""
            if size:
                descriptor = struct.pack("<4sIQQ" if wide else "<4sIII", DESCRIPTOR, value, size, size)
                self._put(descriptor, end)
            central.append((full, size, at, flags))
            self.records.append([name, at, data_at, size, value, [end + 4] if size else [at + 14]])
            at = end + len(descriptor)
        start, directory = at, bytearray()
        for (full, size, offset, flags), record in zip(central, self.records):
            record[5].append(start + len(directory) + 16)
            self.names.append(start + len(directory) + _CENTRAL.size)
            directory += _central_entry(full, size, offset, record[4], flags)
        directory += _end_records(len(central), len(directory), start)
        self._put(directory, start)

    def _put(self, data, at: int) -> None:
        if self.chunks and self.chunks[-1][0] + len(self.chunks[-1][1]) == at:
            self.chunks[-1][1] += data
        else:
            self.chunks.append([at, bytearray(data)])
            self.starts.append(at)

    def _patch(self, at: int, data: bytes) -> None:
        """Overwrite bytes of one chunk: O(log chunks), so laying out an archive is linear in records."""
        i = bisect.bisect_right(self.starts, at) - 1
        start, chunk = self.chunks[i]
        chunk[at - start: at - start + len(data)] = data

    @property
    def size(self) -> int:
        """The archive's length in bytes."""
        start, chunk = self.chunks[-1]
        return start + len(chunk)

    def whole(self) -> bytes:
        """The archive's bytes, where it holds no storage of another file's nor a reserved one."""
        if self.copies or len(self.chunks) != 1:
            raise ValueError("an archive with copied or reserved storages is written by `write`")
        return bytes(self.chunks[0][1])

    def reserved_at(self, key: int) -> tuple[int, tuple[int, ...]]:
        """Where storage `data/key`'s bytes start in the archive, and where its CRC-32 goes (each offset)."""
        record = self.records[4 + key]  # data.pkl, .format_version, .storage_alignment, byteorder, then data/0 …
        return record[2], tuple(record[5])

    def write_into(self, fd: int, base: int) -> None:
        """Write its bytes from byte `base` of `fd`, the reserved storages' left for the caller (with their
        CRC-32s, at `reserved_at`); no storage copied from another file (ValueError)."""
        if self.copies:
            raise ValueError("an archive with copied storages is written by `write`")
        for at, chunk in self.chunks:
            pwrite_all(fd, chunk, base + at)

    def renamed(self, archive: str, ident: str) -> "_Layout":
        """This layout for an archive named `archive` (as long in UTF-8 as its own) with id `ident`."""
        other = object.__new__(_Layout)  # filled here, not laid out again
        other.archive, name = archive, archive.encode("utf-8")
        other.copies, other.names, other.records = self.copies, self.names, [list(r) for r in self.records]
        other.chunks = [[at, bytearray(chunk)] for at, chunk in self.chunks]
        other.starts = self.starts  # never changed once laid out: shared
        i = 0
        for at in self.names:  # in file order, as the chunks are
            while other.chunks[i][0] + len(other.chunks[i][1]) <= at:
                i += 1
            start, chunk = other.chunks[i]
            chunk[at - start: at - start + len(name)] = name
        record = other.records[-1]  # .data/serialization_id
        other._patch(record[2], ident.encode("ascii"))
        record[4] = crc.crc32(ident.encode("ascii"))
        for at in record[5]:
            other._patch(at, struct.pack("<I", record[4]))
        return other

    def write(self, path: Target, buffer: memoryview | None = None) -> dict[str, Record]:
        """Write it to `path`, copied records copied (their CRC-32s checked as they are, and set); its
        records by name. Not fsynced."""
        buffer = buffer if buffer is not None else memoryview(bytearray(READ_CHUNK))
        try:
            with contextlib.ExitStack() as stack:
                fd = open_fd(stack, path, CREATE)
                sources = OpenFiles(stack)  # each source file opened once, whatever its records copied
                for what, i in self.copies:
                    record = self.records[i]
                    record[4] = _copy(fd, what, record[2], buffer, sources)
                    for at in record[5]:
                        self._patch(at, struct.pack("<I", record[4]))
                for at, chunk in self.chunks:
                    pwrite_all(fd, chunk, at)
        except OSError as exc:
            raise output_error(exc, path) from None
        prefix = f"{self.archive}/"
        return {prefix + name: Record(prefix + name, at, data_at, size, value, tuple(offsets))
                for name, at, data_at, size, value, offsets in self.records}


def _local_header(name: bytes, size: int, offset: int, flags: int) -> bytes:
    wide = b""
    if size >= _ZIP64:  # the compressed size is the descriptor's to tell: 0 here
        wide += struct.pack("<QQ", size, 0)
    if offset >= _ZIP64:
        wide += struct.pack("<Q", offset)
    extra = struct.pack("<HH", 1, len(wide)) + wide if wide else b""
    used = offset + _LOCAL.size + len(name) + len(extra) + 4
    padding = -used % ALIGNMENT
    extra += b"FB" + struct.pack("<H", padding) + b"Z" * padding
    return _LOCAL.pack(LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def _central_entry(name: bytes, size: int, offset: int, value: int, flags: int) -> bytes:
    wide = b""
    if size >= _ZIP64:
        wide += struct.pack("<QQ", size, size)
    if offset >= _ZIP64:
        wide += struct.pack("<Q", offset)
    extra = struct.pack("<HH", 1, len(wide)) + wide if wide else b""
    small = min(size, _ZIP64)
    return _CENTRAL.pack(CENTRAL, 0, 0, flags, 0, 0, 0, value, small, small, len(name), len(extra), 0, 0,
                         0, 0, min(offset, _ZIP64)) + name + extra


def _end_records(count: int, size: int, start: int) -> bytes:
    zip64_at = start + size
    return (struct.pack("<4sQHHIIQQQQ", END64, 44, 0x031E, 45, 0, 0, count, count, size, start)
            + struct.pack("<4sIQI", LOCATOR64, 0, zip64_at, 1)
            + struct.pack("<4sHHHHIIH", END, 0, 0, min(count, _ZIP64_COUNT), min(count, _ZIP64_COUNT),
                          min(size, _ZIP64), min(start, _ZIP64), 0))


def _empty(what: Copied) -> bool:
    """An empty storage (ZeRO-3's placeholders): nothing to copy, CRC-32 0."""
    return what.record.size == 0 and what.record.crc in (0, None)


def _copy(fd: int, what: Copied, at: int, buffer: memoryview, sources: OpenFiles) -> int:
    """Copy `what` to `at` in `fd` (in the kernel); its CRC-32, from the source's bytes as its
    record's stored CRC-32 is checked (CheckpointError naming the source if it fails)."""
    if _empty(what):
        return 0
    src = sources.fd(what.path)
    ranges = [(what.offset, what.size)] if what.size else []
    value = (checked_crcs(src, what.path, what.record, ranges, buffer) or [0])[0]
    copy_range(src, fd, what.offset, what.size, out_offset=at)
    return value


# --- a file read to be written again, changed ----------------------------------------------


class Rewritable:
    """One file's structure as read, and where each of its storages' bytes lie."""

    def __init__(self, path: Path):
        refs: dict[str, StorageRef] = {}
        self.path = path
        self.obj, self.records, self.prefix = read_structure(path, refs)
        self.fills = {}  # id(StorageRef) -> Copied | Reserved
        for key, ref in refs.items():
            record = self.records.get(f"{self.prefix}data/{key}")
            if record is None or record.size != storage_bytes(ref):
                raise CheckpointError(f"{path}: storage {key} does not match its record in the archive; "
                                      f"the file is corrupt, {RECOPY}")
            self.fills[id(ref)] = Copied(path, record, record.data_offset, record.size)

    def clone(self, value: TensorRef, fills: dict) -> TensorRef:
        """A copy of `value` in a storage of its own, as torch's `clone` makes one; its bytes
        are recorded in `fills`."""
        at = self.locate(value)
        storage = StorageRef("", value.storage.itemsize, value.numel(), value.storage.type_name)
        fills[id(storage)] = Copied(self.path, at.record, at.offset, at.numel * at.itemsize)
        return tensor(storage, value.size, requires_grad=value.requires_grad)

    def data(self, value: TensorRef, limit: int) -> bytes:
        """`value`'s bytes (a small tensor: at most `limit` bytes, else CheckpointError)."""
        at = self.locate(value)
        if at.numel * at.itemsize > limit:
            raise CheckpointError(f"{self.path}: a value of {at.numel} elements where a small one was expected; "
                                  "the file is from another run or layout")
        with open(self.path, "rb") as f:
            f.seek(at.offset)
            return f.read(at.numel * at.itemsize)

    def locate(self, value: TensorRef):
        try:
            return locate(value, self.records, self.prefix)
        except Unsupported as exc:
            raise CheckpointError(f"{self.path}: a tensor that cannot be copied ({exc})") from None


def reserved(size: int, like, fills: dict) -> TensorRef:
    """A 1-D tensor of `size` elements like `like` (dtype, requires_grad) whose bytes are left
    for the caller to write (TypeError if `like` is no tensor)."""
    if not isinstance(like, TensorRef):
        raise TypeError
    storage = StorageRef("", like.storage.itemsize, size, like.storage.type_name)
    fills[id(storage)] = Reserved(storage_bytes(storage))
    return tensor(storage, (size,), requires_grad=like.requires_grad)


def write(obj, fills: dict, path: Target, **kwargs) -> dict:
    """Write `obj` to `path` as torch.save would, each storage's bytes from `fills`; its records."""
    data, storages = dumps(obj)
    return write_archive(path, archive=path.stem, pickle=data, storages=[fills[id(s)] for s in storages], **kwargs)
