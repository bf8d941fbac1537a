"""The streaming writer of a rank's optim_states file: the base's archive with byte ranges
replaced, every byte copied in the kernel, every byte taken checked against its CRC-32.

This module never imports torch (a module boundary: workers that only stream start in a
fraction of a second); `rank_torch` holds the writers that need it.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import struct
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

from tailor_tui import crc
from tailor_tui.formats.ds_format import TENSORS, flat_tensor, optimizer_state
from tailor_tui.errors import IncompatibleError
from tailor_tui.events import ByteCounter
from tailor_tui.fileio import CREATE, Writeback, copy_range, fsync, open_fd, output_error
from tailor_tui.reading import crc_range
from tailor_tui.planning.jobs import RankJob
from tailor_tui.formats.nonfinite import Census, Region
from tailor_tui.checkpoints.partial_rows import check_crc, partial_slice, read_rows_file
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import (
    Record,
    TensorBytes,
    Unsupported,
    checked_crcs,
    file_format,
    locate,
    read_structure,
)

# One small buffer, reused: on this kind of VM fresh 64 MiB buffers ran at 0.6 GiB/s (page
# faults on every chunk); a reused 1 MiB buffer stays in CPU cache between read and CRC.
STREAM_CHUNK = 1 << 20

class Span(NamedTuple):
    """A byte range of the output optim file that does not keep the base's bytes."""

    at: int  # where it lies in the base's (and the output's) file
    length: int
    source: int | None  # the checkpoint its bytes come from; None: zeros (padding)
    source_at: int  # where they lie in that checkpoint's file
    record: Record  # the base's record it lies in
    source_record: Record | None  # the full source's record they come from (None: partial, zeros)
    check: tuple | None = None  # from a partial's rows file: (its path, its CRC-32s, the tensor's name)


