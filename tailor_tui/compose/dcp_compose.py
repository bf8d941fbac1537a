"""A DCP composition written (`--apply` of a recipe whose base is a PyTorch Distributed Checkpoint): the base's
run-level files copied (the HF Trainer's: checked as torch reads them, their CRC-32s recorded), each output
file's archives copied from its source file (`copy_file_job`, a worker's task), then each DCP folder's
`.metadata` and the provenance record, and the folder renamed into place (`DcpComposing`).

Each archive is read as torch's reader reads it (`dcp.reading.archive_records`; a chunk's tensor checked to
be the chunk its entry lists, `locate_chunk`), every record's stored CRC-32 checked against its bytes (a
rotten source is refused, never copied), then copied byte for byte in the kernel (shared blocks where the
filesystem can: a base file starts as its clone, its archives then only checked). Memory: a 1 MiB buffer,
whatever the sizes. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checked.evidence import checked_crcs
from tailor_tui.checked.files import read_as_planned
from tailor_tui.checked.ranges import READ_CHUNK
from tailor_tui.checkpoints.checkpoint import COPIED
from tailor_tui.checkpoints.dcp_checkpoint import part_metadata
from tailor_tui.cloning import clone
from tailor_tui.compose.compose_run import copy_run_file
from tailor_tui.dcp.metadata import METADATA, ChunkStorageMetadata, StorageInfo, dumps
from tailor_tui.dcp.reading import archive_records, locate_chunk
from tailor_tui.errors import Cancelled, NonFiniteError, OutputError
from tailor_tui.events import ByteCounter, Emit, TaskFinished, TaskOptions, progress_of, written_and_shared
from tailor_tui.fileio import (
    CREATE,
    Folder,
    Writeback,
    copy_range,
    create_sized,
    fsync,
    open_fd,
    output_error,
    write_file,
)
from tailor_tui.formats import nonfinite
from tailor_tui.held import HeldFolder
from tailor_tui.planning.dcp_layout import DcpJob
from tailor_tui.planning.dcp_plan import DcpComposePlan, DcpFileJob, dcp_provenance
from tailor_tui.team.transaction import Declaration, PublishingWork, Task, run_as_team


@dataclass(frozen=True, kw_only=True)
class DcpComposed:
    output: Path
    seconds: float
    bytes_written: int
    bytes_shared: int = 0  # of its files, sharing the base's blocks (a clone), not written
    shared_how: str = ""

    def amount(self) -> str:
        """What the output cost, as the composer says it: its bytes written, or shared."""
        return written_and_shared(self.bytes_written, self.bytes_shared, self.shared_how)

    def unread(self) -> list[str]:
        """What it did not read again (`Composed.unread`): a DCP composition reads every archive it copies."""
        return []


def copy_file_job(job: DcpFileJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                  options: TaskOptions = TaskOptions()) -> None:
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    buffer = memoryview(bytearray(READ_CHUNK))
    entries = dict(job.entries)
    path = job.source / job.source_file
    with contextlib.ExitStack() as stack:
        src = open_fd(stack, path)
        try:
            out = open_fd(stack, out_dir / job.out_file, CREATE)
        except OSError as exc:
            raise output_error(exc, out_dir / job.out_file) from None
        writeback = Writeback(out, options.durable)
        # a base file starts as its clone where the filesystem shares blocks: its archives are then only checked
        # (those of rows taken elsewhere stay in it, unlisted); else each is copied where it lies
        cloned = clone(src, out) if job.in_place and options.clone else None
        for copy in job.copies:
            info = StorageInfo(job.source_file, copy.at, copy.length)
            entry = entries[copy.key]
            records = archive_records(job.source, src, info, f"the archive of {copy.key}")
            if entry is not None:  # a chunk: its archive is that chunk of that tensor
                chunk = ChunkStorageMetadata(copy.chunk or (), next(c.sizes for c in entry.chunks
                                                                    if c.offsets == copy.chunk))
                locate_chunk(job.source, src, entry, chunk, info, records=records)
            found = [0]

            def count(_offset: int, data: memoryview, dtype: str | None = entry.dtype if entry else None,
                      found: list[int] = found) -> None:
                found[0] += nonfinite.count(data, dtype) if dtype in nonfinite.EXPONENT else 0

            for name, record in records.items():
                if record.size:
                    checked_crcs(src, path, record, [], buffer, inspect=count if name == "data/0" else None)
            if found[0] and not job.allow_nonfinite:
                row = dict(job.rows).get(copy.key)
                raise NonFiniteError(f"{copy.key}{f' (row {row})' if row else ''} holds {found[0]:,} NaN/Inf values "
                                     f"in {path}: the output would hold them; pick a checkpoint where "
                                     f"{'that row' if row else 'it'} is finite, or pass --allow-nonfinite")
            if cloned is None:
                copy_range(src, out, copy.at, copy.length, on_bytes=counter.add, out_offset=copy.to,
                           writeback=writeback)
            else:
                counter.add(copy.length)
        if cloned is not None:
            counter.shares(os.fstat(src).st_size, cloned)
        fsync(out, options.durable)
    counter.finish()


class DcpComposing(PublishingWork):
    """A DCP composition's stages (`transaction`): the hidden folder; each output file copied by the workers;
    `.metadata`, the provenance record, and the folder renamed into place."""

    cancelled = "composition cancelled; nothing was written to the output path"
    finished = "cancelled as the composition finished: {output} is complete"

    def __init__(self, plan: DcpComposePlan, workers: int | None, options: TaskOptions,
                 write_rows: Callable | None = None):
        super().__init__(plan.output, plan.force, options)
        self.plan, self.workers_asked, self.write_rows = plan, workers, write_rows
        self.copied: dict[str, int] = {}  # the base's run-level files copied: name -> CRC-32

    def begin(self) -> Declaration:
        return Declaration(progress=progress_of(self.plan.jobs), workers=self.workers_asked)

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        base = self.plan.base
        for part in filter(None, base.parts):
            try:
                (tmp / part).mkdir()
            except OSError as exc:
                raise output_error(exc, tmp / part) from None
        for name in self.plan.copied:
            if cancel.is_set():
                raise Cancelled()
            self.copied[name] = copy_run_file(base.path / name, tmp / name, base.path.parent, self.durable)
        for job in self.plan.jobs:  # a ZeRO-3 source's rows: each rank's file made at its size, filled by a worker
            if isinstance(job, DcpJob):
                create_sized(tmp / job.out_file, job.size)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        held, plan = self.folder(shared), self.plan
        if self.write_rows is None and any(isinstance(job, DcpJob) for job in plan.jobs):
            raise OutputError("a ZeRO-3 checkpoint's rows are planned, and no writer of them given (internal error)")
        return [Task(read_as_planned, job, (copy_file_job if isinstance(job, DcpFileJob) else self.write_rows,
                                            plan.identities_of(job.files_read()), held))
                for job in plan.jobs]

    def publish(self) -> None:
        held = self.hidden
        assert held is not None, "folder() named it before any task ran"
        for part in self.plan.base.parts:
            metadata = part_metadata(self.plan.metadata, part, str(self.plan.output / part))
            write_file(held / part / METADATA, dumps(metadata), self.durable)
        self.publish_folder(dcp_provenance(self.plan) | {"format": "dcp", COPIED: dict(sorted(self.copied.items()))})


def run_dcp_compose(plan: DcpComposePlan, *, workers: int | None = None, emit: Emit = lambda e: None,
                    cancel: threading.Event | None = None, options: TaskOptions = TaskOptions(),
                    write_rows: Callable | None = None) -> DcpComposed:
    """Write `plan`'s output. `write_rows`: the writer of a ZeRO-3 source's rows, rank by rank (`export.dcp_rank`'s:
    the writers of a composition and of an export know nothing of each other; the front end hands it over)."""
    started = time.monotonic()
    shared: dict[str, tuple[int, str]] = {}

    def seen(event) -> None:
        if isinstance(event, TaskFinished) and event.shared:
            shared[event.task] = (event.shared, event.shared_how)
        emit(event)

    run_as_team(DcpComposing(plan, workers, options, write_rows), emit=seen, cancel=cancel, options=options)
    return DcpComposed(output=plan.output, seconds=time.monotonic() - started, bytes_written=plan.bytes_to_write(),
                       bytes_shared=sum(n for n, _how in shared.values()),
                       shared_how=", ".join(sorted({how for _n, how in shared.values()})))
