"""Export a composition as a PyTorch Distributed Checkpoint (`--export X --to DIR --format dcp`).

The folder `torch.distributed.checkpoint.load` reads (`FileSystemReader`): one `__N_0.distcp` file per
source rank holding its chunks (`dcp_export_plan`, `dcp_rank`), one of the step counts and param groups, and
`.metadata`, written last; `tailor_provenance.json` beside them. Written as `--apply` writes: in a
hidden folder beside the destination, renamed into place only when whole; an earlier tailor-tui output
is replaced only with `--force`; sources are only read.
"""

from __future__ import annotations

import threading
import time

from tailor_tui.checked.files import read_as_planned
from tailor_tui.dcp.metadata import METADATA, dumps
from tailor_tui.events import Emit, TaskOptions, progress_of
from tailor_tui.export.dcp_export_plan import DcpExport
from tailor_tui.export.dcp_rank import export_dcp_rank
from tailor_tui.export.export_run import Exporting, ExportResult
from tailor_tui.fileio import create_sized, write_file
from tailor_tui.held import HeldFolder
from tailor_tui.planning.provenance import provenance
from tailor_tui.team.transaction import Declaration, PublishingWork, Task, run_as_team

FORMAT = "dcp"  # --format's name for it


def run_dcp_export(export: DcpExport, *, workers: int | None = None, emit: Emit = lambda e: None,
                   cancel: threading.Event | None = None, options: TaskOptions = TaskOptions()) -> ExportResult:
    started = time.monotonic()
    run_as_team(DcpExporting(export, workers, options), emit=emit, cancel=cancel, options=options)
    return ExportResult(export.plan.output, time.monotonic() - started, export.bytes_to_write(), None)


class DcpExporting(PublishingWork):
    """A DCP export's stages (`transaction`): the hidden folder with every `.distcp` file at its size and the
    small one written; each source rank's chunks written by the workers; `.metadata`, the provenance
    record, and the folder renamed into place."""

    cancelled, finished = Exporting.cancelled, Exporting.finished

    def __init__(self, export: DcpExport, workers: int | None, options: TaskOptions):
        super().__init__(export.plan.output, export.plan.force, options)
        self.export, self.workers_asked = export, workers

    def begin(self) -> Declaration:
        return Declaration(progress=progress_of(self.export.jobs), workers=self.workers_asked)

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        for job in self.export.jobs:
            create_sized(tmp / job.out_file, job.size)
        write_file(tmp / self.export.small_file, self.export.small, self.durable)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        held, plan = self.folder(shared), self.export.plan
        return [Task(read_as_planned, job, (export_dcp_rank, plan.identities_of(job.files_read()), held))
                for job in self.export.jobs]

    def publish(self) -> None:
        held = self.hidden
        assert held is not None, "folder() named it before any task ran"
        write_file(held / METADATA, dumps(self.export.metadata), self.durable)
        self.publish_folder(provenance(self.export.plan) | {"export": {"format": FORMAT,
                                                                       "optimizer": self.export.optimizer}})
