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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checked.files import read_as_planned
from tailor_tui.checkpoints.side_files import load_json
from tailor_tui.errors import UsageError
from tailor_tui.events import Emit, TaskOptions, progress_of
from tailor_tui.export.export_plan import Export
from tailor_tui.export.rank import export_rank
from tailor_tui.fileio import copy_file, create_sized, output_error, write_file
from tailor_tui.formats.safetensors_out import INDEX
from tailor_tui.held import HeldFolder
from tailor_tui.kinds.folders import MODEL_CONFIG
from tailor_tui.planning.provenance import provenance
from tailor_tui.team.transaction import Declaration, PublishingWork, Task, run_as_team

CONFIG = MODEL_CONFIG  # (its name here, a documented one: `export.CONFIG`)
# what save_pretrained and a tokenizer's save_pretrained write beside the weights
COMPANIONS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ExportResult:
    output: Path
    seconds: float
    bytes_written: int
    config: Path | None  # where config.json came from; None: the folder has weights only


def config_file(config: Path) -> Path:
    """The config.json `--config` names (the file, or a folder holding it); UsageError where there is none."""
    path = config / CONFIG if config.is_dir() else config
    if path.exists() and not path.is_file():
        raise UsageError(f"config {path}: not a regular file (a FIFO, a device or a socket), not read; name "
                         "the model's config.json with --config")
    if not path.is_file():
        raise UsageError(f"config {config}: no {CONFIG} there; name the model's config.json or a folder "
                         "holding it (and the tokenizer files)")
    return path


def config_source(export: Export, config: Path | None) -> Path | None:
    """The folder or config.json the model's config comes from: `--config`, else an HF base."""
    if config is not None:
        return config_file(config)
    base = export.plan.base
    kept = base.folder.model_config
    return base.path / kept if kept is not None and (base.path / kept).is_file() else None


def run_export(export: Export, *, config: Path | None, workers: int | None = None, emit: Emit = lambda e: None,
               cancel: threading.Event | None = None, options: TaskOptions = TaskOptions()) -> ExportResult:
    started = time.monotonic()
    source = config_source(export, config)
    run_as_team(Exporting(export, source, workers, options), emit=emit, cancel=cancel, options=options)
    return ExportResult(export.plan.output, time.monotonic() - started, export.bytes_to_write(), source)


class Exporting(PublishingWork):
    """An export's stages (`transaction`): the hidden folder with every shard's header, the
    config and tokenizer files; each source rank's weights written into the shards by the
    workers; the provenance record, and the folder renamed into place."""

    cancelled = "export cancelled; nothing was written to the output path"
    finished = "cancelled as the export finished: {output} is complete"

    def __init__(self, export: Export, source: Path | None, workers: int | None, options: TaskOptions):
        super().__init__(export.plan.output, export.plan.force, options)
        self.export, self.source, self.workers_asked = export, source, workers

    def begin(self) -> Declaration:
        return Declaration(progress=progress_of(self.export.jobs), workers=self.workers_asked)

    def fill(self, tmp: HeldFolder, cancel: threading.Event) -> None:
        make_files(self.export.files, self.export.index, tmp, self.durable)
        if self.source is not None:
            base = self.export.plan.base  # its own config: read as its files are, no link out of its run
            within = base.path.parent if self.source == base.path / CONFIG else None
            write_config(self.source, tmp, self.export.dtype, self.durable, within)

    def tasks(self, shared: str, emit: Emit) -> list[Task]:
        held, plan = self.folder(shared), self.export.plan
        return [Task(read_as_planned, job, (export_rank, plan.identities_of(job.files_read()), held)) for job in self.export.jobs]

    def publish(self) -> None:
        source = str(self.source) if self.source else None
        self.publish_folder(provenance(self.export.plan) | {"export": {"dtype": self.export.dtype, "config": source}})


def make_files(files, index: dict | None, tmp: HeldFolder, durable: bool) -> None:
    """Every shard (`files`: `safetensors_out.ShardFile`s) at its full size with its header in place (the tensors'
    bytes come from the workers), and the index when there are several."""
    for f in files:
        create_sized(tmp / f.name, f.size, f.header)
    if index is not None:
        write_file(tmp / INDEX, json.dumps(index, indent=2) + "\n", durable)


def write_config(source: Path, tmp: HeldFolder, dtype: str, durable: bool, within: Path | None = None) -> None:
    """config.json with its dtype the export's; the generation config and tokenizer files beside it.
    `within`: the run folder of the base checkpoint they come from, which no symbolic link on the way
    may leave (`checked.files.confine`); None: a folder the user named with --config, read as it is."""
    try:
        config = load_json(source, within=within)  # a side file: 1 MiB unless $TAILOR_TUI_MAX_SIDE_FILE says more
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
                copy_file(companion, tmp / name, durable=durable, within=within)
            except OSError as exc:
                raise output_error(exc, tmp / name) from None

