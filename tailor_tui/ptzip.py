"""Where each tensor's bytes sit inside a torch `.pt` file, without reading tensor data.

A `.pt` file is a zip archive: `data.pkl` (the pickled object, tensors as references
to storages) plus one uncompressed record per storage (`data/0`, `data/1`, …). Here
`data.pkl` is read by `pickled.read_pickle` (allow-listed globals only, as inert
stand-ins, no torch): that yields the object's structure and, for each tensor, which
record and which byte offset hold it.

The streaming merger uses this to copy the base's rank file record by record at
kernel speed and rewrite only the byte ranges a recipe replaces (then the records'
CRC-32s), instead of deserialising and re-serialising whole files.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .pickled import TensorRef, read_pickle
from .safe_load import refused

LOCAL_HEADER = 30
CENTRAL_SIGNATURE = 0x02014B50
DESCRIPTOR_SIGNATURE = b"PK\x07\x08"


class Unsupported(Exception):
    """The archive is laid out in a way the streaming path does not handle (compressed, …)."""


@dataclass(frozen=True)
class Record:
    name: str
    header_offset: int  # local file header
    data_offset: int  # first byte of the stored data
    size: int
    crc: int  # CRC-32 of the stored data, as the archive records it
    crc_offsets: tuple[int, int]  # where the CRC-32 sits: local header or data descriptor, central entry


@dataclass(frozen=True)
class TensorBytes:
    """A tensor's bytes: `numel` elements of `itemsize` bytes at `offset` in the file."""

    record: Record
    offset: int  # absolute file offset of element 0
    numel: int
    itemsize: int


def _records(path: Path) -> dict[str, Record]:
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            central_start = z.start_dir
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{path}: not a complete archive ({exc}); re-copy it") from None
    records = {}
    with open(path, "rb") as f:
        f.seek(central_start)
        central = {}
        for _ in infos:
            head = f.read(46)
            if len(head) < 46 or struct.unpack_from("<I", head)[0] != CENTRAL_SIGNATURE:
                raise Unsupported("unexpected central directory")
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", head, 28)
            name = f.read(name_len).decode("utf-8")
            central[name] = f.tell() - name_len - 46 + 16
            f.seek(extra_len + comment_len, 1)
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise Unsupported(f"record {info.filename} is compressed")
            f.seek(info.header_offset)
            head = f.read(LOCAL_HEADER)
            name_len, extra_len = struct.unpack_from("<HH", head, 26)
            data_offset = info.header_offset + LOCAL_HEADER + name_len + extra_len
            if info.flag_bits & 0x08:
                # torch writes a data descriptor after each record; its CRC is the one that counts
                # (the local header's is 0). The descriptor may or may not start with a signature.
                f.seek(data_offset + info.file_size)
                signed = f.read(4) == DESCRIPTOR_SIGNATURE
                crc_at = data_offset + info.file_size + (4 if signed else 0)
            else:
                crc_at = info.header_offset + 14
            records[info.filename] = Record(
                name=info.filename,
                header_offset=info.header_offset,
                data_offset=data_offset,
                size=info.file_size,
                crc=info.CRC,
                crc_offsets=(crc_at, central[info.filename]),
            )
    return records


def read_structure(path: Path):
    """(object with TensorRefs, records, record-name prefix) of a `.pt` file; reads only data.pkl."""
    path = Path(path)
    records = _records(path)
    pickles = [n for n in records if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pickles) != 1:
        raise Unsupported("no single data.pkl")
    prefix = pickles[0][: -len("data.pkl")]
    with open(path, "rb") as f:
        rec = records[pickles[0]]
        f.seek(rec.data_offset)
        data = f.read(rec.size)
    try:
        obj = read_pickle(data)
    except pickle.UnpicklingError as exc:  # a global outside the allow-list
        raise refused(path, exc) from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}); "
                              "the file may be truncated or corrupt") from None
    return obj, records, prefix


def locate(tensor: TensorRef, records: dict[str, Record], prefix: str) -> TensorBytes:
    """The bytes of a tensor read by `read_structure` (must be contiguous)."""
    if not isinstance(tensor, TensorRef) or not tensor.is_contiguous():
        raise Unsupported("not a plain contiguous tensor")
    record = records.get(f"{prefix}data/{tensor.storage.key}")
    if record is None:
        raise Unsupported(f"storage {tensor.storage.key} has no record")
    itemsize = tensor.element_size()
    if (tensor.storage_offset + tensor.numel()) * itemsize > record.size:
        raise CheckpointError(f"a tensor runs past the end of record {record.name}; the file is corrupt")
    return TensorBytes(record, record.data_offset + tensor.storage_offset * itemsize, tensor.numel(), itemsize)
