"""Export a composition as a plain HF model folder (`tailor-tui --export recipe.yaml --to DIR`).

The folder `AutoModelForCausalLM.from_pretrained(DIR)` loads: the composition's fp32 master
weights cast to the export dtype in safetensors shards (`export_plan`, `export_rank`), the
model's `config.json` (its dtype set to the export's), `generation_config.json` and tokenizer
files (from an HF base, or `--config`), and `tailor_provenance.json`. Written as `--apply`
writes: in a hidden folder beside the destination, renamed into place only when whole; an
earlier tailor-tui output is replaced only with `--force`; sources are only read.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import PROVENANCE
from tailor_tui.checkpoints.side_files import load_json
from tailor_tui.errors import Cancelled, UsageError
from tailor_tui.events import Emit, TaskOptions
from tailor_tui.export.plan import Export
from tailor_tui.export.rank import export_rank
from tailor_tui.fileio import copy_file, fsync_dir, output_error, pwrite_all, write_file
from tailor_tui.planning.provenance import provenance
from tailor_tui.planning.output import OUTPUT_FILES, hidden_folder, output_lock, publish, signals_held, written_files
from tailor_tui.formats.safetensors_out import INDEX
from tailor_tui.team.transaction import Task, TeamWork, run_as_team

CONFIG = "config.json"
# what save_pretrained and a tokenizer's save_pretrained write beside the weights
COMPANIONS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
MAX_CONFIG = 4 << 20
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ExportResult:
    output: Path
    seconds: float
    bytes_written: int
    config: Path | None  # where config.json came from; None: the folder has weights only


def config_source(export: Export, config: Path | None) -> Path | None:
    """The folder or config.json the model's config comes from: `--config`, else an HF base."""
    if config is not None:
        path = config / CONFIG if config.is_dir() else config
        if path.exists() and not path.is_file():
            raise UsageError(f"config {path}: not a regular file (a FIFO, a device or a socket), not read; name "
                             "the model's config.json with --config")
        if not path.is_file():
            raise UsageError(f"config {config}: no {CONFIG} there; name the model's config.json or a folder "
                             "holding it (and the tokenizer files)")
        return path
    base = export.plan.base
    return base.path / CONFIG if base.kind == "hf" and (base.path / CONFIG).is_file() else None


def run_export(export: Export, *, config: Path | None, workers: int, emit: Emit = lambda e: None,
               cancel: threading.Event | None = None, options: TaskOptions = TaskOptions()) -> ExportResult:
    started = time.monotonic()
    source = config_source(export, config)
    run_as_team(Exporting(export, source, workers, options), emit=emit, cancel=cancel, options=options)
    return ExportResult(export.plan.output, time.monotonic() - started, export.bytes_to_write(), source)


class Exporting(TeamWork[None]):
    """An export's stages (`transaction`): the hidden folder with every shard's header, the
    config and tokenizer files; each source rank's weights written into the shards by the
    workers; the provenance record, and the folder renamed into place."""

    cancelled = "export cancelled; nothing was written to the output path"

    def __init__(self, export: Export, source: Path | None, workers: int, options: TaskOptions):
        self.export, self.source, self.workers_asked = export, source, workers
        self.durable, self.exchange = options.durable, options.exchange
        self.tmp: Path | None = None
        self.published = False

    def progress_tasks(self) -> list[tuple[str, int]]:
        return [(job.task, job.total_bytes) for job in self.export.jobs]

    def held(self, lead: bool):
        return output_lock(self.export.plan.output)

    def prepare(self, cancel: threading.Event) -> str:
        plan = self.export.plan
        with signals_held():  # a Ctrl-C waits until `abandon` knows the folder it must remove
            self.tmp = hidden_folder(plan.output, plan.force)
        _make_files(self.export, self.tmp, self.durable)
        if self.source is not None:
            _write_config(self.source, self.tmp, self.export.dtype, self.durable)
        return str(self.tmp)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        self.tmp = Path(shared)
        return [Task(export_rank, job, (self.tmp,)) for job in self.export.jobs]

    def workers(self, mine: list[Task]) -> int:
        return self.workers_asked

    def publish(self) -> None:
        plan, tmp = self.export.plan, self.tmp
        source = str(self.source) if self.source else None
        record = provenance(plan) | {"export": {"dtype": self.export.dtype, "config": source},
                                     OUTPUT_FILES: written_files(tmp)}
        write_file(tmp / PROVENANCE, json.dumps(record, indent=2) + "\n", self.durable)
        fsync_dir(tmp, self.durable)
        with signals_held():
            publish(tmp, plan.output, plan.force, self.durable, self.exchange)
            self.published = True

    def abandon(self, shared: str | None, exc: BaseException, cleans: bool) -> BaseException | None:
        if self.published:
            if isinstance(exc, KeyboardInterrupt):
                return Cancelled(f"cancelled as the export finished: {self.export.plan.output} is complete")
            return None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return Cancelled(self.cancelled) if isinstance(exc, KeyboardInterrupt) else None


def _make_files(export: Export, tmp: Path, durable: bool) -> None:
    """Every shard at its full size with its header in place (the tensors' bytes come from the
    workers), and the index when there are several."""
    for f in export.files:
        path = tmp / f.name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, f.size)
                pwrite_all(fd, f.header, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise output_error(exc, path) from None
    if export.index is not None:
        write_file(tmp / INDEX, json.dumps(export.index, indent=2) + "\n", durable)


def _write_config(source: Path, tmp: Path, dtype: str, durable: bool) -> None:
    """config.json with its dtype the export's; the generation config and tokenizer files beside it."""
    try:
        config = load_json(source, limit=MAX_CONFIG)
    except OSError as exc:
        raise UsageError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(f"{source}: not a model config ({exc}); name the model's config.json with --config") from None
    if not isinstance(config, dict):
        raise UsageError(f"{source}: not a model config (a JSON object); name the model's config.json with --config")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = TORCH_DTYPE[dtype]
    write_file(tmp / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n", durable)
    for name in COMPANIONS:
        companion = source.parent / name
        if companion.is_file():
            try:
                copy_file(companion, tmp / name, durable=durable)
            except OSError as exc:
                raise output_error(exc, tmp / name) from None