def stream_optim_states(job: RankJob, out: Path, counter: ByteCounter) -> Counter | None:
    """Write the composed optim_states file as the base's bytes with replaced ranges.

    The output has the base's exact zip layout. First every record of the base, and every
    record of a source that a slice comes from, is read once and checked against the CRC-32
    its archive stores (a flipped byte is refused, never carried into the output under a
    fresh CRC); that pass also gives the CRCs of the replaced ranges, old and new. Then every
    byte is copied in the kernel (copy_file_range): the base's where nothing replaces it, a
    source's slice where the recipe picks it; padding keeps the base's zero bytes (zeros where
    they are not: `Padding`); each record's CRC-32 is updated from its replaced ranges alone
    (see `crc`). Memory stays at one small buffer whatever the file size. The same reads count each row's non-finite values in what
    the output takes (returned per row). Returns None (writing nothing) when the archive is laid
    out in a way this does not handle, or the base's file is in torch's legacy format; the
    caller then re-serialises. Sources may be in either format (legacy ones have no CRC).
    """
    base_path = job.files[0].optim_states
    if file_format(base_path) != "zip":
        return None  # the output is a zip archive: a legacy-format base's file is re-serialised
    used = sorted({c.source for c in job.copies})
    try:
        obj, base_records, prefix = read_structure(base_path, shared=True)
        base = flat_tensor_bytes(obj, base_records, prefix, base_path, job.group_sizes)
        sources = {s: tensor_bytes(job.files[s].optim_states, job.group_sizes)
                   for s in used if job.files[s].rows is None}
    except Unsupported:
        return None
    for s, theirs in sources.items():
        check_dtypes(base, theirs, job.files[s].optim_states)
    partial, crcs = {}, {}  # per partial source: where its rows file's tensors lie, their CRC-32s
    for s in used:
        if job.files[s].rows is not None:
            partial[s], crcs[s] = read_rows_file(job.files[s].rows)
    slots = defaultdict(list)
    for slot in job.row_slots:
        slots[slot.source].append(slot)
    census = {s: Census(Region(at, length, row) for row, at, length in _row_places(job, s, slots[s], base, sources,
                                                                                   partial))
              for s in [0, *used]}
    spans = []
    for c in job.copies:  # (the plan joined neighbours from one full source)
        for key in TENSORS:
            b = base[c.group, key]
            check = None
            if c.param is None:
                theirs = sources[c.source][c.group, key]
                at, record = theirs.offset + c.offset * b.itemsize, theirs.record
            else:
                rows = job.files[c.source].rows
                at, record = partial_slice(rows, partial[c.source], key, c.param, c.length)[2], None
                check = (rows, crcs[c.source], f"{key}/{c.param}")
            spans.append(Span(b.offset + c.offset * b.itemsize, c.length * b.itemsize, c.source, at, b.record, record,
                              check))
    spans = _coalesced(spans)
    padding = Padding(_pads(job.padding, base))

    try:
        with contextlib.ExitStack() as stack:
            fin = open_fd(stack, base_path)
            fds = {s: open_fd(stack, job.files[s].rows or job.files[s].optim_states) for s in used}
            buffer = memoryview(bytearray(STREAM_CHUNK))
            old = read_and_check(fin, base_path, base_records.values(),
                                  {(sp.record, sp.at, sp.length) for sp in spans}, buffer, counter, census[0],
                                  padding.inspect)
            if padding.dirty:  # a base whose padding is not zero bytes: zeros there
                for at, length, record, value in padding.found():
                    spans.append(Span(at, length, None, 0, record, None))
                    old[at, length] = value
                spans.sort(key=lambda sp: sp.at)
            new = {}
            for s in sources:
                taken = {(sp.source_record, sp.source_at, sp.length) for sp in spans if sp.source == s}
                checked = read_and_check(fds[s], job.files[s].optim_states, {r for r, _, _ in taken}, taken,
                                          buffer, counter, census[s])
                new.update({(s, at): value for (at, _n), value in checked.items()})
            fout = open_fd(stack, out, CREATE)
            writeback = Writeback(fout, counter.options.durable)
            position, crc_changes = 0, defaultdict(int)
            for sp in spans:
                copy_range(fin, fout, position, sp.at - position, counter.add, writeback=writeback)
                if sp.source is None:  # padding that held garbage: left a hole, which reads as zeros
                    value = crc.zeros(sp.length)
                else:
                    copy_range(fds[sp.source], fout, sp.source_at, sp.length, counter.add, sp.at, writeback)
                    value = new.get((sp.source, sp.source_at))
                    if value is None:  # from a partial checkpoint: its rows file records each slice's CRC-32
                        value = crc_range(fds[sp.source], sp.source_at, sp.length, buffer, counter.add,
                                          census[sp.source].inspect)
                        check_crc(*sp.check, value)
                tail = sp.record.data_offset + sp.record.size - sp.at - sp.length
                crc_changes[sp.record] ^= crc.shift(old[sp.at, sp.length] ^ value, tail)
                position = sp.at + sp.length
            copy_range(fin, fout, position, os.fstat(fin).st_size - position, counter.add, writeback=writeback)
            for record, change in crc_changes.items():
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", record.crc ^ change), at)
            fsync(fout, counter.options.durable)
    except OSError as exc:
        raise output_error(exc, out) from None
    return sum((c.counts for c in census.values()), Counter())


def _row_places(job: RankJob, s: int, slots: list, base: dict, sources: dict, partial: dict) -> list[list]:
    """[row, first byte, length] of every slice the output takes from source `s` (its `slots`), in
    that source's file: the base's own, a full source's optim file or a partial's rows file;
    neighbouring slices of one row joined."""
    places: list[list] = []
    for key in TENSORS:
        last = None
        for slot in slots:
            if s == 0:
                at = base[slot.group, key].offset + slot.offset * 4
            elif s in sources:
                at = sources[s][slot.group, key].offset + slot.offset * 4
            else:
                at = partial_slice(job.files[s].rows, partial[s], key, slot.param, slot.valid)[2]
            if last is not None and last[0] == slot.row and last[1] + last[2] == at:
                last[2] += slot.valid * 4
            else:
                last = [slot.row, at, slot.valid * 4]
                places.append(last)
    return places


def read_and_check(fd: int, path: Path, records, ranges: set, buffer: memoryview,
                    counter: ByteCounter, census: Census | None = None, also=None) -> dict[tuple[int, int], int]:
    """Read every byte of `records` of the file `fd` once, checking each record's stored
    CRC-32 (`ptfile.checked_crcs`), and return the CRC of each (record, offset, length) in
    `ranges` as {(offset, length): crc}; `census` counts non-finite values on the way, and
    `also(offset, chunk)` sees every chunk too."""
    found = {}
    inspect = census.inspect if census is not None else None
    if also is not None:
        inspect = also if inspect is None else _both(inspect, also)
    by_record: dict[int, list[tuple[int, int]]] = {}  # grouped once (records compared by identity)
    for r, at, n in ranges:
        by_record.setdefault(id(r), []).append((at, n))
    for record in sorted(records, key=lambda r: r.data_offset):
        mine = sorted(by_record.get(id(record), ()))
        found.update(zip(mine, checked_crcs(fd, path, record, mine, buffer, counter.add, inspect)))
    return found


