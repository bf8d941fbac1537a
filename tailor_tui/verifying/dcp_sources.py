"""Whole tensors of a PyTorch Distributed Checkpoint, as the verifier reads them where it casts a parameter's fp32
master into a model file's dtype (`weights`), none of the writers' code used (`DcpTensors`): each chunk's archive
read whole where the checkpoint's metadata places it, its records' CRC-32s checked by Python's `zipfile`, its
tensor loaded by torch (`weights_only`) and put into its place in the whole tensor. Which source's rank files are a
DCP checkpoint's (`is_dcp_rank`). Rows taken from one format into the other are compared as bytes (`resharded`,
`dcp_output`).
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.errors import CheckpointError

DCP_KIND = "PyTorch Distributed Checkpoint"  # what such a source's rank files say they are (`RankFiles.kind`)
MASTERS = "fp32"
MAX_CHUNK = 1 << 34  # bytes of one chunk's archive read at once, at most


def is_dcp_rank(files) -> bool:
    """Whether a source's rank files are a DCP checkpoint's (read as one rank of ZeRO-3)."""
    return getattr(files, "kind", None) == DCP_KIND


class DcpTensors:
    """Whole tensors of DCP checkpoints, each read once (flattened)."""

    def __init__(self):
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
