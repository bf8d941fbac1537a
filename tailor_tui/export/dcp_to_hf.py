"""A composition of PyTorch Distributed Checkpoints (or one checkpoint) exported as a plain HF model folder
(`--export X --to DIR` where X's base is a DCP checkpoint): planned (`plan_dcp_hf`), each source file's chunks
written into the safetensors shards (`export_dcp_file`, a worker's task), the folder as `--export` writes one
(`DcpHfExporting`: config and tokenizer from `--config`, provenance, renamed into place when whole).

Every `model.<name>` tensor of the composition is one tensor of the model, named `<name>` (a tied name, which
save_pretrained does not write, left out), in the export's dtype (default: as saved), in the files
save_pretrained shards the state dict into (`safetensors_out.lay_out`, the metadata's order). A chunk is a
rectangle of its tensor: its elements lie in the tensor's row-major bytes as runs of whole rows of its last
partial dimension (`runs`); each is written, cast, to its place as the chunk's record streams by, its CRC-32
checked against the one its archive stores, its NaN/Inf counted (refused unless `--allow-nonfinite`).
Memory: a 1 MiB buffer. Torch-free.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checked.files import read_as_planned
from tailor_tui.checkpoints.dcp_checkpoint import MODEL, DcpCheckpoint
from tailor_tui.dcp.chunks import ITEMSIZE
from tailor_tui.dcp.metadata import ChunkStorageMetadata, MetadataIndex, StorageInfo, TensorStorageMetadata
from tailor_tui.dcp.reading import locate_chunk
from tailor_tui.errors import RECOPY, CheckpointError, NonFiniteError, UsageError
from tailor_tui.events import ByteCounter, Emit, JobCost, TaskOptions, progress_of
from tailor_tui.export.export_run import Exporting, ExportResult, make_files, write_config
from tailor_tui.fileio import Folder, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats import nonfinite
from tailor_tui.formats.dtypes import PRECISION, SAFETENSORS_NAME, cast
from tailor_tui.formats.safetensors_out import ShardFile, lay_out
from tailor_tui.held import HeldFolder
from tailor_tui.planning.dcp_plan import DcpComposePlan, dcp_provenance
from tailor_tui.team.transaction import Declaration, PublishingWork, Task, run_as_team

PIECE = 1 << 20


@dataclass(frozen=True)
class ChunkOut:
    """One chunk of tensor `key` (`offsets`, `sizes` of its `shape`), written from byte `out_offset` of `out_file`
    (the tensor's start) on, in `out_dtype`."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    out_file: str
    out_offset: int
    out_dtype: str
    at: int  # where its archive lies in the source file, and its length (the source's metadata says)
    length: int


@dataclass(frozen=True)
class DcpHfJob(JobCost):
    """One source file's chunks of an HF export (picklable)."""

    task: str
    source: Path
    source_file: str
    chunks: tuple[ChunkOut, ...]
    entries: tuple[tuple[str, TensorStorageMetadata], ...]
    allow_nonfinite: bool
    read_bytes: int
    write_bytes: int

    def files_read(self) -> tuple[Path, ...]:
        return (self.source / self.source_file,)


@dataclass(frozen=True)
class DcpHfExport:
    plan: DcpComposePlan
    dtype: str | None  # fp32, bf16, fp16; None: each tensor as saved
    files: tuple[ShardFile, ...]
    index: dict | None
    jobs: tuple[DcpHfJob, ...]
    tensors: int

    def bytes_to_write(self) -> int:
        return sum(f.size for f in self.files)


def runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]):
    """(element in the tensor, elements) of each run of consecutive elements a chunk's rectangle is, in the
    chunk's own row-major order."""
    if not shape:
        yield 0, 1
        return
    partial = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
    length = sizes[partial] * math.prod(shape[partial + 1:])
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    outer = sizes[:partial]
    for flat in range(math.prod(outer)):
        index, start = flat, offsets[partial] * strides[partial]
        for d in reversed(range(partial)):
            index, i = divmod(index, outer[d])
            start += (offsets[d] + i) * strides[d]
        yield start, length


def plan_dcp_hf(plan: DcpComposePlan, dtype: str | None, max_shard: int, *, allow_nonfinite: bool) -> DcpHfExport:
    """The HF export of `plan`'s composition in `dtype` (fp32, bf16, fp16; None: as saved), shards of at most
    `max_shard` bytes; one job per source file it reads chunks from."""
    zero = next((src for src in plan.sources if not isinstance(src, DcpCheckpoint)), None)
    if zero is not None:
        raise UsageError(f"{zero.path}: rows taken from a ZeRO-3 checkpoint into a PyTorch Distributed Checkpoint are "
                         "exported once composed: --apply the recipe, then --export its output")
    dcp = [src for src in plan.sources if isinstance(src, DcpCheckpoint)]
    aliases = {alias for row in plan.base.rows for alias, _target in row.aliases}
    chosen = plan.metadata.state_dict_metadata
    tensors = [(key[len(MODEL):], entry) for key, entry in chosen.items()
               if key.startswith(MODEL) and key[len(MODEL):] not in aliases and isinstance(entry, TensorStorageMetadata)]
    out_dtype = {name: PRECISION[dtype] if dtype and entry.dtype in ("float32", "bfloat16", "float16") else entry.dtype
                 for name, entry in tensors}
    files, placed, index = lay_out([(name, entry.size, SAFETENSORS_NAME[out_dtype[name]]) for name, entry in tensors],
                                   max_shard)
    per_file: dict[tuple[int, str], list[ChunkOut]] = {}
    for name, entry in tensors:
        key = MODEL + name
        s = plan.taken[key]
        source = dcp[s].metadata
        for chunk in entry.chunks:
            info = source.storage_data[MetadataIndex(key, chunk.offsets)]
            per_file.setdefault((s, info.relative_path), []).append(ChunkOut(
                key, chunk.offsets, chunk.sizes, entry.size, placed[name].file, placed[name].offset, out_dtype[name],
                info.offset, info.length))
    jobs = []
    saved_dtype = dict(tensors)
    for (s, file), chunks in sorted(per_file.items()):
        src = dcp[s]
        read = sum(math.prod(c.sizes) * ITEMSIZE[saved_dtype[c.key[len(MODEL):]].dtype] for c in chunks)
        written = sum(math.prod(c.sizes) * ITEMSIZE[c.out_dtype] for c in chunks)
        entries = tuple((key, e) for key in dict.fromkeys(c.key for c in chunks)
                        if isinstance(e := src.metadata.state_dict_metadata[key], TensorStorageMetadata))
        jobs.append(DcpHfJob(f"{src.name}{' (base)' if s == 0 else ''} {file}", src.path, file, tuple(chunks),
                             entries, allow_nonfinite, read, written))
    return DcpHfExport(plan, dtype, tuple(files), index, tuple(jobs), len(tensors))


