"""One rank's health statistics: every byte of its optimizer state read once, in chunks.

For each row a checkpoint holds, a rank contributes sums over the valid (non-padding)
elements of its slices: non-finite counts of the fp32 masters, exp_avg and exp_avg_sq
(and of frozen parameters' fragments), the sum of squares of the masters, the largest
exp_avg_sq, and against the row's previous checkpoint the squared distance of the masters.
`stats_run` adds the ranks up. The same pass checks every record's CRC-32, as the compose step
does: a record that fails marks the rows with slices in it.

Memory: two 1 MiB read buffers and the float64 copies of one chunk, whatever the file
size. Torch-free (numpy does the arithmetic): workers start in a fraction of a second.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from tailor_tui.checked.crc import BlockCrcs, RecordBlocks, crc32
from tailor_tui.checked.ranges import Readahead, pread_into
from tailor_tui.checkpoints.checkpoint import RankFiles
from tailor_tui.errors import Cancelled, CheckpointError, IncompatibleError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import open_fd
from tailor_tui.formats.ds_format import MASTERS
from tailor_tui.formats.nonfinite import EXPONENT, count
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import Record, Unsupported
from tailor_tui.health.stats_flat import (
    FROZEN,
    METRIC,
    PURPOSE,
    STATE,
    can_read_flat,
    flat_stats,
    per_slice,
    prefetch,
    role,
)
from tailor_tui.health.stats_job import RankStats, RankStatsRead, RowSums, SlotRead, StatsJob
from tailor_tui.kinds.base import rank_reader

CHUNK = 1 << 20


@dataclass
class _SumRegion:
    """A byte range of a file whose elements feed one row's sums."""

    start: int
    end: int
    kind: str  # MASTERS, METRIC (the state `v max` is of), STATE (another state kept per element), or FROZEN
    dtype: str
    sums: RowSums
    prev_at: int | None = None  # where the previous checkpoint's elements lie in `prev_fd`
    prev_fd: int | None = None


