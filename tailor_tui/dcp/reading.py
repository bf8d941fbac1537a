"""A DCP checkpoint read without torch: its `.metadata` (`read_metadata`), and where each chunk's bytes lie in
its `.distcp` file, with the CRC-32 that checks them (`locate_chunk`).

Every input is taken as hostile: `.metadata` is unpickled by the project's allow-listed unpickler
(`formats.pickled.read_pickle`: its size, memo, nesting and object memory bounded before anything is
built), with torch's DCP classes standing in as plain records (`_GLOBALS`: nothing else is looked up), and
then checked whole: known dtypes, shapes of whole numbers, each chunk inside its tensor and the chunks
covering it, every storage entry naming a chunk the metadata lists and a file of the folder by a plain
name. A chunk's archive is read as torch's reader reads it (its zip directory within the bytes the
metadata gives it, each record's local header), its tensor's pickle checked to be the chunk (shape,
dtype, contiguous, one storage), and its data's record named with the CRC-32 that checks it.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checked.files import open_regular
from tailor_tui.checked.ranges import Window
from tailor_tui.dcp.chunks import ITEMSIZE
from tailor_tui.dcp.metadata import (
    METADATA,
    TORCH_DTYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorStorageMetadata,
)
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.dtypes import STORAGE_DTYPE
from tailor_tui.formats.pickled import MAX_DIMS, Size, TensorRef, TorchDtype, read_pickle
from tailor_tui.formats.ptfile import PICKLE_FAILURES, Record
from tailor_tui.formats.zipdir import RecordError, local_data_start, raw_name, read_directory_of

MAX_ENTRIES = 1 << 20  # keys of a state dict: a 70B model with AdamW holds ~3,000
MAX_CHUNKS = 1 << 16  # of one tensor: one per rank of the largest run that saved it
MAX_OFFSET = 1 << 62
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")  # a file of the folder: no path, no hidden name
_MODULE = "torch.distributed.checkpoint.metadata"
DAMAGED = f"the checkpoint is damaged or not a PyTorch Distributed Checkpoint; {RECOPY}"


class _PickledState:
    """One of torch's DCP dataclasses as pickled: its state, kept for `_checked` to read."""

    def __setstate__(self, state):
        self.state = state


class _PickledMetadata(_PickledState):
    pass


class _PickledTensor(_PickledState):
    pass


class _PickledProperties(_PickledState):
    pass


class _PickledChunk(_PickledState):
    pass


class _PickledBytes(_PickledState):
    pass


class _PickledIndex(_PickledState):
    pass


class _PickledInfo(_PickledState):
    pass


class _PickledStorageMeta(_PickledState):
    pass


def _layout(name):
    return ("layout", name)


def _memory_format(code):
    return ("memory_format", code)


def _path(*parts):
    return "/".join(str(p) for p in parts)


_GLOBALS = {
    (_MODULE, "Metadata"): _PickledMetadata, (_MODULE, "TensorStorageMetadata"): _PickledTensor,
    (_MODULE, "TensorProperties"): _PickledProperties, (_MODULE, "ChunkStorageMetadata"): _PickledChunk,
    (_MODULE, "BytesStorageMetadata"): _PickledBytes, (_MODULE, "MetadataIndex"): _PickledIndex,
    (_MODULE, "StorageMeta"): _PickledStorageMeta, (_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _PickledInfo,
    ("torch", "Size"): Size, ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path, ("pathlib", "WindowsPath"): _path,
    **{("torch", name): TorchDtype(name) for name in TORCH_DTYPES.values()},
}


def _stand_in(module: str, name: str):
    try:
        return _GLOBALS[module, name]
    except KeyError:
        raise pickle.UnpicklingError(f"Unsupported GLOBAL {module}.{name} (not one of torch's DCP metadata "
                                     "classes)") from None


def read_metadata(folder: Path) -> Metadata:
    """The `.metadata` of the DCP checkpoint `folder`, checked whole (CheckpointError naming it)."""
    path = folder / METADATA
    try:
        fd = open_regular(path, follow=False)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc}); is {folder} a PyTorch Distributed "
                              "Checkpoint?") from None
    try:
        with open(fd, "rb", closefd=True) as f:
            data = f.read(64 << 20 | 1)
        found = read_pickle(data, stand_in=_stand_in)
    except (pickle.UnpicklingError, *PICKLE_FAILURES) as exc:
        raise CheckpointError(f"{path}: not a DCP metadata file tailor-tui reads ({_line(exc)}); {DAMAGED}") from None
    try:
        return _checked(found)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{path}: its metadata does not describe a checkpoint ({_line(exc)}); "
                              f"{DAMAGED}") from None


