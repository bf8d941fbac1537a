"""The writers of a rank's files that need torch: a partial base's optim file (built from its
skeleton), the re-serialising fallback (a legacy-format base, an archive the streaming
writer does not handle), and model_states whose frozen fragments or buffers follow rows.

Importing this module imports torch; `rank_task` does so only for jobs that need it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

import torch

from .ds_format import (
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    STATE,
    TENSORS,
    flat_tensor,
    optimizer_state,
    set_flat_tensor,
)
from . import crc
from .errors import CheckpointError, OutputError
from .events import ByteCounter
from .fileio import (
    CountingWriter,
    Writeback,
    copy_range,
    crc_range,
    fsync,
    open_fd,
    output_error,
    pwrite_all,
)
from .model_files import partial_slice, safetensors_tensors
from .nonfinite import Census, Region
from .plan import RankJob
from .ptfile import Unsupported, read_structure
from .rank_stream import (
    STREAM_CHUNK,
    check_dtypes,
    dtype_mismatch,
    flat_tensor_bytes,
    read_and_check,
    tensor_bytes,
)
from .safe_load import load_pt


def save_pt(obj, path: Path, on_bytes: Callable[[int], None] | None, durable: bool = True) -> None:
    """torch.save to `path`, durably; `on_bytes` counts the bytes (None: a plain seekable
    file, which torch.serialization.skip_data needs)."""
    writer = None
    try:
        with open(path, "wb") as f:
            writer = CountingWriter(f, on_bytes) if on_bytes is not None else None
            torch.save(obj, writer or f)
            f.flush()
            fsync(f.fileno(), durable)
    except OSError as exc:
        raise output_error(writer.error if writer and writer.error else exc, path) from None
    except RuntimeError:
        if writer is not None and writer.error is not None:
            raise output_error(writer.error, path) from None
        raise


def build_optim_states_from_skeleton(job: RankJob, out: Path, counter: ByteCounter) -> Counter:
    """Write a partial base's optim file: its skeleton (everything but the flat tensors) as
    the archive, every slice copied into place in the kernel.

    torch writes the archive with every tensor's space reserved and not written
    (`torch.serialization.skip_data`), so the file has torch's own layout; then every row's
    slices are copied in from the checkpoints the plan names, padding is zeroed, the small
    tensors (per-group steps) are written, and each record's CRC-32 is set from the bytes
    written. The flat tensors are `torch.empty`: never touched, they occupy no memory.
    Memory: the skeleton and one small buffer, whatever the file size. Returns the non-finite
    values of each row, counted as the written records are read back for their CRC-32.
    """
    skeleton = load_pt(job.files[0].skeleton)
    inner = _skeleton_state(skeleton, job.files[0].skeleton, job.group_sizes)
    reserved = set()  # storages whose bytes come from the sources
    for g, size in enumerate(job.group_sizes):
        for key in TENSORS:
            flat = torch.empty(size, dtype=torch.float32).requires_grad_(flat_tensor(inner, g, key).requires_grad)
            reserved.add(flat.untyped_storage()._cdata)
            set_flat_tensor(inner, g, key, flat)
    obj, records, prefix = save_reserving(skeleton, out, reserved)
    layout = flat_tensor_bytes(obj, records, prefix, out, job.group_sizes)
    del skeleton, inner
    big = [tb.record for tb in layout.values()]

    partial = {s: safetensors_tensors(job.files[s].rows) for s in {c.source for c in job.copies}
               if job.files[s].rows is not None}
    try:
        with contextlib.ExitStack() as stack:
            fout = open_fd(stack, out, os.O_RDWR)
            fds = {s: open_fd(stack, job.files[s].rows or job.files[s].optim_states)
                   for s in {c.source for c in job.copies}}
            full = {s: tensor_bytes(job.files[s].optim_states, job.group_sizes)
                    for s in fds if job.files[s].rows is None}
            buffer = memoryview(bytearray(STREAM_CHUNK))
            for s, theirs in full.items():  # the skeleton's flat tensors are fp32
                check_dtypes({k: ("FloatStorage", 4) for k in theirs}, theirs, job.files[s].optim_states)
                taken = {(theirs[c.group, key].record, theirs[c.group, key].offset + c.offset * 4, c.length * 4)
                         for c in job.copies if c.source == s for key in TENSORS}
                read_and_check(fds[s], job.files[s].optim_states, {r for r, _, _ in taken}, taken, buffer, counter)
            writeback = Writeback(fout, counter.options.durable)
            for c in job.copies:
                for key in TENSORS:
                    if c.param is None:
                        at = full[c.source][c.group, key].offset + c.offset * 4
                    else:
                        at = partial_slice(job.files[c.source].rows, partial[c.source], key, c.param, c.length)[2]
                    copy_range(fds[c.source], fout, at, c.length * 4, counter.add,
                               layout[c.group, key].offset + c.offset * 4, writeback)
            for g, offset, length in job.padding:
                for key in TENSORS:
                    pwrite_all(fout, bytes(length * 4), layout[g, key].offset + offset * 4)
            census = Census(Region(layout[slot.group, key].offset + slot.offset * 4, slot.valid * 4, slot.row)
                            for slot in job.row_slots for key in TENSORS)
            for record in big:  # the small records' CRCs were set as they were written
                value = crc_range(fout, record.data_offset, record.size, buffer, inspect=census.inspect)
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", value), at)
            fsync(fout, counter.options.durable)
    except OSError as exc:
        raise output_error(exc, out) from None
    return census.counts


def save_reserving(obj, out: Path, reserved: set[int]) -> tuple:
    """torch.save `obj` to `out` with the space of the storages in `reserved` (their `_cdata`)
    reserved, not written (`torch.serialization.skip_data`: a sparse file, whatever their size);
    every other storage's bytes are written and its record's CRC-32 set. The reserved records
    are the caller's to fill and to give their CRC-32. Saved by path, as DeepSpeed saves, so the
    archive's records are named after the file. Not fsynced: the caller fsyncs once it is
    filled. Returns `read_structure(out)`."""
    try:
        with torch.serialization.skip_data():
            storages = _storages_in_save_order(obj)
            torch.save(obj, str(out))
        structure = read_structure(out)
    except OSError as exc:
        raise output_error(exc, out) from None
    except Unsupported as exc:
        raise OutputError(f"{out}: torch wrote an archive this tailor-tui cannot fill ({exc}); "
                          "please report it with your torch version") from None
    _obj, records, prefix = structure
    try:
        with contextlib.ExitStack() as stack:
            fd = open_fd(stack, out, os.O_RDWR)
            for key, storage in enumerate(storages):
                if storage._cdata in reserved:
                    continue
                record, data = records[f"{prefix}data/{key}"], _storage_bytes(storage)
                pwrite_all(fd, data, record.data_offset)
                for at in record.crc_offsets:
                    os.pwrite(fd, struct.pack("<I", crc.crc32(data)), at)
    except OSError as exc:
        raise output_error(exc, out) from None
    return structure


def _storages_in_save_order(obj) -> list:
    """The storages torch.save writes for `obj`, in the order of their record keys (0, 1, …):
    torch numbers storages as its pickler first meets them, and this pickler meets them alike."""
    order, seen = [], set()

    class Walker(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    order.append(storage)
                return ("storage", len(order))
            return None

    Walker(io.BytesIO(), protocol=2).dump(obj)
    return order


def _storage_bytes(storage) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def reserialise_optim_states(job: RankJob, out: Path, counter: ByteCounter) -> Counter:
    """Load (memory-mapped), build whole flat tensors, torch.save: the fallback for base
    archives the streaming path does not handle. Memory: the composed rank file. Returns
    the non-finite values of each row, counted in memory."""
    nonfinite = Counter()
    base_files = job.files[0]
    base = load_pt(base_files.optim_states)
    inner = optimizer_state(base, base_files.optim_states, job.group_sizes)
    full = {
        s: optimizer_state(load_pt(f.optim_states), f.optim_states, job.group_sizes)
        for s, f in job.files.items()
        if s and f.rows is None and any(c.source == s for c in job.copies)
    }
    partial = {s: f.rows for s, f in job.files.items() if f.rows is not None}
    indexes = {s: safetensors_tensors(p) for s, p in partial.items()}
    copies, padding = defaultdict(list), defaultdict(list)
    for c in job.copies:
        copies[c.group].append(c)
    for g, offset, length in job.padding:
        padding[g].append((offset, length))

    from safetensors import safe_open

    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {s: stack.enter_context(safe_open(str(p), framework="pt")) for s, p in partial.items()}
        for g, size in enumerate(job.group_sizes):
            for key in TENSORS:
                original = flat_tensor(inner, g, key)
                merged = original.detach().clone()
                counter.add(size * 4)
                for c in copies[g]:
                    span = slice(c.offset, c.offset + c.length)
                    if c.param is None:
                        theirs = flat_tensor(full[c.source], g, key)
                        if theirs.dtype != original.dtype:  # copy_ would cast silently
                            raise dtype_mismatch(job.files[c.source].optim_states, key, g,
                                                  str(theirs.dtype), str(original.dtype))
                        merged[span].copy_(theirs[span])
                    else:
                        partial_slice(partial[c.source], indexes[c.source], key, c.param, c.length)
                        merged[span].copy_(opened[c.source].get_slice(f"{key}/{c.param}")[: c.length])
                    counter.add(c.length * 4)
                for offset, length in padding[g]:
                    merged[offset : offset + length].zero_()  # padding holds garbage: write zeros
                merged.requires_grad_(original.requires_grad)
                set_flat_tensor(inner, g, key, merged)
                for slot in job.row_slots:
                    if slot.group == g:
                        nonfinite[slot.row] += _count(merged[slot.offset: slot.offset + slot.valid])
    del full
    save_pt(base, out, counter.add, counter.options.durable)
    return +nonfinite


def _count(t) -> int:
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


def _skeleton_state(obj, path: Path, group_sizes: tuple[int, ...]) -> dict:
    """The inner optimizer dict of a partial checkpoint's skeleton (big tensors left empty)."""
    try:
        inner = obj[OPTIMIZER_STATE_DICT]
        flat, state = inner[FP32_FLAT_GROUPS], inner[OPTIMIZER_STATE_DICT][STATE]
        if len(flat) != len(group_sizes) or any(g not in state for g in range(len(group_sizes))):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"{path}: not a partial-checkpoint optimizer skeleton for {len(group_sizes)} sub-groups; "
            "the partial checkpoint is corrupt or from another run"
        ) from None
    return inner


