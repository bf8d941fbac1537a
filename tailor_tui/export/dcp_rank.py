"""One source rank's share of a DCP export: its `.distcp` file (a worker's task).

Every chunk's archive is laid out as the plan laid it (`dcp.chunks.tensor_chunk`, at the offset the
metadata names); its bytes are written as the rank's bytes stream by: each sub-group's flat tensor a
job takes from is read once, whole, through a 1 MiB buffer and checked against the CRC-32 its archive
stores (a rotten source is refused, never exported), a partial save's slices each against the CRC-32
recorded for it, frozen fragments (cast to fp32) and buffers (as stored) from model_states likewise.
Each chunk's CRC-32 is computed from the bytes written, in order, and set in its archive last.
Memory: the buffer and one chunk's cast, whatever the sizes. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Sequence

from tailor_tui.checked.evidence import checked_crcs
from tailor_tui.checked.ranges import READ_CHUNK, crc_range
from tailor_tui.dcp.chunks import tensor_chunk
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import Folder, Writeback, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats.dtypes import BY_NAME, cast
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.kinds.base import rank_reader
from tailor_tui.planning.dcp_layout import DcpJob, Piece


class _Chunks:
    """The job's chunks being written into its file: each archive laid out, its data written as its source
    bytes go by (cast), its CRC-32 kept as they are and set when all are written."""

    def __init__(self, fd: int, durable: bool):
        self.fd = fd
        self.writeback = Writeback(fd, durable)  # the file is laid out in the order it is written
        self.crcs: dict[int, tuple[int, tuple[int, ...]]] = {}  # archive offset -> (CRC-32 so far, CRC offsets)
        self.data_at: dict[int, int] = {}

    def lay(self, piece: Piece, dtype: str) -> None:
        archive = tensor_chunk(dtype, piece.sizes)
        archive.write_into(self.fd, piece.at)
        data, crc_offsets = archive.reserved_at(0)
        self.data_at[piece.at] = piece.at + data
        self.crcs[piece.at] = (0, crc_offsets)

    def stream(self, path: Path, pieces: Sequence[Piece], start: int, src: str, out: str, *, given: bool = True):
        """For a source tensor lying from byte `start` of `path` (dtype `src`), whose pieces are written cast to
        `out`: `inspect(offset, chunk)`, to be shown its bytes in order; the sorted, disjoint byte ranges the
        pieces take (a tied name's are its parameter's); and `taken(crcs)`, to be given the CRC-32 of each of
        those ranges as read (then a piece written as it lies has its CRC-32 without computing it again; not
        `given`: each piece's is computed as it is written)."""
        own = src != out or not given
        size, out_size = BY_NAME[src].itemsize, BY_NAME[out].itemsize
        if src != out and {src, out} - {"float32", "bfloat16", "float16"}:
            raise CheckpointError(f"{path}: holds {src} values where weights were expected; the file is from "
                                  "another run or layout")
        wanted = sorted(((start + p.first * size, p) for p in pieces), key=lambda w: w[0])
        for p in pieces:
            self.lay(p, out)
        ranges = sorted({(at, p.count * size) for at, p in wanted})
        first = 0  # the first piece not yet wholly behind the bytes shown (they are shown in order)

        def inspect(offset: int, chunk: memoryview) -> None:
            nonlocal first
            end = offset + len(chunk)
            while first < len(wanted) and wanted[first][0] + wanted[first][1].count * size <= offset:
                first += 1
            for at, p in wanted[first:]:
                if at >= end:
                    break
                lo, hi = max(at, offset), min(at + p.count * size, end)
                if lo < hi:
                    values = cast(chunk[lo - offset: hi - offset], src, out) if src != out \
                        else chunk[lo - offset: hi - offset]
                    written = self.data_at[p.at] + (lo - at) // size * out_size
                    pwrite_all(self.fd, values, written)
                    self.writeback.advance(written + len(values))
                    if own:
                        crc, offsets = self.crcs[p.at]
                        self.crcs[p.at] = (zlib.crc32(values, crc), offsets)

        def taken(crcs: Sequence[int]) -> None:
            if not own:
                by_range = dict(zip(ranges, crcs, strict=True))
                for at, p in wanted:
                    self.crcs[p.at] = (by_range[at, p.count * size], self.crcs[p.at][1])

        return inspect, ranges, taken

    def finish(self) -> None:
        for at, (crc, offsets) in self.crcs.items():
            for offset in offsets:
                pwrite_all(self.fd, struct.pack("<I", crc), at + offset)


def export_dcp_rank(job: DcpJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                    options: TaskOptions = TaskOptions()) -> None:
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    buffer = memoryview(bytearray(READ_CHUNK))
    with contextlib.ExitStack() as stack:
        try:
            out = _Chunks(open_fd(stack, out_dir / job.out_file, os.O_WRONLY), options.durable)
        except OSError as exc:
            raise output_error(exc, out_dir / job.out_file) from None
        reader = rank_reader(job.files, job.group_sizes)
        if job.flat:
            located = reader.fp32_whole_flat("a DCP export needs")
            assert located is not None, "a job with sub-groups reads whole records (a full save's optim file)"
            fd = open_fd(stack, reader.path)
            for g, key, pieces in job.flat:
                tb = located[g, key]
                _fits(reader.path, tb.record.name, tb.numel, pieces)
                inspect, ranges, taken = out.stream(reader.path, pieces, tb.offset, "float32", "float32")
                taken(checked_crcs(fd, reader.path, tb.record, ranges, buffer, on_bytes=counter.add, inspect=inspect))
        if job.saved:
            fd = open_fd(stack, reader.path)
            for param, key, count, pieces in job.saved:
                place = reader.place(key, param=param, group=None, offset=0, valid=count)
                assert place.slice is not None, "a partial save's place names its slice"
                # its slice is checked whole: each piece's CRC-32 is computed as it is written
                inspect, _ranges, _taken = out.stream(reader.path, pieces, place.at, "float32", "float32",
                                                      given=False)
                place.slice.check(crc_range(fd, place.at, count * 4, buffer, on_bytes=counter.add, inspect=inspect))
        if job.frozen or job.buffers:
            fd = open_fd(stack, job.files.model_states)
            fragments = reader.fragments([name for name, _pieces in job.frozen]) if job.frozen else {}
            for name, pieces in job.frozen:
                tb = fragments[name]
                _fits(job.files.model_states, tb.record.name, tb.numel, pieces)
                inspect, ranges, taken = out.stream(job.files.model_states, pieces, tb.offset, dtype_name(tb.dtype),
                                                    "float32")
                taken(checked_crcs(fd, job.files.model_states, tb.record, ranges, buffer, on_bytes=counter.add,
                                     inspect=inspect))
            for name, dtype, pieces in job.buffers:
                tb = reader.buffer(name)
                if dtype_name(tb.dtype) != dtype:
                    raise CheckpointError(f"{job.files.model_states}: buffer {name} is {dtype_name(tb.dtype)}, not "
                                          f"{dtype} as planned; the file changed since")
                _fits(job.files.model_states, tb.record.name, tb.numel, pieces)
                inspect, ranges, taken = out.stream(job.files.model_states, pieces, tb.offset, dtype, dtype)
                taken(checked_crcs(fd, job.files.model_states, tb.record, ranges, buffer, on_bytes=counter.add,
                                     inspect=inspect))
        out.finish()
        fsync(out.fd, options.durable)
    counter.finish()


def _fits(path: Path, record: str, numel: int, pieces: Sequence[Piece]) -> None:
    for p in pieces:
        if p.first + p.count > numel:
            raise CheckpointError(f"{path}: {record} holds {numel} elements, the layout needs {p.first + p.count}; "
                                  "the file is from another run or layout")
