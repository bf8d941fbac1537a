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
from typing import NamedTuple

from tailor_tui.checked import crc
from tailor_tui.checked.evidence import SliceCheck, checked_ranges, read_and_check
from tailor_tui.checked.ranges import READ_CHUNK, RangeCrcs, Readahead, RegionCrcs, crc_range, pread_into
from tailor_tui.cloning import clone, worth_it
from tailor_tui.compose.source_blocks import of_source, read_taken
from tailor_tui.compose.taken import Looks, Parts
from tailor_tui.events import ByteCounter
from tailor_tui.fileio import CREATE, Target, Writeback, copy_range, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats.nonfinite import Census, Region
from tailor_tui.formats.ptfile import Record, Unsupported, file_format, read_whole
from tailor_tui.kinds.base import RankReader, check_dtypes, rank_reader
from tailor_tui.planning.jobs import RankJob


class Replacement(NamedTuple):
    """A byte range of the output optim file that does not keep the base's bytes."""

    at: int  # where it lies in the base's (and the output's) file
    length: int
    source: int  # the checkpoint its bytes come from
    source_at: int  # where they lie in that checkpoint's file
    record: Record  # the base's record it lies in
    source_record: Record | None  # the full source's record they come from (None: a partial's rows file)
    check: SliceCheck | None = None  # from a partial's rows file: the slice it is, checked whole