def _both(first, second):
    def inspect(offset: int, chunk) -> None:
        first(offset, chunk)
        second(offset, chunk)
    return inspect


def _pads(padding, base: dict) -> list[tuple[int, int, Record]]:
    """(at, length, record) of the padding (`RankJob.padding`) of each flat tensor, in file order."""
    return sorted((base[g, key].offset + offset * base[g, key].itemsize, length * base[g, key].itemsize,
                   base[g, key].record) for key in TENSORS for g, offset, length in padding)


class Padding:
    """The base's padding, looked at as it is read (`inspect`): the output's padding is zero bytes
    (what --verify checks) and a base's nearly always already is, so it is kept as it is; a range
    that is not (`found`: with the CRC-32 of its bytes) is replaced by zeros."""

    def __init__(self, pads: list[tuple[int, int, Record]]):
        self.pads, self._starts = pads, [at for at, _n, _r in pads]
        self.dirty: dict[int, int] = {}  # pad index -> the CRC-32 of its bytes read so far

    def inspect(self, offset: int, chunk) -> None:
        end = offset + len(chunk)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self.pads) and self.pads[i][0] < end:
            at, n, _record = self.pads[i]
            a, b = max(at, offset), min(at + n, end)
            if b > a:  # a pad's parts come in order: those before this one were read already
                part = chunk[a - offset: b - offset]
                if i in self.dirty:
                    self.dirty[i] = crc.crc32(part, self.dirty[i])
                elif bytes(part).count(0) != b - a:
                    self.dirty[i] = crc.crc32(part, crc.zeros(a - at))
            i += 1

    def found(self) -> list[tuple[int, int, Record, int]]:
        return [(*self.pads[i], value) for i, value in sorted(self.dirty.items())]


def _coalesced(spans: list[Span]) -> list[Span]:
    """Spans in file order, neighbours from the same source and records joined into one
    (the params of a layer lie side by side in both files: one copy, one CRC step)."""
    joined: list[Span] = []
    last, length = None, 0  # the span being extended, and its length so far
    for span in sorted(spans, key=lambda s: s.at):
        if (last is not None and span.check is None and span.at == last.at + length and span.source == last.source
                and span.record is last.record and span.source_record is last.source_record
                and (span.source is None or span.source_at == last.source_at + length)):
            length += span.length
            continue
        if last is not None:
            joined.append(last if length == last.length else last._replace(length=length))
        last, length = span, span.length
    if last is not None:
        joined.append(last if length == last.length else last._replace(length=length))
    return joined


def check_dtypes(base: dict, theirs: dict, path: Path) -> None:
    """Refuse a source whose flat tensors are stored in another dtype than the base's (bf16
    optimizer states, say): their bytes would be reinterpreted. `base` maps (group, key) to
    TensorBytes or to (dtype, itemsize)."""
    for (g, key), tb in theirs.items():
        mine = base[g, key]
        expected = (mine.dtype, mine.itemsize) if isinstance(mine, TensorBytes) else mine
        if (tb.dtype, tb.itemsize) != expected:
            raise dtype_mismatch(path, key, g, tb.dtype, expected[0])


def dtype_mismatch(path: Path, key: str, group: int, theirs: str, mine: str) -> IncompatibleError:
    """`theirs`, `mine`: a torch dtype (`torch.bfloat16`) or storage type (`BFloat16Storage`)."""
    return IncompatibleError(
        f"{path}: its {key} of sub-group {group} is stored as {dtype_name(theirs)}, the base's as "
        f"{dtype_name(mine)}; checkpoints saved with another optimizer-state precision cannot be combined")


def tensor_bytes(path: Path, group_sizes: tuple[int, ...]) -> dict:
    """{(group, key): TensorBytes} of the flat fp32 weights and moments of an optim file."""
    return flat_tensor_bytes(*read_structure(path, shared=True), path, group_sizes)


def flat_tensor_bytes(obj, records: dict, prefix: str, path: Path, group_sizes: tuple[int, ...]) -> dict:
    inner = optimizer_state(obj, path, group_sizes)
    return {(g, key): locate(flat_tensor(inner, g, key), records, prefix)
            for g in range(len(group_sizes)) for key in TENSORS}