def merge_model_states(job: RankJob, out: Path, counter: ByteCounter) -> Counter:
    """The base's model_states with frozen fragments and buffers of picked rows replaced;
    the non-finite values of each row's frozen fragments in it."""
    states = load_pt(job.files[0].model_states)
    loaded: dict[int, dict] = {}

    def source(s: int) -> dict:
        if s not in loaded:
            loaded[s] = load_pt(job.files[s].model_states)
        return loaded[s]

    for name, s in job.frozen:
        theirs = source(s)[FROZEN_PARAM_FRAGMENTS][name]
        mine = states[FROZEN_PARAM_FRAGMENTS][name]
        if theirs.shape != mine.shape:
            raise CheckpointError(
                f"{job.files[s].model_states}: frozen fragment {name} has shape {list(theirs.shape)}, "
                f"the base {list(mine.shape)}; the checkpoints are from different layouts"
            )
        states[FROZEN_PARAM_FRAGMENTS][name] = theirs.clone()
    for name, s in job.buffers:
        states[MODULE][name] = source(s)[MODULE][name].clone()
    save_pt(states, out, counter.add, counter.options.durable)
    nonfinite = Counter()
    for row, name, _source in job.frozen_rows:
        nonfinite[row] += _count(states[FROZEN_PARAM_FRAGMENTS][name])
    return +nonfinite


