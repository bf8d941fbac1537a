"""One rank's statistics over the flat tensors of its optim file, every parameter at once.

A rank's fp32 masters, exp_avg and exp_avg_sq of a sub-group are one flat tensor each, its
parameters' slices side by side at the offsets every rank shares (`SlotTable`); only how much
of each slice is real data (not padding) depends on the rank. So the slices are columns of
numpy arrays, each chunk read is reduced per slice with a few `reduceat` calls, and the slices'
sums are added into their rows with `add.at`: the Python work per chunk is the same for one
parameter or a thousand (a wide run's rank files hold thousands of tiny slices; a 70B model's,
hundreds of large ones). The previous checkpoint's masters of the same rank lie at one shift
from this file's in each sub-group (the same layout): one read per chunk.

Each byte of the file is read once, for its record's CRC-32 and for the sums, as `stats_rank`
does for the other cases (a partial checkpoint's rows file, frozen fragments, a previous
checkpoint that is partial), which it keeps.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import numpy as np

from tailor_tui.checked.crc import BlockCrcs, RecordBlocks, crc32
from tailor_tui.checked.ranges import Readahead, pread_into
from tailor_tui.events import ByteCounter
from tailor_tui.fileio import open_fd
from tailor_tui.formats.ds_format import MASTERS, health_state
from tailor_tui.formats.ptfile import read_whole
from tailor_tui.health.stats_job import RowSums, SlotTable, StatsJob

CHUNK = 1 << 20
PURPOSE = "health statistics"  # what refuses a checkpoint whose optimizer states are not fp32


def can_read_flat(job: StatsJob) -> bool:
    """Whether `flat_stats` reads `job`: a full checkpoint whose rows' previous checkpoints are full too."""
    return job.table is not None and job.files.whole_records and all(f.whole_records for _row, f in job.prev)


@dataclass
class _Sums:
    """Per row (an index into the table's rows), what `RowSums` holds, as arrays."""

    nonfinite: np.ndarray
    count: np.ndarray
    sumsq: np.ndarray
    v_max: np.ndarray  # -inf: no finite exp_avg_sq seen
    diff_sq: np.ndarray
    prev_sq: np.ndarray
    prev_nonfinite: np.ndarray
    has_prev: np.ndarray
    crc_bad: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> "_Sums":
        ints, floats = (lambda: np.zeros(n, np.int64)), (lambda: np.zeros(n, np.float64))
        return cls(ints(), ints(), floats(), np.full(n, -np.inf), floats(), floats(), ints(),
                   np.zeros(n, bool), np.zeros(n, bool))

    def into(self, sums: dict[str, RowSums], names: tuple[str, ...], present: np.ndarray) -> None:
        columns = (self.nonfinite, self.count, self.sumsq, self.v_max, self.diff_sq, self.prev_sq, self.prev_nonfinite,
                   self.has_prev, self.crc_bad)
        for i, nonfinite, n, sumsq, v_max, diff_sq, prev_sq, prev_nonfinite, has_prev, bad in zip(
                present.tolist(), *(column[present].tolist() for column in columns)):
            found = RowSums(nonfinite, n, sumsq, None if v_max == -np.inf else v_max, diff_sq, prev_sq, prev_nonfinite,
                            has_prev, not bad)
            if (s := sums.get(names[i])) is None:
                sums[names[i]] = found
            else:
                s.add(found)


