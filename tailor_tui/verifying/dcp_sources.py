"""A PyTorch Distributed Checkpoint's tensors as the verifier reads them, none of the writers' code used: which
source's rank files are a DCP checkpoint's (`is_dcp_rank`), where a chunk's elements lie in its archive
(`claimed_chunk`: its record's CRC-32 the evidence) and which of the tensor's elements it holds (`chunk_range`).
Rows taken from one format into the other (`resharded`, `dcp_output`) and the fp32 masters a model file's tensors
are cast from (`weights`) are claimed on those bytes. A model file's tensor that is neither its master nor its master
cast to 16 bits is compared whole (`DcpTensors`: each chunk's archive read where the metadata places it, its
records' CRC-32s checked by Python's `zipfile`, its tensor loaded by torch, `weights_only`).
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from pathlib import Path

from tailor_tui.checked.files import open_regular
from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.dcp.reading import locate_chunk
from tailor_tui.errors import CheckpointError
from tailor_tui.verifying import streamed

DCP_KIND = "PyTorch Distributed Checkpoint"  # what such a source's rank files say they are (`RankFiles.kind`)
MASTERS = "fp32"
MAX_CHUNK = 1 << 34  # bytes of one chunk's archive read at once, at most (`DcpTensors`)


def is_dcp_rank(files) -> bool:
    """Whether a source's rank files are a DCP checkpoint's (read as one rank of ZeRO-3)."""
    return getattr(files, "kind", None) == DCP_KIND


def claimed_chunk(claims: streamed.Comparison, folder: Path, entry, chunk, info, *, label: str | None = None):
    """(file, `dcp.reading.ChunkBytes`) of a DCP chunk's elements as its archive places them (`info` in `folder`),
    its record's CRC-32 evidence among `claims`."""
    path = folder / info.relative_path
    fd = open_regular(path)
    try:
        located = locate_chunk(folder, fd, entry, chunk, info)
    finally:
        os.close(fd)
    f = claims.file(path, label=label)
    claims.evidence(f, located.record.data_offset, located.record.size, located.record.crc, located.record.name)
    return f, located


def chunk_range(size: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], folder: Path,
                name: str) -> tuple[int, int]:
    """(first element, elements) of a chunk of a row-major tensor of `size`, a range of consecutive elements (as
    FSDP2's row shards and tailor-tui's own chunks are); CheckpointError for one that is not."""
    inner = 0  # the dimensions after which the chunk holds whole rows
    for d in range(len(size) - 1, -1, -1):
        if (offsets[d], sizes[d]) != (0, size[d]):
            inner = d
            break
    if any(n != 1 for n in sizes[:inner]):
        raise CheckpointError(f"{folder}: the chunk of {name} at {list(offsets)} is no range of its elements; "
                              "tailor-tui verifies rows taken from chunks that are")
    first, stride = 0, 1
    for d in range(len(size) - 1, -1, -1):
        first += offsets[d] * stride
        stride *= size[d]
    return first, math.prod(sizes)


class DcpTensors:
    """Whole tensors of DCP checkpoints, each read once (flattened)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[Path, str], object] = {}

    def flat(self, files, key: str, param: str):
        """Flat tensor `key` (the masters, or a state kept per element) of parameter `param` of the DCP checkpoint
        `files` (its rank files: `folder`, `metadata`, `optim`)."""
        name = f"model.{param}" if key == MASTERS else f"{files.optim}state.{param}.{key}"
        return self.tensor(files, name)

    def tensor(self, files, name: str):
        import torch

        if (files.folder, name) in self.kept:
            return self.kept[files.folder, name]
        entry = files.metadata.state_dict_metadata.get(name)
        if entry is None or not hasattr(entry, "chunks"):
            raise CheckpointError(f"{files.folder}: has no tensor {name}")
        whole = torch.empty(tuple(entry.size), dtype=getattr(torch, entry.dtype))
        for chunk in entry.chunks:
            info = files.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
            part = _chunk(files.folder / info.relative_path, info.offset, info.length, name)
            if tuple(part.shape) != tuple(chunk.sizes) or part.dtype != whole.dtype:
                raise CheckpointError(f"{files.folder / info.relative_path}: the chunk of {name} at "
                                      f"{list(chunk.offsets)} holds {list(part.shape)} {part.dtype}, not its "
                                      f"{list(chunk.sizes)}")
            whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
        self.kept[files.folder, name] = flat = whole.reshape(-1)
        return flat


def _chunk(path: Path, offset: int, length: int, name: str):
    import torch

    if length > MAX_CHUNK:
        raise CheckpointError(f"{path}: the chunk of {name} is {length:,} bytes, more than the verifier reads at once")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise CheckpointError(f"{path}: ends before the chunk of {name} does")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
        if bad is not None:
            raise CheckpointError(f"{path}: the chunk of {name} fails its CRC-32 check ({bad})")
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (zipfile.BadZipFile, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path}: the chunk of {name} is not a torch archive ({exc})") from None
