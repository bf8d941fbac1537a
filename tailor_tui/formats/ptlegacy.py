"""torch's legacy (non-zip) `.pt` format, read for structure without torch.

`torch.save(obj, f, _use_new_zipfile_serialization=False)` (DeepSpeed with
`checkpoint_serialization: false`, LLMTailor's optim files) writes, one after another:
a pickled magic number, the format's protocol version (1001), a dict of system info,
the object's pickle (storages as persistent ids), a pickled list of storage keys, then
each storage's data in that order: its element count as an 8-byte integer, then its
bytes. Here the pickles are read by `pickled` (allow-listed globals only, inert
stand-ins) and every storage's place is found by reading only its 8-byte count, so
the multi-GB data is never read; the file must end exactly after the last storage.
"""

from __future__ import annotations

import os
import struct

from tailor_tui.formats.pickled import StorageRef, read_pickle_from

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
START = b"\x80\x02\x8a\x0a"  # the magic number's pickle (protocol 2, a 10-byte long) begins so


class LegacyError(ValueError):
    """What is wrong with a file that starts like a legacy torch file (one phrase)."""


def read_legacy(fd: int, refs: dict | None = None, stand_in=None) -> tuple[object, dict[str, tuple[int, int]]]:
    """(object with TensorRefs, storage key -> (first data byte, bytes)) of the legacy file open as
    `fd` (read through it from its start, whatever was read of it before; left open); `refs`, if
    given, receives each storage's StorageRef by key; `stand_in`: the object's globals' stand-ins,
    as `pickled.read_pickle`'s (the file's own header pickles hold none).

    Raises LegacyError saying why the file is not a whole legacy torch file, and
    pickle.UnpicklingError for a global outside the allow-list."""
    size = os.fstat(fd).st_size
    with open(fd, "rb", closefd=False) as f:
        if read_pickle_from(f) != MAGIC_NUMBER:
            raise LegacyError("has the wrong magic number")
        version = read_pickle_from(f)
        if version != PROTOCOL_VERSION:
            raise LegacyError(f"has format version {version!r}, torch writes {PROTOCOL_VERSION}")
        info = read_pickle_from(f)
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            raise LegacyError("was not written on a little-endian machine (or its header is damaged)")
        seen: dict[str, StorageRef] = {} if refs is None else refs
        obj = read_pickle_from(f, seen, stand_in)
        keys = read_pickle_from(f)
        if not isinstance(keys, list) or sorted(set(keys)) != sorted(seen) or len(keys) != len(seen):
            raise LegacyError("lists other storages than its pickle uses")
        storages, at = {}, f.tell()
        for key in keys:
            f.seek(at)
            head = f.read(8)
            if len(head) < 8:
                raise LegacyError(f"ends before storage {key} (truncated)")
            (numel,) = struct.unpack("<q", head)
            if numel != seen[key].numel:
                raise LegacyError(f"stores {numel} elements for storage {key}, its pickle says {seen[key].numel}")
            nbytes = numel * seen[key].itemsize
            if at + 8 + nbytes > size:
                raise LegacyError(f"ends inside storage {key} (truncated)")
            storages[key] = (at + 8, nbytes)
            at += 8 + nbytes
    if at != size:
        raise LegacyError(f"has {size - at} bytes after its last storage")
    return obj, storages
