"""The health of a run of PyTorch Distributed Checkpoints (an FSDP2 run's `step-N` saves): each row's cell in each
checkpoint, as a ZeRO-3 run's (`healing.Cell`: NaN/Inf, fp32 weight RMS, v max, Δ since the previous checkpoint).

Each chunk of a row's tensors is read once in 1 MiB pieces from where its archive's record lies
(`dcp.reading.locate_chunk`), its CRC-32 computed on the way and compared with the one the archive stores (a
mismatch marks the cell ✗, never counted as data); its NaN/Inf counted (`formats.nonfinite`), a trainable
parameter's weights summed (RMS) and compared with the same chunk of the previous checkpoint, read alongside
(Δ; None where the two saved the tensor in other chunks), and `exp_avg_sq`'s largest value kept (v max).
Memory: two 1 MiB pieces, whatever the sizes. A checkpoint's cells are cached (`cache`), keyed by the identity of
every file read for them, its own and the previous checkpoint's (device, inode, size, mtime, ctime as it was
opened): a file saved again is read again. Torch-free (numpy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from tailor_tui.checked.files import open_regular
from tailor_tui.checkpoints.cache import entry, read_json, write_json
from tailor_tui.checkpoints.dcp_checkpoint import MODEL, DcpCheckpoint
from tailor_tui.dcp.metadata import MetadataIndex, TensorStorageMetadata
from tailor_tui.dcp.reading import ChunkBytes, locate_chunk
from tailor_tui.errors import Cancelled, CheckpointError
from tailor_tui.events import Emit, TaskFinished, TaskProgressed
from tailor_tui.formats import nonfinite
from tailor_tui.formats.ds_format import EXP_AVG_SQ
from tailor_tui.health.healing import Cell, Health, rms, training_log
from tailor_tui.health.stats_job import RowSums
from tailor_tui.health.stats_run import CellsComputed, StatsPlanned

PIECE = 1 << 20
_NUMPY = {"float32": "<f4", "float16": "<f2"}


def dcp_health(checkpoints: Sequence[DcpCheckpoint], *, emit: Emit = lambda e: None,
               cancelled: Callable[[], bool] = lambda: False, cache: Path | None = None) -> Health:
    """Every row's cell in every checkpoint of a DCP run (oldest first); `cache`: where cells are cached (None:
    nowhere)."""
    # the loss logged at each save, where a log lies beside it (the HF Trainer's trainer_state.json)
    logs = {i: training_log(c) for i, c in enumerate(checkpoints) if c.step is not None}  # type: ignore[arg-type]
    health = Health(tuple(checkpoints), logs=logs)  # type: ignore[arg-type]  # (a DCP checkpoint is described alike)
    keys = [_cells_key(c, checkpoints[i - 1] if i else None) for i, c in enumerate(checkpoints)]
    known = {i: found for i, key in enumerate(keys) if (found := _cached(cache, key)) is not None
             and found.keys() == {row.name for row in checkpoints[i].rows if not row.tied}}
    sizes = [sum(info.length for info in c.metadata.storage_data.values()) for c in checkpoints]
    files = [len(c.distcp_files()) for c in checkpoints]
    emit(StatsPlanned(len(checkpoints), sum(files), sum(files[i] for i in known),
                      sum(n for i, n in enumerate(sizes) if i not in known), ".distcp file(s)"))
    for i, ckpt in enumerate(checkpoints):
        if i in known:
            health.add(i, known[i])
            emit(CellsComputed(i, ckpt.name, known[i]))
            continue
        task = f"statistics of {ckpt.name}"
        done = [0]

        def read(n: int, task: str = task, done: list[int] = done) -> None:
            done[0] += n
            if cancelled():
                raise Cancelled("statistics cancelled")
            emit(TaskProgressed(task, done[0], max(done[0], 1)))

        with _OpenedFiles(ckpt) as mine, _OpenedFiles(checkpoints[i - 1]) if i else contextlib.nullcontext() as theirs:
            cells = {row.name: _cell(ckpt, row, mine, theirs, read) for row in ckpt.rows if not row.tied}
        health.add(i, cells)
        if all(cell.error is None for cell in cells.values()):  # (a file that could not be read: read again)
            write_json(entry(cache, "dcp_cells", keys[i]), {"format": FORMAT, "key": keys[i],
                                                           "cells": {r: c.to_json() for r, c in cells.items()}})
        emit(TaskFinished(task, done[0]))
        emit(CellsComputed(i, ckpt.name, cells))
    return health


FORMAT = 1  # of the cached cells: a change to what a cell holds or how it is computed counts it up
MAX_CACHED = 16 << 20  # bytes of a cache entry, at most


def _cells_key(ckpt: DcpCheckpoint, previous: DcpCheckpoint | None) -> str:
    """What a checkpoint's cells are cached by: the identity of every file of it, and of the previous checkpoint
    (its weights give the cells' Δ), as they were opened."""
    def files(c: DcpCheckpoint) -> list:
        return sorted([str(path.resolve()), *identity] for path, identity in c.identities.items())

    text = json.dumps([FORMAT, files(ckpt), files(previous) if previous is not None else None])
    return hashlib.sha256(text.encode()).hexdigest()


def _cached(cache: Path | None, key: str) -> dict[str, Cell] | None:
    data = read_json(entry(cache, "dcp_cells", key), MAX_CACHED)
    try:
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        return {row: Cell.from_json(value) for row, value in data["cells"].items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # not cached, or not ours: read again


class _OpenedFiles(contextlib.ExitStack):
    """A checkpoint's files, each opened once (a regular file, not a link) for the chunks read from it."""

    def __init__(self, ckpt: DcpCheckpoint):
        super().__init__()
        self.ckpt = ckpt
        self.fds: dict[str, int] = {}

    def chunk(self, key: str, offsets) -> tuple[int, ChunkBytes] | None:
        entry = self.ckpt.metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            return None
        chunk = next((c for c in entry.chunks if c.offsets == offsets), None)
        if chunk is None:
            return None
        info = self.ckpt.metadata.storage_data[MetadataIndex(key, offsets)]
        if info.relative_path not in self.fds:
            fd = open_regular(self.ckpt.path / info.relative_path, follow=False)
            self.callback(os.close, fd)
            self.fds[info.relative_path] = fd
        fd = self.fds[info.relative_path]
        return fd, locate_chunk(self.ckpt.path, fd, entry, chunk, info)


def _cell(ckpt: DcpCheckpoint, row, mine: _OpenedFiles, theirs: _OpenedFiles | None, read: Callable[[int], None]) -> Cell:
    sums, crc_ok = RowSums(), True
    entries = ckpt.metadata.state_dict_metadata
    try:
        for name in row.params:
            entry = entries.get(MODEL + name)
            if not isinstance(entry, TensorStorageMetadata):
                continue
            trainable = name in ckpt.trainable
            for chunk in entry.chunks:
                here = mine.chunk(MODEL + name, chunk.offsets)
                there = theirs.chunk(MODEL + name, chunk.offsets) if theirs is not None and trainable else None
                assert here is not None, "a chunk the metadata lists"
                crc_ok &= _weights(here, there, sums, trainable, read)
            for key in (k for k in entries if k.startswith(f"{ckpt.optim}state.{name}.")):
                state = entries[key]
                if not isinstance(state, TensorStorageMetadata) or not state.size:
                    continue  # a step count
                for chunk in state.chunks:
                    found = mine.chunk(key, chunk.offsets)
                    assert found is not None, "a chunk the metadata lists"
                    crc_ok &= _state(found, sums, key.endswith("." + EXP_AVG_SQ), read)
    except (CheckpointError, OSError) as exc:
        return Cell(0, None, None, None, False, str(exc).splitlines()[0][:300])
    healthy = sums.nonfinite == 0
    rel = math.sqrt(sums.diff_sq) / math.sqrt(sums.prev_sq) if (
        healthy and sums.has_prev and sums.prev_nonfinite == 0 and sums.prev_sq > 0) else None
    return Cell(sums.nonfinite, rms(sums.sumsq, sums.count) if healthy else None, sums.v_max if healthy else None,
                rel, crc_ok)


def _pieces(fd: int, found: ChunkBytes):
    """(bytes, element offset) of a chunk's data, 1 MiB at a time."""
    record, step = found.record, PIECE - PIECE % 8
    for at in range(0, record.size, step):
        yield os.pread(fd, min(step, record.size - at), record.data_offset + at), at


def _values(data: bytes, dtype: str):
    """The values of `data` (little-endian `dtype`), as float64."""
    import numpy as np

    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(data, dtype=_NUMPY[dtype]).astype(np.float64)


def _weights(here: tuple[int, ChunkBytes], there: tuple[int, ChunkBytes] | None, sums: RowSums, trainable: bool,
             read: Callable[[int], None]) -> bool:
    """Add a weight chunk to the row's sums (and its change since `there`, the same chunk of the previous
    checkpoint); whether every CRC-32 held."""
    import numpy as np

    fd, found = here
    crc, prev_crc = 0, 0
    same = there is not None and there[1].record.size == found.record.size and there[1].dtype == found.dtype
    for data, at in _pieces(fd, found):
        crc = zlib.crc32(data, crc)
        read(len(data))
        bad = nonfinite.count(data, found.dtype) if found.dtype in nonfinite.EXPONENT else 0
        sums.nonfinite += bad
        if not trainable or found.dtype not in (*_NUMPY, "bfloat16"):
            continue
        x = _values(data, found.dtype)
        finite = np.isfinite(x)
        sums.count += int(x.size)
        sums.sumsq += float(np.square(x[finite]).sum())
        if same and there is not None:
            prev = os.pread(there[0], len(data), there[1].record.data_offset + at)
            prev_crc = zlib.crc32(prev, prev_crc)
            y = _values(prev, found.dtype)
            both = finite & np.isfinite(y)
            sums.has_prev = True
            sums.diff_sq += float(np.square(x[both] - y[both]).sum())
            sums.prev_sq += float(np.square(y[both]).sum())
            sums.prev_nonfinite += int(y.size - np.isfinite(y).sum())
    ok = crc == found.record.crc
    return ok and (not same or there is None or prev_crc == there[1].record.crc)


def _state(here: tuple[int, ChunkBytes], sums: RowSums, second_moment: bool, read: Callable[[int], None]) -> bool:
    """Add an optimizer state chunk to the row's sums (NaN/Inf; v max of exp_avg_sq); whether its CRC-32 held."""
    import numpy as np

    fd, found = here
    crc = 0
    for data, _at in _pieces(fd, found):
        crc = zlib.crc32(data, crc)
        read(len(data))
        if found.dtype in nonfinite.EXPONENT:
            sums.nonfinite += nonfinite.count(data, found.dtype)
        if second_moment and found.dtype in (*_NUMPY, "bfloat16"):
            x = _values(data, found.dtype)
            finite = x[np.isfinite(x)]
            if finite.size:
                top = float(finite.max())
                sums.v_max = top if sums.v_max is None else max(sums.v_max, top)
    return crc == found.record.crc