def stream_optim_states(job: RankJob, out: Target, counter: ByteCounter) -> tuple[Counter, Parts] | None:
    """Write the composed optim_states file as the base's bytes with replaced ranges.

    The output has the base's exact zip layout and is written front to back, in the kernel
    (copy_file_range): the base's bytes where nothing replaces them, a source's slice where the
    recipe picks it. Every record of the base, and every record of a source that a slice comes
    from, is read once and checked against the CRC-32 its archive stores (a flipped byte is
    refused, never carried into the output under a fresh CRC; a failed check fails the task, and
    its unfinished output is never published). A source's record laid out as the base's is read
    in step with it (`_in_step`), chunk by chunk, each chunk just before it is copied: the copy
    finds its bytes in the CPU's cache. The same reads give the CRCs of the replaced ranges, old
    and new, and each record's CRC-32 is updated from them alone (see `crc`); padding keeps the
    base's zero bytes (zeros where they are not: `Padding`). Memory stays at one small buffer
    whatever the file size. The same reads count each row's non-finite values in what the output
    takes (returned per row), and the same reads give the CRC-32 of every part of a row the output takes
    (`compose.taken`: returned with them). Returns None (writing nothing) when the archive is laid out in a way
    this does not handle, or the base's file is in torch's legacy format; the caller then
    re-serialises. Sources may be in either format (legacy ones have no CRC: only the slices taken
    are read).

    Where the filesystem shares blocks (`cloning`; not with `--no-clone`, nor when the spans
    replace half the file or more), the output starts as a clone of the base's file and only the
    spans (and padding that is not zeros) are written; every record of the base is still read once,
    front to back, and checked against its CRC-32 as above: a clone keeps only bytes it has checked
    (bit rot since the run's statistics is refused, never published). Where those statistics found
    every row a checkpoint gives the output whole and finite (`job.vouched`), its NaN/Inf are not
    counted again: the CRC-32 checked on the way proves them the bytes the statistics counted. A
    source's record whose block CRC-32s the statistics recorded (`job.source_blocks`) is read only
    in the blocks that hold what the output takes, each checked against its recorded CRC-32
    (`source_blocks`): evidence of what the bytes should be, each block read proving what they are.
    """
    base_path = job.files[0].optim_states
    whole = read_whole(base_path)  # a wide run's: its structure read from one read
    if whole is None and file_format(base_path) != "zip":
        return None  # the output is a zip archive: a legacy-format base's file is re-serialised
    used = sorted({c.source for c in job.copies})
    readers = {s: rank_reader(job.files[s], job.group_sizes, whole if s == 0 else None, small=True)
               for s in [0, *used]}
    base_reader = readers[0]
    for reader in readers.values():
        reader.check_keys(job.keys)
    try:
        base_records, base = base_reader.archive(), base_reader.whole_flat()
        if base_records is None or base is None:
            return None  # (a base keeping its state in slices is built from its skeleton: `optim_writer`)
        sources = {s: flat for s, r in readers.items() if s in used and (flat := r.whole_flat()) is not None}
    except Unsupported:
        return None
    for s, flats in sources.items():
        check_dtypes(base, flats, job.files[s].optim_states)
    slots = defaultdict(list)
    for slot in job.row_slots:
        slots[slot.source].append(slot)
    # (a checkpoint whose rows the run's statistics found finite: not counted again, `planning.reads`)
    taking = {s: _parts(readers[s], slots[s]) for s in [0, *used]}  # where each slice lies, located once
    spans = []
    for c in job.copies:  # (the plan joined neighbours from one full source)
        for key in job.keys:
            b = base[c.group, key]
            place = readers[c.source].place(key, param=c.param, group=c.group, offset=c.offset, valid=c.length)
            spans.append(Replacement(b.offset + c.offset * b.itemsize, c.length * b.itemsize, c.source, place.at,
                                     b.record, place.record, place.slice))
    spans = _coalesced(spans)
    padding = Padding(_pads(job.padding, base, job.keys))

    records = sorted(base_records.values(), key=lambda r: r.data_offset)
    if any(a.data_offset + a.size > b.header_offset for a, b in zip(records, records[1:])):
        return None  # records that overlap (a crafted archive): not streamed
    # the base's parts the output keeps: their CRC-32s from the pass that checks each base record (`RangeCrcs`,
    # beside the spans it replaces), not a second one; where a span overlaps one (a plan that is wrong), apart
    kept = _by_record(records, taking[0], spans)
    census = {s: Looks(Census(Region(at, length, row) for row, at, length in _row_places(taking[s])
                              if s not in job.vouched), RegionCrcs(() if s == 0 and kept is not None else taking[s]))
              for s in [0, *used]}
    kept = kept or {}
    fresh = _replaced_whole(records, spans, padding.pads)
    blocked = {s for s in sources if of_source(job, s)}  # read in the blocks they are taken from, not in step
    steps = _in_step([sp for sp in spans if sp.source not in blocked])
    stepped = {id(q) for group in steps.values() for _s, q, _d in group}
    try:
        with contextlib.ExitStack() as stack:
            fin = open_fd(stack, base_path)
            fds = {s: open_fd(stack, job.files[s].state_file) for s in used}
            fout = open_fd(stack, out, CREATE)
            clone_of, how = _clone(fin, fout, fds, spans, counter)  # one file's blocks shared: the rest is written
            sweep = _Sweep(fin, fout, spans, fds, counter, clone_of=clone_of,
                           zeroed=[(r.data_offset, r.data_offset + r.size) for r in records if id(r) in fresh])
            new = {}  # (source, offset) -> the CRC-32 of the span taken there
            for s in sources:  # a source's records not read in step: read and checked first
                ahead = [sp for sp in spans if sp.source == s and (s in blocked or id(sp.source_record) not in stepped)]
                taken = {(sp.source_record, sp.source_at, sp.length) for sp in ahead}
                if s in blocked:  # of a record with recorded block CRC-32s, only the blocks taken from
                    checked = read_taken(fds[s], job.files[s].optim_states, taken, of_source(job, s),
                                         buffer=sweep.buffer, counter=counter, census=census[s])
                else:
                    checked = read_and_check(fds[s], job.files[s].optim_states, {sp.source_record for sp in ahead},
                                             taken, sweep.buffer, counter=counter, census=census[s])
                new.update({(s, at): value for (at, _n), value in checked.items()})
            old: dict[tuple[int, int], int] = {}  # (offset, length) -> the CRC-32 of the base's bytes a span replaces
            parts: Parts = {}
            for record in records:
                sweep.copy_to(record.data_offset, new, census)  # its local header (and what lies before)
                # the spans it replaces and the parts the output keeps of it: their CRC-32s in one pass
                mine = sorted([(sp.at, sp.length, None) for sp in spans if sp.record is record]
                              + kept.get(record.data_offset, []), key=lambda r: r[0])
                base_crcs = RangeCrcs(record.data_offset, record.data_offset + record.size,
                                      [(at, n) for at, n, _part in mine])
                beside = [(s, q, delta, RangeCrcs(q.data_offset, q.data_offset + q.size,
                                                  [(sp.source_at, sp.length) for sp in spans if sp.source_record is q]))
                          for s, q, delta in steps.get(id(record), ())]
                for offset in range(record.data_offset, record.data_offset + record.size, READ_CHUNK):
                    n = min(READ_CHUNK, record.data_offset + record.size - offset)
                    if id(record) in fresh:  # nothing of it is kept: not read
                        counter.add(n)
                    else:
                        sweep.read(fin, offset, n, base_crcs, census[0], also=padding.inspect)
                    for s, _q, delta, theirs in beside:
                        sweep.read(fds[s], offset + delta, n, theirs, census[s])
                    sweep.copy_to(offset + n, new, census)
                if id(record) not in fresh:
                    for (at, n, part), value in zip(mine, checked_ranges(base_path, record, base_crcs), strict=True):
                        if part is None:
                            old[at, n] = value
                        else:
                            parts[part] = (value, n)
                for s, q, _delta, theirs in beside:
                    new.update({(s, at): value for (at, _n), value in
                                zip(theirs.ranges, checked_ranges(job.files[s].optim_states, q, theirs))})
            sweep.copy_to(os.fstat(fin).st_size, new, census)  # the zip's directory
            crc_changes: defaultdict[Record, int] = defaultdict(int)
            for record in records:
                if id(record) in fresh:
                    assert record.crc is not None, "a record replaced whole has a CRC-32 (`_replaced_whole`)"
                    crc_changes[record] = record.crc ^ _crc_of_replaced(fresh[id(record)], new)
            for sp in spans:
                if id(sp.record) in fresh:
                    continue
                tail = sp.record.data_offset + sp.record.size - sp.at - sp.length
                crc_changes[sp.record] ^= crc.shift(old[sp.at, sp.length] ^ new[sp.source, sp.source_at], tail)
            for at, length, record, value in padding.found():  # a base whose padding is not zero bytes: zeros
                pwrite_all(fout, bytes(length), at)
                tail = record.data_offset + record.size - at - length
                crc_changes[record] ^= crc.shift(value ^ crc.zeros(length), tail)
            for record, change in crc_changes.items():
                assert record.crc is not None, "the base is a zip archive: its records have CRC-32s"
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", record.crc ^ change), at)
            fsync(fout, counter.options.durable)
            if how is not None:  # (the base's padding that was not zeros: written over)
                counter.shares(sweep.kept - (sum(length for _at, length, _r, _v in padding.found()) if clone_of == 0
                                             else 0), how)
    except OSError as exc:
        raise output_error(exc, out) from None
    for looks in census.values():
        parts.update(looks.parts.found())
    return sum((c.counts for c in census.values()), Counter()), parts