def flat_stats(job: StatsJob, sums: dict[str, RowSums], stack, counter: ByteCounter,
               ahead: dict[int, Readahead], *, chunk: int = CHUNK, blocks: dict | None = None) -> bool:
    """Add the sums of every row `job` reads from its optim file into `sums`; False (nothing read)
    when the file is laid out otherwise than one aligned record per flat tensor (`stats_rank`
    reads it then). `chunk`: bytes per read (tests make it small). `blocks`: gets each record's
    block CRC-32s ({name: `crc.RecordBlocks`}) where it passed its CRC-32 check."""
    path, table = job.files.state_file, job.table
    assert table is not None, "can_read_flat(job) holds"
    whole = read_whole(path)  # a wide run's small rank file: one read, its structure from memory
    located = job.files.reader(job.group_sizes, whole)
    mine, keys = located.fp32_whole_flat(PURPOSE), located.keys()
    if mine is None or not _laid_out_flat(mine.values()):  # (None: its state in slices, can_read_flat's job)
        return False
    part, numel, group, offset, row = _columns(table)
    valid = np.clip(numel - job.rank * part, 0, part)
    keep = valid > 0
    valid, group, offset, row = valid[keep], group[keep], offset[keep], row[keep]
    # the previous checkpoints' files: a class per file, the rows that take theirs from it
    classes: dict = {}  # a previous checkpoint's optim file -> (its class, its files)
    row_class = np.zeros(len(table.rows), np.int64)  # 0: no previous checkpoint
    index = {name: i for i, name in enumerate(table.rows)}
    for name, files in job.prev:
        row_class[index[name]] = classes.setdefault(files.state_file, (len(classes) + 1, files))[0]
    prev = {}  # (class, group) -> (its fd or bytes, where its masters lie relative to this file's)
    for prev_path, (c, files) in classes.items():
        held = read_whole(prev_path)
        theirs = files.reader(job.group_sizes, held).fp32_whole_flat(PURPOSE)
        assert theirs is not None, "can_read_flat(job): the previous checkpoints' state in whole records"
        source = held if held is not None else open_fd(stack, prev_path)
        for g in range(len(job.group_sizes)):
            prev[c, g] = (source, theirs[g, "fp32"].offset - mine[g, "fp32"].offset)
    fd = whole if whole is not None else open_fd(stack, path)
    size = min(chunk, max(tb.record.size for tb in mine.values()))
    buffers = memoryview(bytearray(size)), memoryview(bytearray(size))
    acc = _Sums.zeros(len(table.rows))
    for g in range(len(job.group_sizes)):
        here = np.flatnonzero(group == g)
        here = here[np.argsort(offset[here], kind="stable")]
        r, c = row[here], row_class[row[here]]
        for key in keys:
            tb = mine[g, key]
            a = tb.offset + offset[here] * 4
            shifts = {k: prev[k, g] for k in np.unique(c).tolist() if k} if key == MASTERS else {}
            reader = _Reader(fd, role(key, keys), a=a, b=a + valid[here] * 4, rows=r, classes=c, shifts=shifts,
                             acc=acc, buffers=buffers, counter=counter, ahead=ahead)
            recorder = BlockCrcs(job.crc_block) if blocks is not None and tb.record.crc is not None else None
            if not reader.record(tb.record.data_offset, tb.record.size, tb.record.crc, recorder):
                acc.crc_bad[r] = True
            elif blocks is not None and recorder is not None:
                blocks[tb.record.name] = RecordBlocks.of(tb.record, recorder)
    acc.into(sums, table.rows, np.unique(row))
    return True


_LAST_TABLE: list = [None, None]  # the table the jobs of a batch share, and its columns as arrays


def _columns(table: SlotTable) -> tuple[np.ndarray, ...]:
    """(part, numel, group, offset, row) of `table` as arrays (read-only), made once per table
    object: the jobs of a batch share one (pickled once with them)."""
    if _LAST_TABLE[0] is not table:
        columns = tuple(np.array(c, np.int64) for c in (table.part, table.numel, table.group, table.offset, table.row))
        for column in columns:
            column.flags.writeable = False
        _LAST_TABLE[:] = [table, columns]
    return _LAST_TABLE[1]


def _read(source: int | bytes, buffer: memoryview, position: int, ahead: dict[int, Readahead], end: int) -> memoryview:
    """`buffer`'s length of bytes from `position` of a file: `source`, its descriptor (read into
    `buffer`, the disk kept reading ahead up to `end`), or its bytes read whole."""
    if isinstance(source, bytes):
        found = memoryview(source)[position: position + len(buffer)]
        if len(found) < len(buffer):
            raise OSError(errno.EIO, f"file ended {len(buffer) - len(found)} bytes early (truncated?)")
        return found
    prefetch(ahead, source, position, end)
    pread_into(source, buffer, position)
    return buffer


def prefetch(ahead: dict[int, Readahead], fd: int, position: int, end: int) -> None:
    """Keep the disk reading ahead of a reader of `fd` about to read from `position` of a range ending at
    `end` (one `Readahead` per file in `ahead`)."""
    (ahead.get(fd) or ahead.setdefault(fd, Readahead(fd))).before(position, end)


def _laid_out_flat(tensors) -> bool:
    """Each flat tensor its own record, whose data its 4-byte values fill from an aligned start."""
    records = [tb.record for tb in tensors]
    return len({r.name for r in records}) == len(records) and all(
        (tb.offset - tb.record.data_offset) % 4 == 0 and tb.record.size % 4 == 0 for tb in tensors)


def per_slice(ufunc, values: np.ndarray, bounds: np.ndarray, dtype=None) -> np.ndarray:
    """`ufunc` reduced over each [lo, hi) of `bounds` ([lo0, hi0, lo1, hi1, ...], non-empty, in order)."""
    if bounds[-1] == len(values):  # reduceat takes the last start to the end by itself
        bounds = bounds[:-1]
    return ufunc.reduceat(values, bounds, dtype=dtype)[::2]


