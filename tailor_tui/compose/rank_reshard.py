"""Writing one output rank's files of a resharded composition, streamed, torch-free.

Each big tensor of the output is one record; its pieces (`reshard`) are byte ranges of the
sources' rank files, or zeros. First every record of a source that a piece comes from is read
once and checked against the CRC-32 its archive stores, and every slice of a partial save a
piece comes from against the CRC-32 its save recorded (a corrupt source is refused, never
carried over under a fresh CRC); that pass gives each piece's CRC and counts the non-finite
values the output takes. Then the rank's two files are written as the run's `Skeleton` has
them, the big tensors' space reserved; every piece is copied into place in the kernel
(copy_file_range) and each output record's CRC-32 is put together from its pieces' CRCs
(`crc.combine`): no byte is read twice into user space. A rank of small pieces (a wide world
size of a small model) keeps the checked bytes of its pieces and writes each small record at
once instead. Both files are fsynced (unless --no-fsync). Memory: a 1 MiB buffer, and at most
KEEP_BYTES of small pieces.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

from tailor_tui.checked import crc
from tailor_tui.checked.evidence import read_and_check
from tailor_tui.checked.ranges import READ_CHUNK, crc_range, pread_into
from tailor_tui.compose.taken import FROZEN, Parts, RankComposed, rows_taken, written
from tailor_tui.errors import OutputError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import Folder, OpenFiles, Target, Writeback, copy_range, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats.nonfinite import EXPONENT, Census, Region
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.kinds.base import RankBytes, RankReader, dtype_mismatch, rank_reader
from tailor_tui.resharding.partition import ZEROS, Piece, ReshardJob
from tailor_tui.resharding.skeleton import Skeleton, write_rank_file


def reshard_rank(job: ReshardJob, out_tag_dir: Folder, skeleton: Skeleton, emit: Emit, cancelled: Callable[[], bool],
                 options: TaskOptions = TaskOptions()) -> RankComposed:
    """Write output rank `job.rank`'s optim_states and model_states in `out_tag_dir` (each as
    `skeleton` has it, its big tensors filled from their pieces); the non-finite values each
    row's pieces hold, counted as the sources are checked (before anything is written), and the
    CRC-32s of what each row took (`compose.taken`: from its pieces')."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    buffer = memoryview(bytearray(READ_CHUNK))
    with contextlib.ExitStack() as stack:
        sources = _Sources(job, stack)
        optim = [(g, key, [(p, sources.place(p, key)) for p in pieces])
                 for g, pieces in enumerate(map(_joined_zeros, job.groups)) for key in job.keys]
        frozen = [(name, FROZEN, [(p, sources.place(p, FROZEN)) for p in _joined_zeros(pieces)])
                  for name, pieces in job.frozen]
        checked, nonfinite = _check([*optim, *frozen], sources, counter, buffer)

        path = out_tag_dir / job.optim_states
        archive, records = write_rank_file(path, skeleton.optim, buffer)
        flat = {where: hole.located(records, archive) for where, hole in skeleton.flat.items()}
        _write(path, [(flat[g, key], key, placed) for g, key, placed in optim], checked, sources, counter)
        path = out_tag_dir / job.model_states
        archive, records = write_rank_file(path, skeleton.model, buffer)
        fragments = {name: hole.located(records, archive) for name, hole in skeleton.fragments.items()}
        _write(path, [(fragments[name], key, placed) for name, key, placed in frozen], checked, sources, counter)
        archives = written(out_tag_dir / job.optim_states, out_tag_dir / job.model_states)
    counter.finish()
    parts: Parts = {}
    for where, key, placed in [*((g, key, placed) for g, key, placed in optim),
                               *((i, key, placed) for i, (_name, key, placed) in enumerate(frozen))]:
        for piece, place in placed:
            if place is not None:
                n = piece.length * place.itemsize
                parts[piece.row, key, (where, piece.at)] = checked.crcs[place.path, place.at, n], n
    return RankComposed(job.rank, nonfinite, rows_taken(parts), archives)


class _Sources:
    """The source rank files a job reads: opened once, their tensors located once."""

    def __init__(self, job: ReshardJob, stack: contextlib.ExitStack):
        self.job, self.stack = job, stack
        self.fd = OpenFiles(stack).fd
        self.readers: dict[tuple[int, int], RankReader] = {}
        self.frozen = sorted({p.param for _n, ps in job.frozen for p in ps})  # the fragments any piece takes

    def reader(self, source: int, rank: int) -> RankReader:
        if (source, rank) not in self.readers:
            reader = rank_reader(self.job.files[source, rank], self.job.source_sizes[source])
            reader.check_keys(self.job.keys)
            self.readers[source, rank] = reader
        return self.readers[source, rank]

    def to_verify(self) -> dict[Path, set]:
        """{file: its records to read whole} of the source files this job checks (`ReshardJob.verifies`):
        a full source's every flat tensor, and every frozen fragment, whichever job takes from them; another source's
        files (a partial save's, a DCP checkpoint's), each slice or chunk this job takes checked as it is read."""
        found: dict[Path, set] = {}
        frozen_of: dict[tuple[int, int], list[str]] = {}  # the frozen fragments each source rank gives this job
        for name, pieces in self.job.frozen:
            for u in sorted({(p.source, p.rank) for p in pieces if p.source != ZEROS}):
                frozen_of.setdefault(u, []).append(name)
        for s, r in sorted(self.job.verifies):
            reader = self.reader(s, r)
            flat = reader.whole_flat()  # (a partial's slices: each job checks those it takes from)
            found.setdefault(reader.path, set()).update(tb.record for tb in (flat or {}).values())
            for path in reader.paths():  # (a DCP checkpoint's chunks: in files of their own)
                found.setdefault(path, set())
            # a full file: all its fragments, by the one job checking it; else those this job takes from it (a DCP
            # checkpoint gives none)
            frozen = [name for name, _pieces in self.job.frozen] if reader.files.whole_records else \
                frozen_of.get((s, r), [])
            if frozen:
                fragments = reader.fragments(frozen)
                found.setdefault(reader.files.model_states, set()).update(tb.record for tb in fragments.values())
        return found

    def place(self, piece: Piece, key: str) -> RankBytes | None:
        """Where a piece's bytes lie in its source (None: zeros)."""
        if piece.source == ZEROS:
            return None
        reader = self.reader(piece.source, piece.rank)
        if key == FROZEN:
            tb = reader.fragments([piece.param])[piece.param]
            return RankBytes(reader.files.model_states, tb.offset + piece.offset * tb.itemsize, tb.record, tb.dtype,
                             tb.itemsize)
        return reader.place(key, param=piece.param, group=piece.group, offset=piece.offset - piece.within,
                            valid=piece.whole, within=piece.within, count=piece.length)


def _joined_zeros(pieces) -> list[Piece]:
    """`pieces` with each run of neighbouring padding pieces joined into one (a small parameter
    is all padding on most ranks of a wide run: one step for the run instead of one each)."""
    joined: list[Piece] = []
    run, length = None, 0  # the padding run being joined, and its length so far
    for p in pieces:
        if p.source == ZEROS:
            run, length = (p, p.length) if run is None else (run, length + p.length)
            continue
        if run is not None:
            joined.append(run if length == run.length else run._replace(length=length))
            run = None
        joined.append(p)
    if run is not None:
        joined.append(run if length == run.length else run._replace(length=length))
    return joined


def _check(fills: list, sources: _Sources, counter: ByteCounter, buffer: memoryview) -> tuple[Checked, Counter]:
    """Read every source record a piece comes from once, checking its stored CRC-32: the CRC
    of each piece's bytes {(file, first byte, length): crc} (and the bytes themselves, where a
    job's pieces are few enough to keep), and the non-finite values per row."""
    ranges: dict[Path, set] = defaultdict(set)
    slices: dict[Path, dict] = defaultdict(lambda: defaultdict(set))  # partial slices: the pieces in each
    regions: dict[Path, list] = defaultdict(list)
    for _target, _key, placed in fills:
        for piece, place in placed:
            if place is None:
                continue
            n = piece.length * place.itemsize
            if place.slice is not None:
                slices[place.path][place.slice].add((place.at, n))
            else:
                ranges[place.path].add((place.record, place.at, n))
            if dtype_name(place.dtype) in EXPONENT:  # floats: counted for the guard
                regions[place.path].append(Region(place.at, n, piece.row, dtype_name(place.dtype)))
    verifies = sources.to_verify()  # path -> every record of it to check (a partial's rows file: its slices)
    alone = {path: sorted({(at, n) for _r, at, n in found}) for path, found in ranges.items() if path not in verifies}
    keep = sum(n for wanted in alone.values() for _at, n in wanted) <= KEEP_BYTES
    result = Checked({}, {})
    crcs = result.crcs
    nonfinite: Counter[str] = Counter()
    for path in sorted(ranges.keys() | slices.keys() | verifies.keys()):
        census = Census(regions[path])
        fd = sources.fd(path)
        if path not in verifies:  # another job checks this full file's records: the pieces alone are read
            _read_pieces(fd, path, alone[path], buffer, counter, census, result, keep)
        else:
            checked = {(r, at, n) for r, at, n in ranges[path] if r is not None}
            records = {r for r, _at, _n in checked} | verifies[path]
            found = read_and_check(fd, path, records, checked, buffer, counter=counter, census=census)
            crcs.update({(path, at, n): value for (at, n), value in found.items()})
            for piece_slice, inside in slices[path].items():  # a partial checkpoint's slices
                found = piece_slice.read_checked(fd, sorted(inside), buffer, counter.add, census.inspect)
                crcs.update({(path, at, n): value for (at, n), value in found.items()})
        nonfinite += census.counts
    return result, nonfinite


class Checked(NamedTuple):
    """What reading the sources found: each piece's CRC-32, and the bytes of those kept."""

    crcs: dict  # (file, first byte, length) -> CRC-32
    kept: dict  # (file, first byte, length) -> bytes, as checked


# A job keeps the bytes of the pieces it reads alone (not as part of records it checks whole)
# when they are this few: a wide run's small ranks are then written from memory, a record at a
# time, instead of a copy per piece. Reads of pieces less than GAP_BYTES apart are joined (a
# read of the gap costs less than another read).
KEEP_BYTES = 8 << 20
GAP_BYTES = 32 << 10


def _read_pieces(fd: int, path: Path, wanted: list, buffer: memoryview, counter: ByteCounter, census: Census,
                 checked: Checked, keep: bool) -> None:
    """The CRC-32 of each (first byte, length) in `wanted` (sorted) of `path`, and its bytes if
    `keep`; neighbours share one read of the buffer, one larger than the buffer is streamed."""
    i = 0
    while i < len(wanted):
        start, end, j = wanted[i][0], wanted[i][0], i
        while (j < len(wanted) and wanted[j][0] - end <= GAP_BYTES
               and max(end, wanted[j][0] + wanted[j][1]) - start <= len(buffer)):
            end, j = max(end, wanted[j][0] + wanted[j][1]), j + 1
        if j == i:  # larger than the buffer
            at, n = wanted[i]
            checked.crcs[path, at, n] = crc_range(fd, at, n, buffer, on_bytes=counter.add,
                                                    inspect=census.inspect)
            i += 1
            continue
        view = buffer[: end - start]
        pread_into(fd, view, start)
        census.inspect(start, view)  # (it counts inside the pieces' regions only, not in the gaps)
        for at, n in wanted[i:j]:
            piece = view[at - start: at - start + n]
            checked.crcs[path, at, n] = crc.crc32(piece)
            if keep:
                checked.kept[path, at, n] = bytes(piece)
        counter.add(sum(n for _at, n in wanted[i:j]))
        i = j


def _write(out: Target, fills: list, checked: Checked, sources: _Sources, counter: ByteCounter) -> None:
    """Copy each (output tensor, key, placed pieces) of `out` into place, set each output
    record's CRC-32 from its pieces' (`_check` gave them), and fsync `out` (unless --no-fsync)."""
    steps = []
    for target, key, placed in fills:
        record = target.record
        if target.offset != record.data_offset or target.numel * target.itemsize != record.size:
            raise OutputError(f"{out}: tensor {record.name} does not fill its record (internal error)")
        if sum(p.length for p, _place in placed) != target.numel:
            raise OutputError(f"{out}: the pieces of {record.name} do not cover it (internal error)")
        for piece, place in placed:
            if place is not None and (place.dtype, place.itemsize) != (target.dtype, target.itemsize):
                raise dtype_mismatch(place.path, key, piece.group if piece.group >= 0 else 0, place.dtype,
                                     target.dtype)
        steps.append((record, target, placed))
    try:
        with contextlib.ExitStack() as stack:
            fout = open_fd(stack, out, os.O_RDWR)
            writeback = Writeback(fout, counter.options.durable)
            for record, target, placed in steps:
                if record.size <= READ_CHUNK and all(
                        place is None or (place.path, place.at, p.length * target.itemsize) in checked.kept
                        for p, place in placed):
                    value = _write_whole(fout, record, target, placed, checked.kept, counter)
                else:
                    value = _copy_pieces(fout, target, placed, checked.crcs, sources, counter, writeback)
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", value), at)
            fsync(fout, counter.options.durable)
    except OSError as exc:
        raise output_error(exc, out) from None


def _copy_pieces(fout: int, target, placed: list, crcs: dict, sources: _Sources, counter: ByteCounter,
                 writeback: Writeback) -> int:
    """Copy a record's pieces into place in the kernel; its CRC-32, put together from the pieces'."""
    value = 0
    for piece, place in placed:
        at, n = target.offset + piece.at * target.itemsize, piece.length * target.itemsize
        if place is None:  # padding: zeros, as DeepSpeed's own saves hold; the skeleton
            # reserved the tensor's space as a hole of a new file, which reads as zeros
            value = crc.combine(value, crc.zeros(n), n)
            counter.add(n)
        else:
            copy_range(sources.fd(place.path), fout, place.at, n, on_bytes=counter.add, out_offset=at,
                       writeback=writeback)
            value = crc.combine(value, crcs[place.path, place.at, n], n)
    return value


def _write_whole(fout: int, record, target, placed: list, kept: dict, counter: ByteCounter) -> int:
    """Write a small record at once from the pieces' bytes kept as they were checked (zeros
    where padding); its CRC-32. The bytes are the checked ones: their CRC is the pieces' combined."""
    data = bytearray(record.size)
    for piece, place in placed:
        if place is not None:
            at, n = piece.at * target.itemsize, piece.length * target.itemsize
            data[at: at + n] = kept[place.path, place.at, n]
    pwrite_all(fout, data, target.offset)
    counter.add(len(data))
    return crc.crc32(data)
