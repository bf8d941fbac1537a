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

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from tailor_tui import crc
from tailor_tui.errors import CheckpointError
from tailor_tui.fileio import OpenFiles, copy_range, open_fd, output_error, pwrite_all
from tailor_tui.formats.pickled import StorageRef, TensorRef
from tailor_tui.formats.ptfile import Record, Unsupported, checked_crcs, locate, read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes, tensor

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
    digest = hashlib.sha256(archive.encode("utf-8") + b"\0" + pickle).digest()
    return f"{int.from_bytes(digest, 'big') % 10 ** 40:040d}"


def write_archive(path: Path, *, archive: str, pickle: bytes, storages: list, ident: str | None = None,
                  buffer: memoryview | None = None) -> dict[str, Record]:
    """Write `path` as torch.save would: records named `archive/…`, `pickle` as data.pkl and
    `storages[k]` (bytes, `Copied` or `Reserved`) as `data/k`. Returns every record, by name.
    Not fsynced: the caller fsyncs once the reserved records are filled."""
    buffer = buffer if buffer is not None else memoryview(bytearray(1 << 20))
    entries = [("data.pkl", pickle), (".format_version", FORMAT_VERSION), (".storage_alignment", b"64"),
               ("byteorder", BYTEORDER), *((f"data/{k}", s) for k, s in enumerate(storages)),
               ("version", VERSION),
               (".data/serialization_id", (ident or serialization_id(pickle, archive)).encode("ascii"))]
    records, central, at = {}, [], 0
    try:
        with contextlib.ExitStack() as stack:
            fd = open_fd(stack, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            sources = OpenFiles(stack)  # each source file opened once, whatever its records copied
            out = _Pending(fd)  # headers and small records gathered into few writes (hundreds per file)
            for name, content in entries:
                full = f"{archive}/{name}".encode("utf-8")
                size = content.size if isinstance(content, (Copied, Reserved)) else len(content)
                wide = size >= _ZIP64 or at >= _ZIP64
                flags = _UTF8 | (_DESCRIBED if size else 0)
                header = _local_header(full, size, at, flags)
                data_at = at + len(header)
                out.put(header, at)
                if isinstance(content, Reserved):
                    value = 0
                elif isinstance(content, Copied):
                    value = _copy(fd, content, data_at, buffer, sources)
                else:
                    out.put(content, data_at)
                    value = crc.crc32(content)
                end = data_at + size
                descriptor = b""
                if size:
                    descriptor = struct.pack("<4sIQQ" if wide else "<4sIII", b"PK\x07\x08", value, size, size)
                    out.put(descriptor, end)
                central.append((full, size, at, value, flags))
                records[full.decode()] = Record(full.decode(), at, data_at, size, value,
                                                (end + 4,) if size else (at + 14,))
                at = end + len(descriptor)
            start = at
            directory = bytearray()
            for full, size, offset, value, flags in central:
                crc_at = start + len(directory) + 16
                directory += _central_entry(full, size, offset, value, flags)
                name = full.decode()
                records[name] = Record(name, offset, records[name].data_offset, size, value,
                                       (*records[name].crc_offsets, crc_at))
            directory += _end_records(len(central), len(directory), start)
            out.put(directory, start)
            out.flush()
    except OSError as exc:
        raise output_error(exc, path) from None
    return records


class _Pending:
    """Bytes to write at consecutive offsets of `fd`, gathered and written at once (a gap, where
    a reserved record's space is left a hole or a copied one goes, starts another write)."""

    def __init__(self, fd: int, limit: int = 1 << 20):
        self.fd, self.limit, self.data, self.at = fd, limit, bytearray(), 0

    def put(self, data: bytes, at: int) -> None:
        if self.data and (self.at + len(self.data) != at or len(self.data) + len(data) > self.limit):
            self.flush()
        if not self.data:
            self.at = at
        self.data += data

    def flush(self) -> None:
        if self.data:
            pwrite_all(self.fd, self.data, self.at)
            self.data.clear()


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
    return _LOCAL.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def _central_entry(name: bytes, size: int, offset: int, value: int, flags: int) -> bytes:
    wide = b""
    if size >= _ZIP64:
        wide += struct.pack("<QQ", size, size)
    if offset >= _ZIP64:
        wide += struct.pack("<Q", offset)
    extra = struct.pack("<HH", 1, len(wide)) + wide if wide else b""
    small = min(size, _ZIP64)
    return _CENTRAL.pack(b"PK\x01\x02", 0, 0, flags, 0, 0, 0, value, small, small, len(name), len(extra), 0, 0,
                         0, 0, min(offset, _ZIP64)) + name + extra


def _end_records(count: int, size: int, start: int) -> bytes:
    zip64_at = start + size
    return (struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count, size, start)
            + struct.pack("<4sIQI", b"PK\x06\x07", 0, zip64_at, 1)
            + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(count, _ZIP64_COUNT), min(count, _ZIP64_COUNT),
                          min(size, _ZIP64), min(start, _ZIP64), 0))


def _copy(fd: int, what: Copied, at: int, buffer: memoryview, sources: OpenFiles) -> int:
    """Copy `what` to `at` in `fd` (in the kernel); its CRC-32, from the source's bytes as its
    record's stored CRC-32 is checked (CheckpointError naming the source if it fails)."""
    if what.record.size == 0 and what.record.crc in (0, None):  # an empty storage (ZeRO-3's placeholders)
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
                                      "the file is corrupt, re-copy it from the training run")
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


def write(obj, fills: dict, path: Path, **kwargs) -> dict:
    """Write `obj` to `path` as torch.save would, each storage's bytes from `fills`; its records."""
    data, storages = dumps(obj)
    return write_archive(path, archive=path.stem, pickle=data, storages=[fills[id(s)] for s in storages], **kwargs)
