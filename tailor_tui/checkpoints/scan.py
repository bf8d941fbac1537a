"""Scanning a run directory: every folder that names a checkpoint, opened (rank 0's small
model_states file only, cached), ordered by step; folders that look like checkpoints but cannot be
used are reported, not raised. What tailor-tui itself composed (a folder holding its provenance
record) is kept apart: an output is never a column, a base or a statistic of the run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from tailor_tui.checkpoints.cache import ROOT, Where, chosen
from tailor_tui.checkpoints.checkpoint import (
    PARTIAL_MANIFEST,
    PROVENANCE,
    Checkpoint,
    is_tag_dir,
    open_checkpoint,
    read_latest,
    written_by_tailor,
)
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json
from tailor_tui.errors import CheckpointError, UsageError
from tailor_tui.kinds.folders import TRAINER_STATE, folder_kind
from tailor_tui.units import read_as


class Output(NamedTuple):
    """A folder tailor-tui composed, found where the run's checkpoints are: never a column."""

    folder: Path  # the folder holding its provenance record
    step: int
    sources: tuple[str, ...]  # folder names of the checkpoints its record names, base first


@dataclass(frozen=True)
class ScanResult:
    checkpoints: tuple[Checkpoint, ...]  # the run's training checkpoints, ordered by step
    problems: tuple[tuple[Path, str], ...]  # folders that look like checkpoints but are not usable
    outputs: tuple[Output, ...] = ()  # what tailor-tui composed here (its provenance record): never a column

    def nothing_found(self, root: Path) -> str:
        """What to say when the scan found no training checkpoint under `root`."""
        if self.outputs:
            made = "; ".join(f"{o.folder.name} (from {', '.join(o.sources) or 'sources its record does not name'})"
                             for o in self.outputs)
            return (f"{root}: holds no training checkpoint, only what tailor-tui composed: {made}; "
                    "open the run those came from")
        return (f"{root}: holds no ZeRO-3 checkpoint (looked for HF checkpoint-N folders "
                "(trainer_state.json and a `latest` file), DeepSpeed tag folders (zero_pp_rank_*_model_states.pt) "
                "and partial saves (tailor_partial.json))")


def output_folder(output: Checkpoint) -> Path:
    """The folder tailor-tui wrote (holding its provenance record): the checkpoint's own, or in
    DeepSpeed layout the folder holding its tag."""
    return output.path if (output.path / PROVENANCE).is_file() else output.save_dir


def composed_from(output: Checkpoint) -> list[str]:
    """The folder names of the checkpoints an output's provenance record names (base first)."""
    try:
        record = load_json(output_folder(output) / PROVENANCE, MAX_RECORD)
        paths = [record["base"]["path"], *(s["path"] for s in record["sources"])]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return list(dict.fromkeys(Path(p).name for p in paths if isinstance(p, str)))


# a partial save not yet published (tailor_tui.selective)
STAGING = re.compile(r"^\.partial-step\d+\.saving$", re.ASCII)


RECIPE_SUFFIXES = (".yaml", ".yml")


def run_of_checkpoint(path: Path) -> Path | None:
    """The run folder of the checkpoint folder `path` (a DeepSpeed tag folder, or a folder holding
    `latest` and its tag: an HF checkpoint-N, a save_dir); None when `path` is no checkpoint."""
    tag = read_latest(path) if (path / "latest").is_file() else None
    if not (is_tag_dir(path) or (tag is not None and folder_kind(path, tag) is not None)):
        return None
    run = path.resolve().parent
    if (run / TRAINER_STATE).is_file():  # the tag folder inside an HF checkpoint-N
        run = run.parent
    return run


def check_run_folder(path: Path) -> None:
    """`path` names a run folder (the folder holding a run's checkpoints), or one line says
    what it names instead and what was probably meant."""
    if path.is_dir():
        run = run_of_checkpoint(path)
        if run is not None:
            raise UsageError(f"{path}: is one checkpoint, not a run folder; name its run, {run} (the folder that "
                             "holds the run's checkpoints), so there are checkpoints to compare and pick from")
        return
    if path.suffix in RECIPE_SUFFIXES and path.exists():
        raise UsageError(f"{path}: is a recipe, not a run folder; compose it with `tailor-tui --apply {path}`, "
                         f"or open its run with `tailor-tui RUN_DIR --recipe {path}`")
    if path.exists():
        raise UsageError(f"{path}: is a file, not a run folder; name the folder that holds the run's checkpoints")
    raise CheckpointError(f"{path}: no such folder; name the folder that holds the run's checkpoints")


def find_checkpoint_dirs(root: Path, interrupted: list[Path] | None = None) -> list[Path]:
    """Folders under `root` that name a checkpoint, without reading any checkpoint file.
    Hidden folders are never checkpoints (a partial save being written, a composition's temp
    folder); partial saves a kill interrupted are added to `interrupted` when given."""
    found: list[Path] = []
    for dirpath, dirnames, _files in os.walk(root):
        here = Path(dirpath)
        if interrupted is not None:
            interrupted += [here / d for d in dirnames if STAGING.match(d)]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if os.path.lexists(here / PARTIAL_MANIFEST):  # one that is no regular file: a problem, not a full save
            found.append(here)
            dirnames.clear()
        elif is_tag_dir(here):
            # A tag folder inside an HF checkpoint-N (or Accelerate checkpoint_N) folder is named by its parent.
            parent = here.parent
            if not (_latest(parent, root) == here.name and folder_kind(parent, here.name)):
                found.append(here)
            dirnames.clear()
        elif (tag := _latest(here, root)) and folder_kind(here, tag):
            found.append(here)
            dirnames[:] = [d for d in dirnames if d != tag]
        elif tag is _LEAVES and here != root:  # opening it says why it is unusable
            found.append(here)
            dirnames.clear()
        dirnames.sort()
    return found