def _replaced_whole(records: list[Record], spans: list[Replacement],
                    pads: list[tuple[int, int, Record]]) -> dict[int, list[tuple[int, int, int | None, int]]]:
    """The base's records every byte of which the output replaces, by spans and padding (a flat tensor every row
    of which is taken from elsewhere), by id: what replaces each, in file order ((first byte, length, source,
    first byte there); source None: padding). Nothing of them is kept, so they are not read; the output's
    padding there is written as zeros, and their CRC-32 worked out from what replaces them (`_crc_of_replaced`)."""
    pieces: defaultdict[int, list[tuple[int, int, int | None, int]]] = defaultdict(list)
    for sp in spans:
        pieces[id(sp.record)].append((sp.at, sp.length, sp.source, sp.source_at))
    for at, n, record in pads:
        pieces[id(record)].append((at, n, None, 0))
    whole = {}
    for record in records:
        mine, at = sorted(pieces.get(id(record), ())), record.data_offset
        for start, n, _source, _source_at in mine:
            if start != at:
                break
            at += n
        else:
            if mine and at == record.data_offset + record.size and record.crc is not None:
                whole[id(record)] = mine
    return whole


def _crc_of_replaced(pieces: list[tuple[int, int, int | None, int]], new: dict[tuple[int, int], int]) -> int:
    """The output's CRC-32 of a record replaced whole by `pieces` (`_replaced_whole`): its spans' (`new`: by
    source and first byte there) and its padding's zeros, combined in file order."""
    value = 0
    for _at, n, source, source_at in pieces:
        value = crc.combine(value, crc.zeros(n) if source is None else new[source, source_at], n)
    return value


def _by_record(records: list[Record], parts: list, spans: list[Replacement]) -> dict[int, list] | None:
    """The base's parts the output keeps (`_parts`), by the record they lie in (its data_offset): each lies in
    one, a flat tensor's. None where one lies outside them or a span overlaps one: their CRC-32s are then taken
    apart."""
    starts = [r.data_offset for r in records]
    found: defaultdict[int, list] = defaultdict(list)
    for at, n, part in parts:
        i = bisect.bisect_right(starts, at) - 1
        if i < 0 or at + n > records[i].data_offset + records[i].size:
            return None
        found[records[i].data_offset].append((at, n, part))
    every = sorted([(at, n) for at, n, _part in parts] + [(sp.at, sp.length) for sp in spans])
    if any(a + n > b for (a, n), (b, _m) in zip(every, every[1:])):
        return None
    return found


