"""Torch files (`.pt`, `.bin`, `.pth`) as the verifier reads them: torch's own reader, none of the writers'.

A zip-format file (what `torch.save` writes) is a zip archive of stored records, each with the
CRC-32 of its bytes in the archive's directory, which torch never checks. Python's `zipfile`
reads the directory; every record's bytes, where its local header puts them, are checked against
that CRC-32 (streamed through one buffer: bounded memory, whatever the file's size) before
`torch.load(weights_only=True, mmap=True)` maps the file (its tensors' pages are read only where
they are compared). A legacy-format file (`_use_new_zipfile_serialization=False`, LLMTailor's
optim files) has no CRC-32s and cannot be mapped: torch loads it whole, weights-only.

Before torch unpickles a file's structure, its pickles are held to the bounds any checkpoint's
keeps (`formats.pickle_bounds`, a guard on hostile input that reads nothing for the verdict: memo,
nesting, what they would build). weights-only loading allows torch's own types and, beyond them,
only the DeepSpeed classes a ZeRO-3 checkpoint pickles (`ds_format.DEEPSPEED_CLASSES`) and
`getattr` where an early Python 3.11 pickled an enumeration member by its name
(`ds_format.enum_member_value` says which).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

from tailor_tui.checked.files import open_regular
from tailor_tui.checked.ranges import READ_CHUNK
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.ds_format import DEEPSPEED_CLASSES, enum_member_value
from tailor_tui.formats.pickle_bounds import MAX_PICKLE_BYTES, Truncated, check_bounds_bytes
from tailor_tui.formats.zipdir import LOCAL, LOCAL_HEADER

SMALL = 16 << 20  # a zip file at most this size is read whole (a model_states file), in one read


class Record(NamedTuple):
    """One record of a zip archive: its name, where its bytes are, how many, their stored CRC-32."""

    name: str
    offset: int
    size: int
    crc: int


def open_binary(path: Path):
    """A binary file object of the regular file at `path` (`checked.files.open_regular`: a FIFO, device or socket
    is refused without waiting on it; CheckpointError, as a missing file is)."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return os.fdopen(fd, "rb", buffering=0)


def is_zip(path: Path) -> bool:
    with open_binary(path) as f:
        return f.read(len(LOCAL)) == LOCAL


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: {why}; the file is truncated or corrupt, {RECOPY}")


def _records(path: Path, f, size: int, whole: bytes | None = None) -> list[Record]:
    """Every record of the zip archive `f` (a file object of `size` bytes; `whole`: its bytes, when
    they are read already), located by its local header."""
    try:
        infos = zipfile.ZipFile(io.BytesIO(whole) if whole is not None else f).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise _corrupt(path, f"not a whole zip archive ({exc})") from None
    found = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
            raise _corrupt(path, f"record {info.filename} is compressed or encrypted, which torch never writes")
        name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        at = info.header_offset
        header = (whole[at: at + LOCAL_HEADER + len(name)] if whole is not None
                  else os.pread(f.fileno(), LOCAL_HEADER + len(name), at))
        if len(header) < LOCAL_HEADER or not header.startswith(LOCAL):
            raise _corrupt(path, f"record {info.filename} has no local header where the directory puts it")
        name_length, extra_length = struct.unpack_from("<HH", header, 26)
        if header[LOCAL_HEADER:] != name or name_length != len(name):
            raise _corrupt(path, f"record {info.filename}'s local header names another record")
        offset = at + LOCAL_HEADER + name_length + extra_length
        if offset + info.file_size > size:
            raise _corrupt(path, f"record {info.filename} runs past the end of the file")
        found.append(Record(info.filename, offset, info.file_size, info.CRC))
    return found


def _failed(path: Path, record: Record) -> CheckpointError:
    return CheckpointError(f"{path}: record {record.name} fails its CRC-32 check (the file is damaged); "
                           f"{RECOPY}")


