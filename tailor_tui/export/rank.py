"""One source rank's share of an export: read, check, cast, write into place (a worker's task).

Each sub-group's flat fp32 buffer a job takes from is read once, whole, through a 1 MiB buffer
and checked against the CRC-32 its archive stores (a rotten source is refused, never exported);
as each chunk goes by, the slices the job takes are cast to the export's dtype and written
straight to their place in the output files (`export_plan`, `safetensors_out`). Frozen
parameters' fragments and persistent buffers (model_states) likewise, buffers as stored; a
partial checkpoint's saved slices are read where its rows file holds them (each checked against
its recorded CRC-32). Memory: the buffer and one chunk's cast, whatever the size.

Casts are those of torch's `Tensor.to` (`formats.dtypes.cast`). Torch-free (numpy).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Sequence

from tailor_tui.checked.evidence import checked_crcs
from tailor_tui.checked.ranges import READ_CHUNK, crc_range
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.export.export_plan import ExportJob, Span
from tailor_tui.fileio import Folder, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats.dtypes import BY_NAME, FLOATS, cast, float_name
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.kinds.base import rank_reader


def export_rank(job: ExportJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                options: TaskOptions = TaskOptions()) -> None:
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    buffer = memoryview(bytearray(READ_CHUNK))
    with contextlib.ExitStack() as stack:
        outputs: dict[str, int] = {}

        def out_fd(name: str) -> int:
            if name not in outputs:
                try:
                    outputs[name] = open_fd(stack, out_dir / name, os.O_WRONLY)
                except OSError as exc:
                    raise output_error(exc, out_dir / name) from None
            return outputs[name]

        reader = rank_reader(job.files, job.group_sizes)
        if job.groups:
            located = reader.whole_flat()
            assert located is not None, "a job with sub-groups reads whole records (a full save's optim file)"
            fd = open_fd(stack, reader.path)
            for g, spans in job.groups:
                flat = located[g, "fp32"]
                if dtype_name(flat.dtype) != "float32":
                    raise CheckpointError(f"{reader.path}: sub-group {g}'s master weights are "
                                          f"{dtype_name(flat.dtype)}, not fp32; the file is not a ZeRO-3 optimizer state")
                _stream(fd, reader.path, flat, spans, "float32", job.out_dtype, out_fd, buffer, counter)
        if job.frozen:
            fragments = reader.fragments([name for name, _span in job.frozen])
            fd = open_fd(stack, job.files.model_states)
            for name, span in job.frozen:
                tb = fragments[name]
                _stream(fd, job.files.model_states, tb, [span], dtype_name(tb.dtype), job.out_dtype, out_fd, buffer,
                        counter)
        if job.buffers:
            fd = open_fd(stack, job.files.model_states)
            for name, span in job.buffers:
                tb = reader.buffer(name)
                kind = dtype_name(tb.dtype)
                _stream(fd, job.files.model_states, tb, [span], kind, kind, out_fd, buffer, counter)
        if job.saved:  # (the header was checked against the file's size: no slice runs past its end)
            fd = open_fd(stack, reader.path)
            out_size = BY_NAME[float_name(job.out_dtype)].itemsize
            for name, span in job.saved:
                place = reader.place("fp32", param=name, group=None, offset=0, valid=span.count)
                saved = place.slice
                assert saved is not None, "a partial save's place names its slice"

                def write_cast(offset: int, chunk: memoryview, span=span, begin=place.at) -> None:
                    pwrite_all(out_fd(span.out_file), cast(chunk, "float32", job.out_dtype),
                               span.out_offset + (offset - begin) // 4 * out_size)

                saved.check(crc_range(fd, place.at, span.count * 4, buffer, on_bytes=counter.add,
                                       inspect=write_cast))
        for fd in outputs.values():
            fsync(fd, options.durable)
    counter.finish()


def _stream(fd: int, path: Path, tensor, spans: Sequence[Span], src: str, out: str, out_fd, buffer: memoryview,
            counter: ByteCounter) -> None:
    """Read `tensor`'s record whole (CRC-32 checked); write each span's elements, cast, to its place."""
    if src != float_name(out) and src not in FLOATS:
        raise CheckpointError(f"{path}: {tensor.record.name} holds {src} values where weights were expected; "
                              "the file is from another run or layout")
    itemsize = tensor.itemsize
    out_size = BY_NAME[float_name(out)].itemsize if float_name(out) in FLOATS else itemsize
    wanted = sorted((tensor.offset + s.first * itemsize, s) for s in spans)
    for _at, s in wanted:
        if s.first + s.count > tensor.numel:
            raise CheckpointError(f"{path}: {tensor.record.name} holds {tensor.numel} elements, the layout needs "
                                  f"{s.first + s.count}; the file is from another run or layout")

    def inspect(offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        for at, s in wanted:
            stop = at + s.count * itemsize
            lo, hi = max(at, offset), min(stop, end)
            if lo < hi:
                values = cast(chunk[lo - offset: hi - offset], src, out)
                pwrite_all(out_fd(s.out_file), values, s.out_offset + (lo - at) // itemsize * out_size)

    # the ranges too: a legacy-format record has no CRC-32, and then only they are read
    checked_crcs(fd, path, tensor.record, [(at, s.count * itemsize) for at, s in wanted], buffer, on_bytes=counter.add,
                 inspect=inspect)