def is_training_checkpoint(folder: Path) -> bool:
    """Whether `folder` itself is a checkpoint that training saved, as `find_checkpoint_dirs` tells
    one (a partial save, a DeepSpeed tag folder, an HF Trainer or Accelerate checkpoint folder, or
    the tag folder inside one), not one that tailor-tui composed. Reads no checkpoint file."""
    if os.path.lexists(folder / PARTIAL_MANIFEST):
        return not written_by_tailor(folder, folder, folder)
    if is_tag_dir(folder):
        parent = folder.parent
        if read_latest(parent) == folder.name and folder_kind(parent, folder.name):
            return not written_by_tailor(parent, folder, parent)
        return not written_by_tailor(folder, folder, parent)
    tag = read_latest(folder) if folder.is_dir() else None
    if not tag or not folder_kind(folder, tag):
        return False
    return not written_by_tailor(folder, folder / tag, folder)


def training_checkpoints(root: Path) -> list[Path]:
    """The folders under `root` (itself included) that training saved as checkpoints, not those
    tailor-tui composed."""
    return [d for d in find_checkpoint_dirs(root) if is_training_checkpoint(d)]


_LEAVES = "\0"  # `_latest`: the file is a symbolic link that leaves the run


def _latest(folder: Path, root: Path) -> str | None:
    """The tag `folder/latest` names (`read_latest`), or _LEAVES where it is a link out of the run."""
    try:
        return read_latest(folder, run=root)
    except CheckpointError:
        return _LEAVES


def check_told_apart(root: Path, dirs: list[Path]) -> None:
    """CheckpointError (one line) where two checkpoint folders under `root` differ only in what does
    not show: invisible format characters (U+200B, a word joiner, a BOM, a soft hyphen) or look-alike
    compatibility forms (a fullwidth `６`) — `units.read_as`. A copy named `checkpoint-6` + U+200B
    would be a second `checkpoint-6` in every table, recipe and healing line; the scan refuses the run
    rather than guess which one is meant. Reads no file."""
    seen: dict[str, Path] = {}
    for folder in dirs:
        name = os.path.relpath(folder, root)
        first = seen.setdefault(read_as(name), folder)
        if first != folder:
            raise CheckpointError(
                f"{root}: checkpoint folders {os.path.relpath(first, root)} and {name} read as one name "
                f"({read_as(name)}): they differ only in invisible characters (Unicode format characters, shown "
                "escaped) or look-alike forms (fullwidth digits, ligatures: NFKC); rename or remove one, so each "
                "checkpoint has a name of its own")


def scan(
    root: str | Path,
    on_progress: Callable[[int, int, Path], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    *,
    cache: Path | None | Where = ROOT,
) -> ScanResult:
    """Open every checkpoint under `root`; unusable ones are reported, not raised (two whose names read
    as one are refused: `check_told_apart`). What each
    checkpoint's model_states file says is cached under `cache` (default: `cache.cache_dir()`,
    `scan_cache`); None reads every one."""
    root, cache = Path(root), chosen(cache)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such folder to scan")
    interrupted: list[Path] = []
    dirs = find_checkpoint_dirs(root, interrupted)
    check_told_apart(root, dirs)
    checkpoints, outputs = [], []
    problems = [(d, f"{d}: an interrupted partial save (a save killed before it was published); "
                    "safe to delete") for d in interrupted]
    for i, d in enumerate(dirs):
        if cancelled():
            break
        try:
            ckpt = open_checkpoint(d, cache=cache)
            if ckpt.composed:  # its record is read here, in the scan's thread, once
                outputs.append(Output(output_folder(ckpt), ckpt.step, tuple(composed_from(ckpt))))
            else:
                checkpoints.append(ckpt)
        except CheckpointError as exc:
            problems.append((d, str(exc)))
        if on_progress:
            on_progress(i + 1, len(dirs), d)
    checkpoints.sort(key=lambda c: (c.step, str(c.path)))
    outputs.sort(key=lambda o: (o.step, str(o.folder)))
    return ScanResult(tuple(checkpoints), tuple(problems), tuple(outputs))


def scan_run(root: Path, on_progress: Callable[[int, int, Path], None] | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> ScanResult:
    """The composer's scan of a run folder: an FSDP2 run's PyTorch Distributed Checkpoints where it holds them
    (columns described alike: `dcp_checkpoint.DcpCheckpoint`), else its ZeRO-3 checkpoints (`scan`), checked to
    be of one training run (`lineage.check_one_run`: it reads each trainer_state.json)."""
    from tailor_tui.checkpoints.dcp_checkpoint import scan_dcp
    from tailor_tui.checkpoints.lineage import check_one_run

    dcp = scan_dcp(root)
    if dcp:
        return ScanResult(tuple(dcp), ())  # type: ignore[arg-type]
    result = scan(root, on_progress=on_progress, cancelled=cancelled)
    check_one_run(root, result.checkpoints)
    return result