# What the statistics do with a flat tensor's values (`role`): the masters' RMS and change, the largest magnitude
# of the optimizer's state `ds_format.health_state` names (`v max`), the NaN/Inf of any other state kept per
# element alone; a frozen parameter's fragment (model_states), its RMS
METRIC, STATE, FROZEN = "metric", "state", "frozen"


def role(key: str, keys: tuple[str, ...]) -> str:
    """What the statistics do with flat tensor `key` of a rank whose flat tensors are `keys`."""
    return key if key == MASTERS else METRIC if key == health_state(keys) else STATE


class _Reader:
    """Reads one flat tensor's record in chunks; every slice (`a`..`b` bytes, of row `rows`,
    whose previous masters are of class `classes`) gets its part of each chunk."""

    def __init__(self, fd: int | bytes, key: str, *, a, b, rows, classes, shifts: dict, acc: _Sums, buffers,
                 counter: ByteCounter, ahead: dict[int, Readahead]):
        self.fd, self.key, self.a, self.b, self.rows, self.classes = fd, key, a, b, rows, classes
        self.shifts, self.acc, self.buffers, self.counter, self.ahead = shifts, acc, buffers, counter, ahead

    def record(self, start: int, size: int, expected: int | None, blocks: BlockCrcs | None = None) -> bool:
        """Read the record at `start`; False if its CRC-32 is not `expected` (None: none to check).
        `blocks`: its CRC-32 is worked out as its blocks' (recorded there), each byte CRC'd once."""
        buffer = self.buffers[0]
        value, position, end = 0, start, start + size
        while position < end:
            view = _read(self.fd, buffer[: min(len(buffer), end - position)], position, self.ahead, end)
            if blocks is not None:
                blocks.feed(view)
            elif expected is not None:
                value = crc32(view, value)
            i, j = np.searchsorted(self.b, position, "right"), np.searchsorted(self.a, position + len(view), "left")
            if j > i:
                self._chunk(view, position, slice(i, j))
            position += len(view)
            self.counter.add(len(view))
        if blocks is not None:
            value = blocks.finish()
        return expected is None or value == expected

    def _chunk(self, view: memoryview, position: int, which: slice) -> None:
        acc, key = self.acc, self.key
        x = np.frombuffer(view, dtype="<f4")
        lo = (np.maximum(self.a[which], position) - position) // 4
        hi = (np.minimum(self.b[which], position + len(view)) - position) // 4
        rows, lengths = self.rows[which], hi - lo
        bounds = np.empty(2 * len(lo), np.int64)
        bounds[0::2], bounds[1::2] = lo, hi
        finite = np.isfinite(x)
        bad = lengths - per_slice(np.add, finite, bounds, np.int64)
        np.add.at(acc.nonfinite, rows, bad)
        if key == STATE:
            return
        xz = x if finite.all() else np.where(finite, x, np.float32(0))
        if key == METRIC:
            some = bad < lengths
            np.maximum.at(acc.v_max, rows[some], per_slice(np.maximum, np.abs(xz), bounds)[some].astype(np.float64))
            return
        np.add.at(acc.count, rows, lengths)
        np.add.at(acc.sumsq, rows, per_slice(np.add, np.square(xz, dtype=np.float64), bounds))
        classes = self.classes[which]
        for c, (fd, shift) in self.shifts.items():
            mine = np.flatnonzero(classes == c)
            if len(mine):
                self._against_previous(fd, position + shift, lo[mine], hi[mine], rows[mine], finite, xz)

    def _against_previous(self, fd: int | bytes, at: int, lo, hi, rows, finite, xz) -> None:
        """||θ − θ_prev||² and ||θ_prev||² of the slices [lo, hi) of this chunk, whose previous
        masters lie at `at` + 4·lo in `fd` (elements finite in both only), into their rows."""
        acc, first, last = self.acc, int(lo[0]), int(hi[-1])
        prev = _read(fd, self.buffers[1][: (last - first) * 4], at + first * 4, self.ahead, at + last * 4)
        self.counter.add(int((hi - lo).sum()) * 4)
        bounds = np.empty(2 * len(lo), np.int64)
        bounds[0::2], bounds[1::2] = lo - first, hi - first
        p = np.frombuffer(prev, dtype="<f4")
        prev_finite = np.isfinite(p)
        np.add.at(acc.prev_nonfinite, rows, (hi - lo) - per_slice(np.add, prev_finite, bounds, np.int64))
        both = prev_finite & finite[first:last]
        x = xz[first:last]
        if not both.all():
            p, x = np.where(both, p, np.float32(0)), np.where(both, x, np.float32(0))
        np.add.at(acc.diff_sq, rows, per_slice(np.add, np.square(x - p, dtype=np.float64), bounds))
        np.add.at(acc.prev_sq, rows, per_slice(np.add, np.square(p, dtype=np.float64), bounds))
        acc.has_prev[rows] = True
