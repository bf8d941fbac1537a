"""Checks of DCP checkpoints the tests share: every chunk a whole archive (`assert_archives_intact`), and every
tensor as tailor-tui's reader puts it together equal to torch's `dcp.load` (`assert_reads_as_torch`); and the rot
they plant (`flip_chunk_byte`)."""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from tailor_tui.dcp import metadata as md
from tailor_tui.dcp.reading import archive_records, locate_chunk, read_metadata


def flip_chunk_byte(folder: Path, key: str, *, chunk: int = 0, at: int | None = None, bit: int = 0x10) -> None:
    """Flip `bit` of one byte of tensor `key`'s chunk number `chunk` in the DCP checkpoint `folder`: byte `at` of its
    data (default: the middle), its archive's CRC-32 left as it was."""
    found = read_metadata(folder)
    info = found.storage_data[md.MetadataIndex(key, found.state_dict_metadata[key].chunks[chunk].offsets)]
    with open(folder / info.relative_path, "r+b") as f:
        record = archive_records(folder, f.fileno(), info, "chunk")["data/0"]
        where = record.data_offset + (record.size // 2 if at is None else at)
        f.seek(where)
        flipped = bytes([f.read(1)[0] ^ bit])
        f.seek(where)
        f.write(flipped)


def assert_archives_intact(folder: Path) -> None:
    """Every chunk the metadata names is a whole zip archive whose records' CRC-32s hold (zipfile checks them:
    torch's loader need not), lying where the metadata says."""
    storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
    for index, info in storage.items():
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        assert len(data) == info.length, index
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert archive.testzip() is None, index


_NUMPY = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def assert_reads_as_torch(folder: Path) -> int:
    """Every tensor of the checkpoint, put together from its chunks as tailor-tui reads them (each chunk's
    CRC-32 checked), equals what torch's `dcp.load` gives; the number of chunks read."""
    ours = read_metadata(folder)
    theirs = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert set(ours.state_dict_metadata) == set(theirs)
    loaded = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in theirs.items() if hasattr(v, "size")}
    dcp.load(loaded, checkpoint_id=folder, no_dist=True)
    count = 0
    for key, entry in ours.state_dict_metadata.items():
        if not isinstance(entry, md.TensorStorageMetadata):
            continue
        assert (entry.size, entry.dtype) == (tuple(theirs[key].size), str(theirs[key].properties.dtype)[6:])
        whole = np.zeros(entry.size, dtype=_NUMPY[entry.dtype])
        for chunk in entry.chunks:
            info = ours.storage_data[md.MetadataIndex(key, chunk.offsets)]
            fd = os.open(folder / info.relative_path, os.O_RDONLY)
            try:
                found = locate_chunk(folder, fd, entry, chunk, info)
                raw = os.pread(fd, found.record.size, found.record.data_offset)
            finally:
                os.close(fd)
            assert zlib.crc32(raw) == found.record.crc, key
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            whole[box] = np.frombuffer(raw, _NUMPY[entry.dtype]).reshape(chunk.sizes)
            count += 1
        want = loaded[key].view(torch.int16).numpy().view(np.uint16) if entry.dtype == "bfloat16" \
            else loaded[key].numpy()
        assert whole.tobytes() == np.ascontiguousarray(want).tobytes(), key  # bit for bit, NaN included
    return count