def _clone(fin: int, fout: int, fds: dict[int, int], spans: list[Replacement],
           counter: ByteCounter) -> tuple[int | None, str | None]:
    """Which file the output starts as a clone of where the filesystem shares blocks (`cloning`; not with
    `--no-clone`): the base's (0) where the spans replace little enough of it (`worth_it`); else a full source
    that gives at least half of it, every span of it lying where it lies in the base's file, in a file of the
    base's size (every row taken from one checkpoint of the run: its flat tensors lie where the base's do), its
    spans then kept where they are and the base's bytes written over the clone. And how; (None, None): none,
    every byte is written. Every byte either way is read and checked as if written."""
    if not counter.options.clone:
        return None, None
    size = os.fstat(fin).st_size
    if worth_it(sum(sp.length for sp in spans), size):
        s = 0
    else:
        given: Counter[int] = Counter()
        for sp in spans:
            given[sp.source] += sp.length
        s, n = given.most_common(1)[0]  # (spans: half the file or more)
        if (s not in fds or worth_it(n, size) or os.fstat(fds[s]).st_size != size
                or not all(sp.source_at == sp.at and sp.check is None for sp in spans if sp.source == s)):
            return None, None
    how = clone(fds[s] if s else fin, fout)
    return (s, how) if how is not None else (None, None)


def _parts(reader: RankReader, slots: list) -> list[tuple[int, int, tuple[str, str, tuple[int, int]]]]:
    """(first byte, length, part) of every slice the output takes from one source (its `slots`), in that
    source's file (`reader`'s: the base's own, a full source's optim file or a partial's rows file), key by
    key in slot order, keyed by the part of its row it is (`compose.taken.Parts`)."""
    return [(at, slot.valid * 4, (slot.row, key, (slot.group, slot.offset)))
            for key in reader.keys() for slot, at in zip(slots, reader.starts(key, slots))]


def _row_places(parts: list) -> list[list]:
    """[row, first byte, length] of the slices `parts` (`_parts`), neighbouring slices of one row and key
    joined (what the census counts: fewer, larger regions)."""
    places: list[list] = []
    last, last_key = None, None
    for at, n, (row, key, _where) in parts:
        if last is not None and key == last_key and last[0] == row and last[1] + last[2] == at:
            last[2] += n
        else:
            last, last_key = [row, at, n], key
            places.append(last)
    return places


def _in_step(spans: list[Replacement]) -> dict[int, list[tuple[int, Record, int]]]:
    """The source records read in step with the base's record they replace ranges of, chunk by
    chunk at the same place, so that each chunk is copied right after it was read and checked:
    {id(base record): [(source, its record, its offsets minus the base record's)]}. A record
    qualifies when it has a CRC-32 (zip), the base record's size, and all its spans lie in that one
    record at that one distance: the same layout, as every full source of a run has."""
    by_record: defaultdict[int, list[Replacement]] = defaultdict(list)
    for sp in spans:
        if sp.source_record is not None:
            by_record[id(sp.source_record)].append(sp)
    steps: defaultdict[int, list[tuple[int, Record, int]]] = defaultdict(list)
    for mine in by_record.values():
        q, r = mine[0].source_record, mine[0].record
        assert q is not None, "by_record holds spans from a full source's record only"
        delta = q.data_offset - r.data_offset
        if q.crc is not None and q.size == r.size and all(sp.record is r and sp.source_at - sp.at == delta
                                                           for sp in mine):
            steps[id(r)].append((mine[0].source, q, delta))
    return steps