def check_crcs(path: Path, *, crc: bool = True) -> list[bytes]:
    """Check every record of the zip-format torch file `path` against its stored CRC-32
    (CheckpointError naming the first that fails), reading the file once, a chunk at a time
    (`crc=False`: the caller has just done so; only the pickles are read). Returns the bytes of its
    pickles (`data.pkl`: torch's structure, at most MAX_PICKLE_BYTES each)."""
    pickles = []
    with open_binary(path) as f:
        size = os.fstat(f.fileno()).st_size
        buffer = bytearray(READ_CHUNK)
        for record in _records(path, f, size):
            pickled = record.name.endswith("data.pkl")
            if pickled and record.size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{path}: refused to load: its structure ({record.name}) is larger than "
                                      f"{MAX_PICKLE_BYTES >> 20} MiB; it is corrupt or was crafted")
            if not (crc or pickled):
                continue
            value, done, parts = 0, 0, []
            while done < record.size:
                n = os.preadv(f.fileno(), [memoryview(buffer)[: min(READ_CHUNK, record.size - done)]],
                              record.offset + done)
                if n <= 0:
                    raise _corrupt(path, f"record {record.name} ends early")
                value = zlib.crc32(memoryview(buffer)[:n], value)
                if pickled:
                    parts.append(bytes(buffer[:n]))
                done += n
            if value != record.crc:
                raise _failed(path, record)
            if pickled:
                pickles.append(b"".join(parts))
    return pickles


def _legacy_pickles(path: Path) -> list[bytes]:
    """The pickles a legacy-format torch file starts with (magic number, protocol version, system
    info, the object, its storages' keys), each at most MAX_PICKLE_BYTES: read a window at a time."""
    found, at = [], 0
    with open_binary(path) as f:
        for _ in range(5):
            window = 1 << 16
            while True:
                data = os.pread(f.fileno(), window, at)
                try:
                    end = check_bounds_bytes(data)
                    break
                except Truncated:
                    if len(data) < window or window > MAX_PICKLE_BYTES:
                        raise
                    window = min(window * 4, MAX_PICKLE_BYTES + 1)
            found.append(data[:end])
            at += end
    return found


def small_records(path: Path) -> list[tuple[str, memoryview]] | None:
    """(name, bytes) of every record of the zip-format torch file `path`, in the archive's
    order, each checked against its stored CRC-32 (CheckpointError), from one read of the file;
    None when it is no zip file or larger than SMALL."""
    with open_binary(path) as f:
        whole = f.read(SMALL + 1)
    if len(whole) > SMALL or not whole.startswith(LOCAL):
        return None
    view, found = memoryview(whole), []
    for record in _records(path, None, len(whole), whole):
        data = view[record.offset: record.offset + record.size]
        if zlib.crc32(data) != record.crc:
            raise _failed(path, record)
        found.append((record.name, data))
    return found


def allowed_globals() -> list:
    """The DeepSpeed classes checkpoint files pickle, from the installed DeepSpeed, and `getattr`
    for an enumeration member pickled by its name (`_member`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    classes = [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_CLASSES]
    return [*classes, (_member, "builtins.getattr")]


def _member(cls, name):
    """`getattr(cls, name)` for torch.load: a member of an allowed DeepSpeed enumeration, taken by
    its name; anything else is refused (`ds_format.enum_member_value` raises)."""
    enum_member_value(getattr(cls, "__module__", ""), getattr(cls, "__qualname__", ""), name)
    return cls[name]


def torch_reads(path: Path) -> str | None:
    """None if `path`, a zip-format torch file, is read by torch's own reader (miniz, as torch.load
    reads it): the archive opens and every record is read whole (a file of at most SMALL bytes: the
    files copied from the base) or located (a larger one: mapped as torch.load(mmap=True) would);
    else the reason it is not, in one line. Bounded: nothing larger than SMALL is read."""
    import torch

    try:
        reader = torch._C.PyTorchFileReader(str(path))
        whole = os.stat(path).st_size <= SMALL
        for name in reader.get_all_records():
            reader.get_record(name) if whole else reader.get_record_offset(name)  # type: ignore[attr-defined]
    except (RuntimeError, OSError, ValueError) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return None


def load(path: Path, *, checked: bool = False):
    """The object in torch file `path`, weights-only: a zip-format file's records checked against
    their CRC-32s first (`checked`: the caller has just done so) and its tensors memory-mapped; a
    legacy-format file read whole. Either way its pickles are held to the bounds of any checkpoint's
    (`pickle_bounds`: memo, nesting, what they would build) before torch unpickles them.
    CheckpointError, one line naming the file, when it cannot be loaded."""
    import torch

    path = Path(path)
    mapped = is_zip(path)
    try:
        for pickled in check_crcs(path, crc=not checked) if mapped else _legacy_pickles(path):
            check_bounds_bytes(pickled)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused to load: {str(exc)[:200]}; it is corrupt or was crafted") from None
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load ({first[:200]}); it holds what a DeepSpeed checkpoint "
                              "does not, it may be unsafe to open") from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, struct.error) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = "zip-format" if mapped else "legacy-format (non-zip)"
        raise CheckpointError(f"{path}: a {what} torch file that cannot be read ({first[:200]}); it may be "
                              f"truncated or corrupt, {RECOPY}") from None
