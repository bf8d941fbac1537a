"""A partial (selective) base's optim file, built from its skeleton and the rows' slices, torch-free.

A partial checkpoint has no optim file of its own: `selective` saved the optimizer state
without its big tensors (the skeleton) and each rank's slices of the saved rows. The compose step
writes the full file a resume needs: the skeleton's structure with every flat tensor's space
reserved, then every slice copied into place from the checkpoints the plan names.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections import Counter, defaultdict
from pathlib import Path

from tailor_tui.checked.evidence import crc_range_checked, read_and_check
from tailor_tui.checked.ranges import READ_CHUNK, RegionCrcs
from tailor_tui.compose.taken import Looks, Parts
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter
from tailor_tui.fileio import Target, Writeback, copy_range, fsync, open_fd, output_error, path_of, pwrite_all
from tailor_tui.formats.ds_format import (
    FP32_FLAT_GROUPS,
    OPTIMIZER_STATE_DICT,
    STATE,
    flat_tensor,
    set_flat_tensor,
)
from tailor_tui.formats.nonfinite import Census, Region
from tailor_tui.formats.pickled import TensorRef, dtype_name
from tailor_tui.formats.ptwrite import Rewritable, reserved, write
from tailor_tui.kinds.base import FP32, check_dtypes, rank_reader
from tailor_tui.kinds.zero import ZeroRankFiles, ZeroRankReader
from tailor_tui.planning.jobs import RankJob


def build_optim_states_from_skeleton(job: RankJob, out: Target, counter: ByteCounter) -> tuple[Counter, Parts]:
    """Write a partial base's optim file: its skeleton (everything but the flat tensors) as
    the archive, every slice copied into place in the kernel.

    torch writes the archive with every tensor's space reserved and not written
    (`torch.serialization.skip_data`), so the file has torch's own layout; then every row's
    slices are copied in from the checkpoints the plan names, padding is zeroed, the small
    tensors (per-group steps) are written, and each record's CRC-32 is set from the bytes
    written, read back once, which also checks each slice from a rows file against its recorded
    CRC-32. The flat tensors are `torch.empty`: never touched, they occupy no memory.
    Memory: the skeleton and one small buffer, whatever the file size. Returns the non-finite
    values of each row, counted as the written records are read back for their CRC-32, and the
    CRC-32 of each part of a row (`compose.taken`), taken in the same reads.
    """
    base = job.files[0]
    skeleton = Rewritable(base.structure_file)  # (`optim_writer`: a base keeping its state in slices)
    inner = _skeleton_state(skeleton.obj, skeleton.path, job.group_sizes)
    fills = dict(skeleton.fills)
    rank_reader(base, job.group_sizes).check_keys(job.keys)  # (its rows file: the keys the skeleton's state has)
    for g, size in enumerate(job.group_sizes):
        for key in job.keys:
            like = flat_tensor(inner, g, key)
            if not isinstance(like, TensorRef) or dtype_name(like.storage.type_name) != "float32":
                raise CheckpointError(f"{skeleton.path}: sub-group {g}'s {key} is not an fp32 tensor; the partial "
                                      "checkpoint is corrupt or from another run")
            set_flat_tensor(inner, g, key, reserved(size, like, fills))
    write(skeleton.obj, fills, out)
    layout = ZeroRankReader(ZeroRankFiles(base.rank, base.model_states, path_of(out)), job.group_sizes).flat()
    del skeleton, inner
    big = [tb.record for tb in layout.values()]

    checks = defaultdict(list)  # record -> the partial slices copied into it, checked as it is read back
    try:
        with contextlib.ExitStack() as stack:
            fout = open_fd(stack, out, os.O_RDWR)
            used = {c.source for c in job.copies}
            readers = {s: rank_reader(job.files[s], job.group_sizes) for s in used}
            for reader in readers.values():
                reader.check_keys(job.keys)
            fds = {s: open_fd(stack, readers[s].path) for s in used}
            buffer = memoryview(bytearray(READ_CHUNK))
            for s, reader in readers.items():
                theirs = reader.whole_flat()  # (the skeleton's flat tensors are fp32)
                if theirs is None:  # a partial's slices: checked as read back
                    continue
                check_dtypes({k: FP32 for k in theirs}, theirs, reader.path)
                taken = {(theirs[c.group, key].record, theirs[c.group, key].offset + c.offset * 4, c.length * 4)
                         for c in job.copies if c.source == s for key in job.keys}
                read_and_check(fds[s], reader.path, {r for r, _, _ in taken}, taken, buffer, counter=counter)
            writeback = Writeback(fout, counter.options.durable)
            for c in job.copies:
                for key in job.keys:
                    into = layout[c.group, key].offset + c.offset * 4
                    place = readers[c.source].place(key, param=c.param, group=c.group, offset=c.offset,
                                                    valid=c.length)
                    if place.slice is not None:  # checked as the output is read back
                        checks[layout[c.group, key].record].append((into, place.slice))
                    copy_range(fds[c.source], fout, place.at, c.length * 4, on_bytes=counter.add, out_offset=into,
                               writeback=writeback)
            for g, offset, length in job.padding:
                for key in job.keys:
                    pwrite_all(fout, bytes(length * 4), layout[g, key].offset + offset * 4)
            places = [(layout[slot.group, key].offset + slot.offset * 4, slot, key)
                      for slot in job.row_slots for key in job.keys]
            census = Looks(Census(Region(at, slot.valid * 4, slot.row) for at, slot, _key in places),
                           RegionCrcs((at, slot.valid * 4, (slot.row, key, (slot.group, slot.offset)))
                                      for at, slot, key in places))
            for record in big:  # the small records' CRCs were set as they were written
                value = crc_range_checked(fout, record.data_offset, record.size, checks[record], buffer,
                                          inspect=census.inspect)
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", value), at)
            fsync(fout, counter.options.durable)
    except OSError as exc:
        raise output_error(exc, out) from None
    return census.counts, census.parts.found()


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