class _Sweep:
    """Writes the output front to back, in the kernel (`copy_to`): the base's bytes, and over them
    each span's from its source. Called chunk by chunk right after that chunk of the base and of
    the sources in step was read and checked (`read`), the copy finds those bytes in the CPU's
    cache. A partial's slice is read whole and checked against its rows file's CRC-32 first.
    `clone_of`: the output is a clone of that file already (`cloning`; None: it is not). Of the base's (0):
    the base's bytes are kept where they are, shared (`kept` counts them), and only the spans are written; of
    a source's (`_clone`): its spans are kept, the base's bytes and the other spans written."""

    def __init__(self, fin: int, fout: int, spans: list[Replacement], fds: dict[int, int], counter: ByteCounter, *,
                 clone_of: int | None = None, zeroed: list[tuple[int, int]] | None = None):
        self.fin, self.fout, self.spans, self.fds, self.counter = fin, fout, spans, fds, counter
        self.clone_of = clone_of
        # [start, end) of the base's records replaced whole (`_replaced_whole`): between their spans (their
        # padding), zeros are written, not the base's bytes (never read)
        self.zeroed = zeroed or []
        self._zeroed_starts = [a for a, _b in self.zeroed]
        self.kept = 0
        self.writeback = Writeback(fout, counter.options.durable)
        self.buffer = memoryview(bytearray(READ_CHUNK))
        self.written, self._j = 0, 0  # the output is written up to `written`; spans before _j lie behind
        self.ahead: dict[int, tuple[Readahead, int]] = {}  # per file read in order: its readahead, its size

    def read(self, fd: int, offset: int, n: int, crcs: RangeCrcs, census: Looks, *, also=None) -> None:
        """Read `n` bytes at `offset` of `fd`: fed to the CRC-32s, the census and `also`. The kernel reads
        ahead of this sequential reader (`Readahead`): a cold file comes at the disk's rate, while this
        process checks what it has."""
        if fd not in self.ahead:
            self.ahead[fd] = (Readahead(fd), os.fstat(fd).st_size)
        ahead, end = self.ahead[fd]
        ahead.before(offset, end)
        view = self.buffer[:n]
        pread_into(fd, view, offset)
        crcs.feed(view)
        census.inspect(offset, view)
        if also is not None:
            also(offset, view)
        self.counter.add(n)

    def copy_to(self, end: int, new: dict, census: dict) -> None:
        """Write the output up to `end`."""
        spans = self.spans
        while self.written < end:
            at = self.written
            while self._j < len(spans) and spans[self._j].at + spans[self._j].length <= at:
                self._j += 1
            sp = spans[self._j] if self._j < len(spans) else None
            if sp is None or sp.at > at:  # the base's bytes, up to the next span
                stop = end if sp is None else min(end, sp.at)
                fd, source_at = self.fin, at
                i = bisect.bisect_right(self._zeroed_starts, at) - 1
                if i >= 0 and at < self.zeroed[i][1]:  # padding of a record replaced whole
                    stop = min(stop, self.zeroed[i][1])
                    pwrite_all(self.fout, bytes(stop - at), at)
                    self.counter.add(stop - at)
                    self.written = stop
                    continue
                if self.clone_of == 0:  # the clone holds them already
                    self._keep(stop)
                    continue
            elif sp.source == self.clone_of:  # the clone of its source's file holds it already
                self._keep(min(end, sp.at + sp.length))
                continue
            else:
                if sp.check is not None and at == sp.at:  # a partial's slice: checked whole first
                    value = crc_range(self.fds[sp.source], sp.source_at, sp.length, self.buffer,
                                      on_bytes=self.counter.add, inspect=census[sp.source].inspect)
                    sp.check.check(value)
                    new[sp.source, sp.source_at] = value
                stop = min(end, sp.at + sp.length)
                fd, source_at = self.fds[sp.source], sp.source_at + at - sp.at
            copy_range(fd, self.fout, source_at, stop - at, on_bytes=self.counter.add, out_offset=at,
                       writeback=self.writeback)
            self.written = stop

    def _keep(self, stop: int) -> None:
        """The output up to `stop` is the clone's already (shared)."""
        self.counter.add(stop - self.written)
        self.kept += stop - self.written
        self.written = stop


def _pads(padding, base: dict, keys: tuple[str, ...]) -> list[tuple[int, int, Record]]:
    """(at, length, record) of the padding (`RankJob.padding`) of each flat tensor (`keys`), in file order."""
    return sorted((base[g, key].offset + offset * base[g, key].itemsize, length * base[g, key].itemsize,
                   base[g, key].record) for key in keys for g, offset, length in padding)


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


def _coalesced(spans: list[Replacement]) -> list[Replacement]:
    """Spans in file order, neighbours from the same source and records joined into one
    (the params of a layer lie side by side in both files: one copy, one CRC step)."""
    joined: list[Replacement] = []
    last, length = None, 0  # the span being extended, and its length so far
    for span in sorted(spans, key=lambda s: s.at):
        if (last is not None and span.check is None and span.at == last.at + length and span.source == last.source
                and span.record is last.record and span.source_record is last.source_record
                and span.source_at == last.source_at + length):
            length += span.length
            continue
        if last is not None:
            joined.append(last if length == last.length else last._replace(length=length))
        last, length = span, span.length
    if last is not None:
        joined.append(last if length == last.length else last._replace(length=length))
    return joined
