"""Torch-format weight files composed per row: `pytorch_model.bin`, its shards, `adapter_model.bin`.

transformers 4.x (`save_safetensors=False`) and PEFT write weights with torch.save: a zip
archive whose pickle maps each tensor name to a tensor, each on a storage record of its own
(tied names share one). An output file is the base's archive — the same pickle, so the same
names, shapes, dtypes and storage layout — with the record of every storage whose tensors
belong to a row picked elsewhere copied from that source's record of the same tensor, written
by the torch-free writer (`ptwrite`) as torch.save writes it; every record copied, the base's
and the sources', has its stored CRC-32 checked on the way. A storage shared by tensors of rows
with different sources, or a source tensor of another shape, dtype or layout, is refused.
Where the filesystem shares blocks (`cloning`), the output is instead a clone of the base's file
with the picked records written over in place (`_patch_clone`): the base's pickle and other
records are kept, each read once and checked against its stored CRC-32 all the same. Either way the
CRC-32 of each storage taken from a source, as written, is what the file took, and the listing of
the output's records (`FileComposed`: for `--verify`).
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Callable, Mapping

from tailor_tui.checked.evidence import checked_crcs
from tailor_tui.checked.ranges import READ_CHUNK
from tailor_tui.cloning import clone, worth_it
from tailor_tui.compose.taken import FileComposed, written
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import CREATE, Folder, OpenFiles, Target, copy_range, fsync, open_fd, output_error, path_of
from tailor_tui.formats.ptfile import Record, file_format, read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes
from tailor_tui.formats.ptwrite import Copied, write_archive
from tailor_tui.planning.jobs import BinFileJob


def compose_bin_file(job: BinFileJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                   options: TaskOptions = TaskOptions()) -> FileComposed:
    """Write one torch-format weight file: the base's, every storage of a row picked elsewhere
    copied from its source's record of the same tensor. Returns what it took: the CRC-32 of each storage
    taken from a source, under the name of each tensor on it."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    obj, records, prefix = read_structure(job.base_file)
    data, storages = dumps(obj, location=None)
    users: dict[int, list[str]] = {}
    for name, tensor in obj.items():
        users.setdefault(id(tensor.storage), []).append(name)
    fills, replaced = [], []  # replaced: (the base's record, the source's Copied that takes its place)
    taken: dict[int, list[str]] = {}  # storage key (in the output) -> its tensors' names: taken from a source
    for key, storage in enumerate(storages):
        names = users.get(id(storage), [])
        picked = {job.sources.get(n, 0) for n in names} or {0}
        if len(picked) > 1:
            raise CheckpointError(
                f"{job.base_file}: tensors {', '.join(names)} share one storage but their rows "
                f"({', '.join(sorted({job.rows.get(n, '?') for n in names}))}) are picked from different "
                "checkpoints; pick them from the same one")
        s = picked.pop()
        if s == 0:
            record = records[f"{prefix}data/{storage.key}"]
            fills.append(Copied(job.base_file, record, record.data_offset, storage_bytes(storage)))
        else:
            fills.append(job.weights[s].storage(names[0], obj[names[0]]))
            replaced.append((records[f"{prefix}data/{storage.key}"], fills[-1]))
            taken[key] = names
        counter.add(2 * storage_bytes(storage))
    out = out_dir / job.name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        crcs = _patch_clone(job, out, records, replaced, counter) if options.clone else None
        if crcs is not None:
            counter.finish()
            return _took(job, out, taken, crcs)
        archive = write_archive(out, archive=prefix.rstrip("/"), pickle=data, storages=fills)
        with contextlib.ExitStack() as stack:
            fd = open_fd(stack, out, os.O_WRONLY)
            fsync(fd, options.durable)
            os.fchmod(fd, os.stat(job.base_file).st_mode & 0o777 | 0o200)
    except OSError as exc:
        raise output_error(exc, out) from None
    counter.finish()
    return _took(job, out, taken, [_crc(archive[f"{prefix}data/{key}"]) for key in taken])


def _crc(record: Record) -> int:
    assert record.crc is not None, "write_archive writes zip archives"
    return record.crc


def _took(job: BinFileJob, out: Target, taken: dict[int, list[str]], crcs: list[int]) -> FileComposed:
    """What `job`'s file `out` took: `taken`'s storages, in order, their CRC-32s `crcs`, under each tensor's
    name; and its records as written (`compose.taken.written`)."""
    return FileComposed(job.name, {name: crc for names, crc in zip(taken.values(), crcs, strict=True)
                                   for name in names}, archive=written(out)[path_of(out).name])


def _patch_clone(job: BinFileJob, out: Target, records: Mapping[str, Record], replaced: list[tuple[Record, Copied]],
                 counter: ByteCounter) -> list[int] | None:
    """Where the filesystem shares blocks (`cloning`) and the picked storages are less than half the
    file: the output is a clone of the base's file with each picked storage's record written over
    from its source's (read whole and checked against its CRC-32 first), and that record's CRC-32
    set to the source's. The base's other `records`, shared with the clone, are each read once and
    checked against their stored CRC-32 (`read_structure` refused an archive whose records overlap or
    run past its directory). Returns the CRC-32 of each picked storage, as written; None (nothing
    left at `out`): written whole instead."""
    size = os.stat(job.base_file).st_size
    if (file_format(job.base_file) != "zip" or not worth_it(sum(r.size for r, _c in replaced), size)
            or any(r.crc is None or r.size != c.size for r, c in replaced)):
        return None  # a legacy archive (re-written as zip), or a record not the storage's size: written whole
    with contextlib.ExitStack() as stack:
        fin = open_fd(stack, job.base_file)
        fout = open_fd(stack, out, CREATE)
        how = clone(fin, fout)
        if how is None:
            out.unlink()  # (ours, just made: the archive is written in its place)
            return None
        sources, buffer, crcs = OpenFiles(stack), memoryview(bytearray(READ_CHUNK)), []
        gone = {id(record) for record, _what in replaced}
        for record in sorted(records.values(), key=lambda r: r.data_offset):
            if id(record) not in gone:  # kept, its blocks shared: read once all the same, and checked
                checked_crcs(fin, job.base_file, record, [], buffer, on_bytes=lambda _n: counter.look())
        for record, what in replaced:
            src = sources.fd(what.path)
            value = (checked_crcs(src, what.path, what.record, [(what.offset, what.size)], buffer) or [0])[0]
            copy_range(src, fout, what.offset, what.size, out_offset=record.data_offset)
            for at in record.crc_offsets:
                os.pwrite(fout, struct.pack("<I", value), at)
            crcs.append(value)
        fsync(fout, counter.options.durable)
        os.fchmod(fout, os.stat(job.base_file).st_mode & 0o777 | 0o200)
    counter.shares(size - sum(r.size for r, _c in replaced), how)
    return crcs