def rank_stats(job: StatsJob, emit: Emit, cancelled, options: TaskOptions = TaskOptions()) -> RankStats:
    """The sums of every row `job` reads (run in a worker: see `workers.run_calls`)."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    sums = {row: RowSums() for row, _ in job.frozen}
    blocks: dict[str, RecordBlocks] = {}  # of the optim file's records that passed their CRC-32 check
    try:
        with contextlib.ExitStack() as stack:
            ahead: dict[int, Readahead] = {}  # per file: the disk reads ahead while numpy computes
            if can_read_flat(job) and flat_stats(job, sums, stack, counter, ahead, blocks=blocks):
                reads = _frozen_reads(job, sums, stack) if job.frozen else []
            else:
                slots = job.slots()
                sums |= {slot.row: RowSums() for slot in slots}
                reads = _reads(job, slots, sums, stack)
            size = min(CHUNK, max((length for _fd, _start, length, _crc, _regions, _r in reads), default=0))
            buffers = memoryview(bytearray(size)), memoryview(bytearray(size))  # a small rank's: small
            for fd, start, length, expected, regions, record in reads:
                recorder = BlockCrcs(job.crc_block) if record is not None and expected is not None else None
                if not _read(fd, start, length, expected, regions, buffers, counter, ahead, recorder):
                    for region in regions:
                        region.sums.crc_ok = False
                elif recorder is not None:
                    blocks[record.name] = RecordBlocks.of(record, recorder)
    except Cancelled:
        raise
    except (CheckpointError, IncompatibleError, Unsupported, OSError) as exc:  # (another optimizer's state: its cells')
        found = RankStats(error=str(exc) if isinstance(exc, (CheckpointError, IncompatibleError))
                          else f"rank {job.rank}: {exc}")
    else:
        found = RankStats(sums, blocks=blocks)
    emit(RankStatsRead(job.key, found))
    counter.finish()
    return found


def _reads(job: StatsJob, slots: tuple[SlotRead, ...], sums: dict[str, RowSums], stack: contextlib.ExitStack) -> list:
    """[(fd, first byte, length, stored CRC-32 or None, regions, the optim file's record or None)] in
    file order per file: a full checkpoint's optim file is read record by record, whole (its records'
    block CRC-32s are recorded: `crc.BlockCrcs`)."""
    prev_at = {}
    by_file: dict = {}  # each previous checkpoint's file, read once for all the rows it holds
    for row, files in job.prev:
        by_file.setdefault(files.state_file, (files, set()))[1].add(row)
    for path, (files, rows) in by_file.items():
        fd = open_fd(stack, path)
        where = _fp32_places(files, job.group_sizes, [s for s in slots if s.row in rows])
        prev_at.update({(s.row, s.param): (fd, where[s.param]) for s in slots if s.row in rows})
    reads = []
    reader = rank_reader(job.files, job.group_sizes)
    fd = open_fd(stack, reader.path)
    flat, keys = reader.fp32_whole_flat(PURPOSE), reader.keys()
    if flat is None:  # its slices kept apart (a partial save's), each checked against its recorded CRC-32
        for slot in slots:
            for key in keys:
                place = reader.place(key, param=slot.param, group=slot.group, offset=slot.offset, valid=slot.valid)
                assert place.slice is not None, "a partial save's place names its slice"
                reads.append((fd, place.at, slot.valid * 4, place.slice.crc,
                              [_region(slot, role(key, keys), place.at, "float32", sums, prev_at)], None))
    else:  # whole records (a full save's optim file), each read whole for its stored CRC-32
        by_record: dict = {}
        for g in range(len(job.group_sizes)):
            for key in keys:
                tb = flat[g, key]
                regions = by_record.setdefault(tb.record, [])
                regions += [_region(s, role(key, keys), tb.offset + s.offset * 4, "float32", sums, prev_at)
                            for s in slots if s.group == g and s.valid]
        reads += [(fd, r.data_offset, r.size, r.crc, sorted(regs, key=lambda x: x.start), r)
                  for r, regs in sorted(by_record.items(), key=lambda item: item[0].data_offset)]
    if job.frozen:
        reads += _frozen_reads(job, sums, stack)
    return reads


def _region(slot: SlotRead, kind: str, at: int, dtype: str, sums: dict, prev_at: dict) -> _SumRegion:
    fd, prev = prev_at.get((slot.row, slot.param), (None, None)) if kind == MASTERS else (None, None)
    return _SumRegion(at, at + slot.valid * 4, kind, dtype, sums[slot.row], prev, fd)


def _fp32_places(files: RankFiles, group_sizes: tuple[int, ...], slots: list[SlotRead]) -> dict[str, int]:
    """Where each slot's fp32 masters lie in another checkpoint's file of this rank."""
    reader = rank_reader(files, group_sizes)
    return {s.param: reader.place("fp32", param=s.param, group=s.group, offset=s.offset, valid=s.valid).at
            for s in slots}


def _frozen_reads(job: StatsJob, sums: dict[str, RowSums], stack: contextlib.ExitStack) -> list:
    path = job.files.model_states
    fragments = rank_reader(job.files, job.group_sizes).fragments([param for _row, param in job.frozen])
    fd = open_fd(stack, path)
    valid = job.layout.frozen_valid(job.rank)
    by_record: dict[Record, list[_SumRegion]] = {}
    for row, param in job.frozen:
        tb = fragments[param]
        dtype = dtype_name(tb.dtype)
        if dtype not in EXPONENT:
            raise CheckpointError(f"{path}: frozen parameter {param} is stored as {dtype}")
        by_record.setdefault(tb.record, []).append(
            _SumRegion(tb.offset, tb.offset + min(tb.numel, valid[param]) * tb.itemsize, FROZEN, dtype, sums[row]))
    return [(fd, r.data_offset, r.size, r.crc, sorted(regs, key=lambda x: x.start), None)
            for r, regs in by_record.items()]


def _read(fd: int, start: int, length: int, expected: int | None, regions: list[_SumRegion], buffers,
          counter: ByteCounter, ahead: dict[int, Readahead], blocks: BlockCrcs | None = None) -> bool:
    """Read [start, start+length) in chunks, feeding each region the part of each chunk it
    covers; False if the range's CRC-32 is not `expected` (None: nothing to check). `blocks`:
    the range's CRC-32 is worked out as its blocks' (recorded there), not byte by byte again."""
    buffer, prev_buffer = buffers
    value, position, end, first = 0, start, start + length, 0
    while position < end:
        view = buffer[: min(len(buffer), end - position)]
        prefetch(ahead, fd, position, end)
        pread_into(fd, view, position)
        if blocks is not None:
            blocks.feed(view)
        elif expected is not None:
            value = crc32(view, value)
        chunk_end = position + len(view)
        while first < len(regions) and regions[first].end <= position:
            first += 1
        i, here = first, []
        while i < len(regions) and regions[i].start < chunk_end:
            r = regions[i]
            a, b = max(r.start, position), min(r.end, chunk_end)
            if b > a:
                here.append((r, a, b))
            i += 1
        if not _consume_together(here, view, position, prev_buffer, counter, ahead):
            for r, a, b in here:
                prev = None
                if r.prev_fd is not None:
                    assert r.prev_at is not None, "a region read beside a previous file knows where in it"
                    prev = prev_buffer[: b - a]
                    at = r.prev_at + (a - r.start)
                    prefetch(ahead, r.prev_fd, at, r.prev_at + (r.end - r.start))
                    pread_into(r.prev_fd, prev, at)
                    counter.add(b - a)
                _consume(r, view[a - position: b - position], prev)
        position = chunk_end
        counter.add(len(view))
    if blocks is not None:
        value = blocks.finish()
    return expected is None or value == expected


def _consume(region: _SumRegion, data: memoryview, prev: memoryview | None) -> None:
    sums = region.sums
    if region.dtype == "float32" and region.kind != FROZEN:
        x = np.frombuffer(data, dtype="<f4")
        finite = np.isfinite(x)
        bad = len(x) - int(np.count_nonzero(finite))
    else:
        x, finite, bad = None, None, count(data, region.dtype)
    sums.nonfinite += bad
    if x is None or region.kind == STATE:
        return
    if bad:
        x = np.where(finite, x, np.float32(0))
    if region.kind == METRIC:
        if bad < len(x):
            top = float(np.max(np.abs(x)))
            sums.v_max = top if sums.v_max is None else max(sums.v_max, top)
        return
    sums.count += len(x)
    sums.sumsq += _dot(x, x)
    if prev is None:
        return
    sums.has_prev = True
    p = np.frombuffer(prev, dtype="<f4")
    prev_finite = np.isfinite(p)
    prev_bad = len(p) - int(np.count_nonzero(prev_finite))
    sums.prev_nonfinite += prev_bad
    if prev_bad or bad:
        both = prev_finite & finite if bad else prev_finite
        p, x = np.where(both, p, np.float32(0)), np.where(both, x, np.float32(0))
    d = x - p  # float32, as the optimizer computes; squared and summed below in blocks
    sums.diff_sq += _dot(d, d)
    sums.prev_sq += _dot(p, p)


def _consume_together(here: list, view: memoryview, position: int, prev_buffer: memoryview,
                      counter: ByteCounter, ahead: dict[int, Readahead]) -> bool:
    """`_consume` for every region of a chunk at once (a few numpy calls, however many
    parameters the chunk holds): the regions of one record of fp32 values of one kind whose
    previous checkpoint's values, if any, lie at one shift in one file. False: not so; the
    caller consumes them one by one."""
    if len(here) < 2:
        return False
    r0 = here[0][0]
    shift = None if r0.prev_fd is None else r0.prev_at - r0.start
    for r, _a, _b in here:
        if r.kind != r0.kind or r.dtype != "float32" or r.kind == FROZEN or r.prev_fd != r0.prev_fd \
                or (shift is not None and r.prev_at - r.start != shift):
            return False
    first, last = here[0][1], here[-1][2]
    x = np.frombuffer(view[first - position: last - position], dtype="<f4")
    bounds = np.fromiter((q for _r, a, b in here for q in ((a - first) // 4, (b - first) // 4)),
                         dtype=np.int64, count=2 * len(here))
    lengths = bounds[1::2] - bounds[::2]

    finite = np.isfinite(x)
    bad = lengths - per_slice(np.add, finite, bounds, np.int64)
    for (r, _a, _b), k in zip(here, bad.tolist()):
        r.sums.nonfinite += k
    if r0.kind == STATE:
        return True
    xz = np.where(finite, x, np.float32(0))
    if r0.kind == METRIC:
        tops = per_slice(np.maximum, np.abs(xz), bounds).tolist()
        for (r, _a, _b), k, length, top in zip(here, bad.tolist(), lengths.tolist(), tops):
            if k < length:
                r.sums.v_max = top if r.sums.v_max is None else max(r.sums.v_max, top)
        return True
    squares = per_slice(np.add, np.square(xz, dtype=np.float64), bounds).tolist()
    for (r, _a, _b), length, sq in zip(here, lengths.tolist(), squares):
        r.sums.count += length
        r.sums.sumsq += sq
    if shift is None:
        return True
    prev = prev_buffer[: last - first]
    prefetch(ahead, r0.prev_fd, first + shift, here[-1][0].end + shift)
    pread_into(r0.prev_fd, prev, first + shift)
    counter.add(int(lengths.sum()) * 4)
    p = np.frombuffer(prev, dtype="<f4")
    prev_finite = np.isfinite(p)
    prev_bad = lengths - per_slice(np.add, prev_finite, bounds, np.int64)
    both = prev_finite & finite
    p, xz = np.where(both, p, np.float32(0)), np.where(both, xz, np.float32(0))
    diffs = per_slice(np.add, np.square(xz - p, dtype=np.float64), bounds).tolist()
    prevs = per_slice(np.add, np.square(p, dtype=np.float64), bounds).tolist()
    for (r, _a, _b), k, d, q in zip(here, prev_bad.tolist(), diffs, prevs):
        r.sums.has_prev = True
        r.sums.prev_nonfinite += k
        r.sums.diff_sq += d
        r.sums.prev_sq += q
    return True


_BLOCK = 1024


def _dot(a, b) -> float:
    """sum(a*b) of float32 arrays without a float64 copy: float32 dot products of 1024-element
    blocks (relative error ~1e-6), the blocks summed in float64."""
    n = len(a) - len(a) % _BLOCK
    total = 0.0
    if n:
        total = float(np.einsum("ij,ij->i", a[:n].reshape(-1, _BLOCK), b[:n].reshape(-1, _BLOCK))
                      .sum(dtype=np.float64))
    if n < len(a):
        total += float(np.dot(a[n:].astype(np.float64), b[n:].astype(np.float64)))
    return total