def export_dcp_file(job: DcpHfJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                    options: TaskOptions = TaskOptions()) -> None:
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    entries = dict(job.entries)
    path = job.source / job.source_file
    with contextlib.ExitStack() as stack:
        src = open_fd(stack, path)
        outputs: dict[str, int] = {}
        for chunk in job.chunks:
            if chunk.out_file not in outputs:
                try:
                    outputs[chunk.out_file] = open_fd(stack, out_dir / chunk.out_file, os.O_WRONLY)
                except OSError as exc:
                    raise output_error(exc, out_dir / chunk.out_file) from None
            _write_chunk(src, path, job, entries[chunk.key], chunk, outputs[chunk.out_file], counter)
        for fd in outputs.values():
            fsync(fd, options.durable)
    counter.finish()


def _write_chunk(src: int, path: Path, job: DcpHfJob, entry: TensorStorageMetadata, chunk: ChunkOut, out: int,
                 counter: ByteCounter) -> None:
    """Stream one chunk's record, writing each run of its elements, cast, to its place in the tensor."""
    found = locate_chunk(job.source, src, entry, ChunkStorageMetadata(chunk.offsets, chunk.sizes),
                         StorageInfo(job.source_file, chunk.at, chunk.length))
    size, out_size = ITEMSIZE[entry.dtype], ITEMSIZE[chunk.out_dtype]
    starts = [start for start, _n in runs(chunk.offsets, chunk.sizes, chunk.shape)]
    run = found.numel // max(len(starts), 1)
    crc, bad, element = 0, 0, 0
    step = PIECE - PIECE % size
    for at in range(0, found.record.size, step):
        data = os.pread(src, min(step, found.record.size - at), found.record.data_offset + at)
        crc = zlib.crc32(data, crc)
        if entry.dtype in nonfinite.EXPONENT:
            bad += nonfinite.count(data, entry.dtype)
        values, done, count = memoryview(cast(data, entry.dtype, chunk.out_dtype)), 0, len(data) // size
        while done < count:  # the piece's elements, run by run
            r, within = divmod(element, run)
            take = min(run - within, count - done)
            pwrite_all(out, values[done * out_size:(done + take) * out_size],
                       chunk.out_offset + (starts[r] + within) * out_size)
            done, element = done + take, element + take
        counter.add(len(data))
    if crc != found.record.crc:
        raise CheckpointError(f"{path}: the chunk of {chunk.key} at {list(chunk.offsets)} fails its CRC-32 check (its "
                              f"bytes changed since it was saved); {RECOPY}")
    if bad and not job.allow_nonfinite:
        raise NonFiniteError(f"{chunk.key} holds {bad:,} NaN/Inf values in {path}: the exported model would hold "
                             "them; pick a checkpoint where its row is finite, or pass --allow-nonfinite")


class DcpHfExporting(PublishingWork):
    """A DCP composition's HF export, in the stages of `--export`'s (`export_run.Exporting`)."""

    cancelled, finished = Exporting.cancelled, Exporting.finished

    def __init__(self, export: DcpHfExport, config: Path | None, workers: int | None, options: TaskOptions):
        super().__init__(export.plan.output, export.plan.force, options)
        self.export, self.config, self.workers_asked = export, config, workers

    def begin(self) -> Declaration:
        return Declaration(progress=progress_of(self.export.jobs), workers=self.workers_asked)

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        make_files(self.export.files, self.export.index, tmp, self.durable)
        if self.config is not None:
            dtypes = {e.dtype for e in self.export.plan.metadata.state_dict_metadata.values()
                      if isinstance(e, TensorStorageMetadata)}
            saved = next((p for p, name in PRECISION.items() if dtypes == {name}), "fp32")
            write_config(self.config, tmp, self.export.dtype or saved, self.durable)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        held, plan = self.folder(shared), self.export.plan
        return [Task(read_as_planned, job, (export_dcp_file, plan.identities_of(job.files_read()), held))
                for job in self.export.jobs]

    def publish(self) -> None:
        self.publish_folder(dcp_provenance(self.export.plan) | {"export": {
            "format": "hf", "from": "dcp", "dtype": self.export.dtype, "config": str(self.config) if self.config else None}})


def run_dcp_hf_export(export: DcpHfExport, *, config: Path | None, workers: int | None = None,
                      emit: Emit = lambda e: None, cancel: threading.Event | None = None,
                      options: TaskOptions = TaskOptions()) -> ExportResult:
    started = time.monotonic()
    run_as_team(DcpHfExporting(export, config, workers, options), emit=emit, cancel=cancel, options=options)
    return ExportResult(export.plan.output, time.monotonic() - started, export.bytes_to_write(), config)