def _line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:160]


def _state(obj, cls: type) -> dict:
    if type(obj) is not cls or not isinstance(getattr(obj, "state", None), dict):
        raise TypeError(f"a {type(obj).__name__} where a {cls.__name__.removeprefix('_Pickled')} belongs")
    state: dict = getattr(obj, "state")  # noqa: B009 (checked to be there, a dict, above)
    return state


def _whole(value, what: str, most: int = MAX_OFFSET) -> int:
    if type(value) is not int or not 0 <= value <= most:
        raise ValueError(f"{what} is {str(value)[:40]}, not a whole number up to {most:,}")
    return value


def _shape(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise ValueError(f"{what} is not a shape")
    return tuple(_whole(d, what) for d in value)


def _checked(found) -> Metadata:
    top = _state(found, _PickledMetadata)
    entries_in = top["state_dict_metadata"]
    if not isinstance(entries_in, dict) or len(entries_in) > MAX_ENTRIES:
        raise ValueError("state_dict_metadata is not a mapping of at most a million keys")
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    places: dict[str, set[tuple[int, ...]]] = {}  # a tensor's chunks, by their offsets
    for key, entry in entries_in.items():
        if type(key) is not str or not 0 < len(key) <= 4096:
            raise ValueError("a key that is not a name")
        if type(entry) is _PickledBytes:
            entries[key] = BytesStorageMetadata()
            continue
        state = _state(entry, _PickledTensor)
        properties = getattr(state["properties"], "state", None)
        if type(state["properties"]) is not _PickledProperties or not isinstance(properties, tuple) or not properties:
            raise ValueError(f"{key}: its properties are not torch's")
        dtype = properties[0]
        if not isinstance(dtype, TorchDtype) or dtype.name not in TORCH_DTYPES:
            raise ValueError(f"{key}: of a dtype tailor-tui does not read")
        size = _shape(state["size"], f"{key}'s size")
        chunks = state["chunks"]
        if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_CHUNKS:
            raise ValueError(f"{key}: {len(chunks) if isinstance(chunks, list) else 'no'} chunks")
        kept, covered = [], 0
        for chunk in chunks:
            c = _state(chunk, _PickledChunk)
            offsets, sizes = _shape(c["offsets"], f"{key}'s chunk"), _shape(c["sizes"], f"{key}'s chunk")
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise ValueError(f"{key}: a chunk at {list(offsets)} of {list(sizes)} lies outside its {list(size)}")
            kept.append(ChunkStorageMetadata(offsets, sizes))
            covered += math.prod(sizes)
        if covered != math.prod(size):
            raise ValueError(f"{key}: its chunks hold {covered:,} elements of its {math.prod(size):,}")
        entries[key] = TensorStorageMetadata(dtype.name, size, tuple(kept))
        places[key] = {c.offsets for c in kept}
    storage_in = top["storage_data"]
    if not isinstance(storage_in, dict):
        raise ValueError("storage_data is not a mapping")
    storage: dict[MetadataIndex, StorageInfo] = {}
    for index, info in storage_in.items():
        i, s = _state(index, _PickledIndex), _state(info, _PickledInfo)
        fqn = i["fqn"]
        entry = entries.get(fqn) if type(fqn) is str else None
        if entry is None:
            raise ValueError(f"storage for {str(fqn)[:80]}, which the metadata does not list")
        offset = None if i.get("offset") is None else _shape(i["offset"], f"{fqn}'s chunk offset")
        if (offset is None) != (fqn not in places) or (offset is not None and offset not in places[fqn]):
            raise ValueError(f"{fqn}: storage for a chunk it does not have")
        name = s["relative_path"]
        if type(name) is not str or not _FILE_NAME.fullmatch(name) or name == METADATA:
            raise ValueError(f"{fqn}: its bytes are said to lie in {str(name)[:80]!r}, not a file of the folder")
        if s.get("transform_descriptors"):
            raise ValueError(f"{fqn}: its bytes are transformed ({s['transform_descriptors']!r:.80}), which "
                             "tailor-tui does not read")
        storage[MetadataIndex(fqn, offset, _whole(i.get("index") or 0, "an index"))] = StorageInfo(
            name, _whole(s["offset"], f"{fqn}'s offset"), _whole(s["length"], f"{fqn}'s length"))
    for key in entries:
        if any(MetadataIndex(key, o) not in storage for o in places.get(key, [None])):
            raise ValueError(f"{key}: a chunk whose bytes the metadata does not place")
    meta = top.get("storage_meta")
    meta_state = meta.state if type(meta) is _PickledStorageMeta and isinstance(getattr(meta, "state", None), dict) else {}
    planner = top.get("planner_data")
    return Metadata(entries, dict(planner) if isinstance(planner, dict) else {}, storage,
                    StorageMeta(str(meta_state.get("checkpoint_id"))[:4096] if meta_state.get("checkpoint_id") else None),
                    str(top.get("version"))[:40] if top.get("version") is not None else "")


@dataclass(frozen=True)
class ChunkBytes:
    """Where one chunk's elements lie: `record` (absolute offsets in `path`, its CRC-32 stored) holds `numel`
    elements of `dtype`, row-major, of the rectangle the chunk is."""

    path: Path
    record: Record
    dtype: str
    numel: int


class _View(io.RawIOBase):
    """Bytes `start` to `start + length` of an open file, as a file of their own (a chunk's archive)."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.at = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.at = max(0, min(self.length, offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.at, os.SEEK_END: self.length}[whence]))
        return self.at

    def tell(self) -> int:
        return self.at

    def read(self, size: int = -1) -> bytes:
        n = self.length - self.at if size is None or size < 0 else min(size, self.length - self.at)
        data = os.pread(self.fd, n, self.start + self.at)
        self.at += len(data)
        return data


def archive_records(folder: Path, fd: int, info: StorageInfo, what: str) -> dict[str, Record]:
    """Every record of the archive `info` places in the open file `fd` (`info.relative_path` of `folder`), by its
    name less the archive's (`data.pkl`, `data/0`, …), absolute offsets, each local header checked against its
    directory entry as torch's reader reads it; CheckpointError naming the file (`what`: the archive, in words)."""
    path = folder / info.relative_path
    size = os.fstat(fd).st_size
    where = f"{path}: {what} at byte {info.offset:,}"
    if info.offset + info.length > size:
        raise CheckpointError(f"{where} runs past the file's end ({size:,} bytes); the file is truncated; {DAMAGED}")
    try:
        entries = read_directory_of(_View(fd, info.offset, info.length))
        prefix = next((e.name[: -len("data.pkl")] for e in entries
                       if e.name.endswith("/data.pkl") and e.name.count("/") == 1), None)
        if prefix is None:
            raise zipfile.BadZipFile("it holds no pickle (data.pkl)")
        window = Window(fd)
        records = {}
        for e in entries:
            if not e.name.startswith(prefix):
                raise zipfile.BadZipFile(f"its record {e.name[:80]} lies outside its archive {prefix[:-1]}")
            raw = raw_name(e)
            head = window.read(info.offset + e.header_offset, 30 + len(raw))
            start = local_data_start(e.name, raw, e.flags, e.crc, e.size, head, e.header_offset)
            if start + e.size > info.length:
                raise zipfile.BadZipFile(f"its record {e.name[:80]} runs past the archive's bytes")
            records[e.name[len(prefix):]] = Record(e.name, info.offset + e.header_offset, info.offset + start,
                                                   e.size, e.crc, ())
        return records
    except (zipfile.BadZipFile, RecordError) as exc:
        raise CheckpointError(f"{where} is not a torch archive ({_line(exc)}); {DAMAGED}") from None


def locate_chunk(folder: Path, fd: int, entry: TensorStorageMetadata, chunk: ChunkStorageMetadata,
                 info: StorageInfo, *, records: dict[str, Record] | None = None) -> ChunkBytes:
    """Where the elements of `chunk` of `entry` lie in the open file `fd` (`info.relative_path` of `folder`),
    as its archive says; CheckpointError naming the file where the archive is not the chunk's. `records`: the
    archive's (`archive_records`), where the caller read them already."""
    path = folder / info.relative_path
    what = f"the chunk ({entry.dtype} {list(chunk.sizes)})"
    records = records if records is not None else archive_records(folder, fd, info, what)
    where = f"{path}: {what} at byte {info.offset:,}"
    pickled, data = records["data.pkl"], records.get("data/0")
    try:
        if pickled.size > 1 << 16:
            raise pickle.UnpicklingError("its pickle is larger than a tensor's")
        storages: dict = {}
        tensor = read_pickle(os.pread(fd, pickled.size, pickled.data_offset), storages)
    except (pickle.UnpicklingError, *PICKLE_FAILURES) as exc:
        raise CheckpointError(f"{where} is not a torch archive of it ({_line(exc)}); {DAMAGED}") from None
    numel = math.prod(chunk.sizes)
    dtype = STORAGE_DTYPE.get(tensor.storage.type_name) if isinstance(tensor, TensorRef) else None
    if (data is None or not isinstance(tensor, TensorRef) or tuple(tensor.size) != chunk.sizes
            or dtype != entry.dtype or not tensor.is_contiguous() or tensor.storage_offset != 0
            or list(storages) != ["0"] or data.size != numel * ITEMSIZE[entry.dtype]):
        raise CheckpointError(f"{where} holds another tensor than the metadata says; {DAMAGED}")
    return ChunkBytes(path, data, entry.dtype, numel)


MAX_VALUE = 1 << 20  # bytes of a value saved as bytes (a hyperparameter, a list of names)


def read_value(folder: Path, metadata: Metadata, key: str):
    """The value saved as bytes under `key` (a param group's `lr`, `betas`, `params`): its archive's pickle, read by
    the allow-listed unpickler (plain values only); CheckpointError naming the file where it is not one."""
    info = metadata.storage_data.get(MetadataIndex(key, None))
    if info is None:
        raise CheckpointError(f"{folder}: holds no value {key}; {DAMAGED}")
    fd = open_regular(folder / info.relative_path, follow=False)
    try:
        records = archive_records(folder, fd, info, f"the value of {key}")
        pickled = records["data.pkl"]
        if pickled.size > MAX_VALUE or len(records) > 8:
            raise CheckpointError(f"{folder / info.relative_path}: the value of {key} is larger than a "
                                  f"hyperparameter's ({pickled.size:,} bytes); {DAMAGED}")
        data = os.pread(fd, pickled.size, pickled.data_offset)
    finally:
        os.close(fd)
    if zlib.crc32(data) != pickled.crc:
        raise CheckpointError(f"{folder / info.relative_path}: the value of {key} fails its CRC-32 check; {DAMAGED}")
    try:
        storages: dict = {}
        value = read_pickle(data, storages)
    except (pickle.UnpicklingError, *PICKLE_FAILURES) as exc:
        raise CheckpointError(f"{folder / info.relative_path}: the value of {key} is not a plain value "
                              f"({_line(exc)}); {DAMAGED}") from None
    if storages:
        raise CheckpointError(f"{folder / info.relative_path}: the value of {key} holds a tensor; {DAMAGED}")
    return value
